"""Experiment: versions of the tensor-core prefill partials (psa_partials_sgmat.wgsl) and of the
combine (psa_merge.wgsl) that test where the prefill layer's time goes, each built from the
working tree's kernel by edits of its text (each edit must apply exactly, or the script stops).

Some versions give the kernel's bits (the same products in the same order), others are timing
only (their results wrong on purpose, said in their label). Each version is written to a folder
and timed by ``experiment_partials_ab.py`` against the kernel as it is (the bench's prefill layer
workload, GPU time of partials and combine, each version on a fresh device, alternating rounds,
outputs compared bit for bit). Run on a machine with Dawn and f16 subgroup matrices:

    python scripts/experiment_partials_variants.py [--only NAME ...] [--rounds 2] [--calls 4]

The versions apply to the kernel whose items load their queries and first K tile when they
start; the script at revision 0d2cd8a also holds ``noqpf`` and ``nokpf``, the versions that led
there (the kernel before loaded them during the item before, into registers), and the script at
revision c23094a ``nokey`` and ``ballots``, versions of the softmax as it was before its
positions' readability was looked up once per lane; at 656ea65 ``noatom`` (the rows' maxima
stored, not folded by atomics, which the kernel no longer uses where D = 128); at fb24a18
``vblock`` and ``interleave`` (the V block staged at once; the softmax's lanes reading and
writing interleaved words), for the split weights' layout before each lane wrote over its own
scores.

Versions (``NAME``):
  kdirect   the score products load K straight from the cache (no staged K tile, no barrier per
            K tile; every subgroup busy), same bits on finite data in valid pages
  chain2    each score tile summed in two accumulators (even and odd 16-column steps of the head
            dim, two dependent chains of 8 products instead of one of 16): timing only
  recsmem   the next item's record through workgroup memory instead of registers: same bits
  recend    the next item's record read with its rows (during the softmax), not at the item's
            start: same bits
  qreload   each score tile loads its row block's split queries from workgroup memory instead of
            holding them in registers for the whole of step 1 (64 fewer live registers per
            invocation; the scores overwrite the queries as they are stored): timing only
  nolo      the low halves of the split queries and weights left out of the products (half the
            matrix products and a third of the matrix loads): timing only
  kvhot     every K and V tile read from the cache's first TK rows (cached close to the SMs):
            timing only; with qhot and nowrite, what the item's memory traffic costs
  qhot      every item's queries read from the first rows of q: timing only
  nowrite   the partial rows not written out (their values still computed): timing only
  nosoftmax the softmax left out (the scores' words go into the products as weights): timing
            only, what step 2 costs
  nocheck   the staged K/V units stored without their test for NaN and +-inf: timing only (the
            same bits where the caches are finite)
  noexp     the softmax's exp left out (p = s - m): timing only
  spfast    the softmax's weights without their NaN test where a lane's can hold no NaN (its
            entering scores and the row's maximum finite): a loop of its own, same bits; not
            yet timed
  noqsplit  the queries neither scaled nor split, their maxima not folded (what a split made
            once per layer, before the items, could save at most): timing only; not yet timed
  qk0       the first K tile stored with the split queries, before the same barrier (one barrier
            an item fewer), its scores held in registers until the tile's closing barrier (they
            go over the queries' words, which every subgroup must have loaded first): same bits
            where a subgroup has at most one score tile per K tile (NST = 1, the bench's prefill
            geometry); not yet timed
  mergeseq  the combine reads each element's partial rows in the order they lie in the buffer
            (element i of the list: rows i G .. i G + G - 1), every row once, as a layout of
            the partial rows by (query, KV head) would give: timing only, the bound of such a layout
  mergepf   the combine issues the loads of each chunk of 8 elements while it merges the chunk
            before (16 elements' loads in flight instead of 8), same bits
  nofbar    the K and V tiles' flags read without the barrier after the tile is stored (the
            products racing the stores): timing only, what that barrier costs (timed when the
            flags were read with workgroupUniformLoad, which Tint writes as two barriers around
            the load: three barriers a tile then, one now)
  mergebr   the combine's element loads without branches (the index clamped to the segment's
            last element, the values of one past its end replaced by an empty element's), so
            that all of a chunk's loads can be issued together: same bits
  merge256  the combine in workgroups of 256 invocations instead of 64 (the host's grid for 64:
            three in four workgroups return at once): same bits
  merge16   the combine in chunks of 16 elements instead of 8 (a prefill row's 16 partials in one
            chunk: one round of loads, no rescaling; the plain two-pass formula's bits, which
            differ from the chunked sum's in the last bits): not yet timed
  merge4    the combine reads and writes each invocation's four components as one vec4 (four
            consecutive components instead of four D / 4 apart), same bits
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _wgsl_variants import original

PARTIALS = "psa_partials_sgmat.wgsl"
MERGE = "psa_merge.wgsl"
I = "        "  # indentation of the kernel's item loop body


def _rep(s: str, old: str, new: str) -> str:
    n = s.count(old)
    if n != 1:
        raise SystemExit(f"edit does not apply ({n} matches): {old[:70]!r}")
    return s.replace(old, new)


def _span(s: str, start: str, end: str) -> tuple[int, int]:
    """Where the text from ``start`` (once in s) up to the next ``end`` lies; stops if either is missing."""
    a = s.find(start)
    b = s.find(end, a + len(start)) if a >= 0 and s.count(start) == 1 else -1
    if b < 0:
        raise SystemExit(f"edit does not apply: {start[:50]!r} .. {end[:50]!r}")
    return a, b


def _splice(s: str, start: str, end: str, new: str) -> str:
    """``s`` with the text from ``start`` up to (not including) the next ``end`` replaced by ``new``."""
    a, b = _span(s, start, end)
    return s[:a] + new + s[b:]


def _indent(text: str) -> str:
    """``text`` one level (four spaces) deeper, blank lines as they are."""
    return "".join("    " + x if x.strip() else x for x in text.splitlines(keepends=True))


def kdirect(s: str) -> str:
    lines = s.split("\n")
    a = next(i for i, x in enumerate(lines) if x == I + "var par = 0u;")
    b = next(i for i, x in enumerate(lines) if x.startswith(I + "// the next item's rows and page list"))
    sc = [I + "var par = 0u;", I + "var fma_tiles = 0u;",
          I + "workgroupBarrier();  // every subgroup's queries are in registers",
          I + "let nkb = (max_len + 15u) / 16u;"]
    sc += [I + f"if (LD > {n}u) {{ t{n} = load_unit(tid + {n}u * WG, 0u, 1u); }}" for n in range(8)]  # the first V tile
    sc += [I + "let nkt = (max_len + TK - 1u) / TK;",
           I + "if (item_fma == 0u) {",
           I + "    for (var i = cb; i < nkb; i += CS) {",
           I + "        let base = key_src[16u * i];",
           I + "        var acc = Result();"]
    for j in range(16):
        sc += [I + f"        if (D / 16u > {j}u) {{",
               I + f"            let b = subgroupMatrixLoad<Right, col_major>(&k_cache, base + {2 * j}u, D8);",
               I + f"            acc = subgroupMatrixMultiplyAccumulate(qh{j}, b, acc);",
               I + f"            acc = subgroupMatrixMultiplyAccumulate(ql{j}, b, acc);",
               I + "        }"]
    sc += [I + "        subgroupMatrixStore<row_major>(&wmem, (rb * 16u * SBF + 16u * i) / 4u, acc, SW);",
           I + "    }", I + "}", I + "workgroupBarrier();", ""]
    return "\n".join(lines[:a] + sc + lines[b:])


def chain2(s: str) -> str:
    for j in range(1, 16, 2):
        s = _rep(s, f"{I}                acc = subgroupMatrixMultiplyAccumulate(qh{j}, b, acc);\n"
                    f"{I}                acc = subgroupMatrixMultiplyAccumulate(ql{j}, b, acc);",
                 f"{I}                acc2 = subgroupMatrixMultiplyAccumulate(qh{j}, b, acc2);\n"
                 f"{I}                acc2 = subgroupMatrixMultiplyAccumulate(ql{j}, b, acc2);")
    s = _rep(s, "var acc = subgroup_matrix_result<f32, 16, 16>();  // (zero: explicitly, every tile)",
             "var acc = subgroup_matrix_result<f32, 16, 16>();  // (zero: explicitly, every tile)\n"
             f"{I}            var acc2 = subgroup_matrix_result<f32, 16, 16>();")
    st = "subgroupMatrixStore<row_major>(&wmem, (rb * 16u * SBF + k0 + kt * 16u) / 4u, acc, SW);"
    return _rep(s, st, st + f"\n{I}            " + st.replace(", acc, ", ", acc2, "))


_RECORD = ("max_len", "ne", "g0", "ng", "erec", "pages", "prow0")
# the kernel's reads of the next item's record, as it has them
_RECORD_READS = "".join(f"        let n_{w} = plan[nib{f' + {i}u' if i else ''}];\n" for i, w in enumerate(_RECORD))


def recsmem(s: str) -> str:
    """The next item's record (7 words) through workgroup memory: read at the item's start by 7
    invocations and stored before the queries' first barrier, instead of held in every
    invocation's registers through the scores; read back (uniformly) before the softmax."""
    s = _rep(s, _RECORD_READS, "        var rec_w = 0u;\n        if (tid < 7u) {\n            rec_w = plan[nib + tid];\n        }\n")
    bar = "        workgroupBarrier();  // (the split rows and the item's flag; a plain read, see FLAG READS)\n"
    s = _rep(s, bar, "        if (tid < 7u) {\n            next_rec[tid] = rec_w;\n        }\n" + bar)
    s = _rep(s, "        var n_len = 0u;\n",
             "        let rec = workgroupUniformLoad(&next_rec);  // (a barrier more per item)\n"
             + "".join(f"        let n_{w} = rec[{i}];\n" for i, w in enumerate(_RECORD))
             + "        var n_len = 0u;\n")
    return _rep(s, "var<workgroup> key_src: array<u32, BK>;",
                "var<workgroup> next_rec: array<u32, 8>;\nvar<workgroup> key_src: array<u32, BK>;")


def recend(s: str) -> str:
    """The next item's record read with its rows and page list (during the softmax), not when
    the item starts: those reads then wait for it."""
    s = _rep(s, _RECORD_READS, "")
    return _rep(s, "        var n_len = 0u;\n", _RECORD_READS + "        var n_len = 0u;\n")


def qreload(s: str) -> str:
    lines = s.split("\n")
    a = next(i for i, x in enumerate(lines) if x == I + "var qh0: Left;")
    b = next(i for i, x in enumerate(lines) if x.startswith(I + "// 1. Scores of the block"))
    lines[a - 1:b] = [I + "// (qreload: the split queries are loaded by each score tile)"]
    s = "\n".join(lines)
    for j in range(16):
        old = f"KVW + kt * 16u * HW + {2 * j}u, HW);\n"
        s = _rep(s, old, old + I + "                    " + f"let qh{j} = subgroupMatrixLoad<Left, row_major>(&wmem, rb * 16u * SW + {2 * j}u, SW);\n"
                 + I + "                    " + f"let ql{j} = subgroupMatrixLoad<Left, row_major>(&wmem, rb * 16u * SW + PW + {2 * j}u, SW);\n")
    return s


def nolo(s: str) -> str:
    for j in range(16):
        s = _rep(s, f"acc = subgroupMatrixMultiplyAccumulate(ql{j}, b, acc);\n", "\n")
    for n in range(8):
        s = _rep(s, f"acc{n} = subgroupMatrixMultiplyAccumulate(al, b, acc{n});\n", "\n")
    return _rep(s, "                let al = subgroupMatrixLoad<Left, row_major>(&wmem, pg + 2u, SW);\n", "")


def kvhot(s: str) -> str:
    s = _rep(s, "u = k_cache[row + x - k * D8];", "u = k_cache[x];")
    return _rep(s, "u = v_cache[row + x - k * D8];", "u = v_cache[x];")


def qhot(s: str) -> str:
    return _rep(s, "v = q[row_q[r] + x - r * QV];", "v = q[x];")


def nowrite(s: str) -> str:
    s = _rep(s, "            o_out[(prow0 + r) * QV + c] = o;",
             "            if (bitcast<u32>(o.x) == 0x7f800001u) {  // (never: the value stays computed)\n"
             "                o_out[(prow0 + r) * QV + c] = o;\n            }")
    return _rep(s, "            ml_out[prow0 + r] = bitcast<vec2<f32>>(wmem[row_word(r)].xy);",
                "            if (wmem[row_word(r)].x == 0x7f800001u) {\n"
                "                ml_out[prow0 + r] = bitcast<vec2<f32>>(wmem[row_word(r)].xy);\n            }")


def nosoftmax(s: str) -> str:
    return _splice(s, "        let sr = tid / SL;\n", "        // 3. o += P V, a V tile at a time",
                   "        workgroupBarrier();\n\n")


def nocheck(s: str) -> str:
    return _rep(s, "    let j = x - k * D8;\n    var u = u_in;\n",
                "    let j = x - k * D8;\n    wmem[KVW + k * HW + j] = u_in;\n    return false;\n    var u = u_in;\n")


def noexp(s: str) -> str:
    return _rep(s, "p = exp(sv[j + t][c] - m_new);", "p = sv[j + t][c] - m_new;")


def spfast(s: str) -> str:
    head = "        for (var jw = 0u; jw < NKL / 2u; jw++) {  // a word of weights: 8 positions\n"
    a, b = _span(s, head, "        // the codes' bits at k % 32 for position k = kb0 + bit")
    loop = s[a:b]
    fast = _rep(loop, "let pm = select(p, 0.0, is_nan(p));", "let pm = p;  // (no NaN: the lane's scores and m are finite)")
    cond = ("        let fast = !m_nan && bitcast<u32>(mx) != INF_BITS\n"
            "                   && (bitcast<u32>(m_new) & 0x7f800000u) != 0x7f800000u;\n")
    return s[:a] + cond + "        if (fast) {\n" + _indent(fast) + "        } else {\n" + _indent(loop) + "        }\n" + s[b:]


def noqsplit(s: str) -> str:
    s = _rep(s, "            mb = max(mb, subgroupShuffleXor(mb, o));\n", "")
    return _splice(s, "    var mb = mb_x;", "    if (c == 0u) {\n        wmem[row_word(r)].z = bitcast<u32>(pow2(-e));",
                   "    hi = vec4<f16>(v);\n    lo = hi;\n    let e = 0;\n")


def qk0(s: str) -> str:
    stores = "".join(f"            if (LD > {n}u) {{ tb0 = tb0 | store_unit(tid + {n}u * WG, t{n}, 0u); }}\n" for n in range(8))
    split_bar = "        workgroupBarrier();  // (the split rows and the item's flag; a plain read, see FLAG READS)\n"
    s = _rep(s, split_bar, "        if (max_len > 0u) {  // tile 0's K units, under the split's barrier\n"
             "            var tb0 = false;\n" + stores + "            if (tb0) {\n                set_flag(0u);\n"
             "            }\n        }\n" + split_bar)
    # the K loop's store of its tile (the V loop's stores carry 1u, not 0u)
    head = "            var tb = false;\n            if (LD > 0u) { tb = tb | store_unit(tid + 0u * WG, t0, 0u); }\n"
    b, e = _span(s, head, "            let bad = flags[par];\n")
    s = s[:b] + "            if (it > 0u) {  // (tile 0 was stored with the queries)\n" + _indent(s[b:e]) + "            }\n" + s[e:]
    s = _rep(s, "        var fma_tiles = 0u;\n", "        var fma_tiles = 0u;\n        var dacc = Result();  // tile 0's score tile, stored late\n"
             "        var dhas = false;\n        var dkt = 0u;\n        var fs: array<f32, 8>;  // tile 0's FMA scores, stored late\n")
    s = _rep(s, "                    subgroupMatrixStore<row_major>(&wmem, (rb * 16u * SBF + k0 + kt * 16u) / 4u, acc, SW);\n",
             "                    if (it == 0u) {\n                        dacc = acc;\n                        dhas = true;\n"
             "                        dkt = kt;\n                    } else {\n"
             "                        subgroupMatrixStore<row_major>(&wmem, (rb * 16u * SBF + k0 + kt * 16u) / 4u, acc, SW);\n"
             "                    }\n")
    s = _rep(s, "                    s_set(r, k0 + k, s);\n", "                    if (it == 0u) {\n                        fs[j] = s;\n"
             "                    } else {\n                        s_set(r, k0 + k, s);\n                    }\n")
    end = ("            workgroupBarrier();  // (the tile is overwritten next; the scores are read by the softmax)\n"
           "            par = 1u - par;\n")
    late = ("            if (it == 0u) {  // tile 0's scores, now that every subgroup has loaded its queries\n"
            "                if ((fma_tiles & 1u) != 0u) {\n"
            "                    for (var j = 0u; j < (RMAX * TK + WG - 1u) / WG; j++) {\n"
            "                        let x = tid + j * WG;\n"
            "                        if (x >= RMAX * TK) {\n                            break;\n                        }\n"
            "                        let r = x / TK;\n"
            "                        s_set(r, x - r * TK, fs[j]);\n"
            "                    }\n"
            "                } else if (dhas) {\n"
            "                    subgroupMatrixStore<row_major>(&wmem, (rb * 16u * SBF + dkt * 16u) / 4u, dacc, SW);\n"
            "                }\n"
            "                if (nkt == 1u) {\n                    workgroupBarrier();  // (the softmax reads them next)\n                }\n"
            "            }\n")
    return _rep(s, end, end + late)


def mergeseq(s: str) -> str:
    return _rep(s, "        let e = plan[eo + i] * gs + sub;", "        let e = (i + eo * 0u) * gs + sub;")


def merge4(s: str) -> str:
    s = _rep(s, "var<storage, read> src_o: array<f32>;", "var<storage, read> src_o: array<vec4<f32>>;")
    s = _rep(s, "var<storage, read_write> dst_o: array<f32>;", "var<storage, read_write> dst_o: array<vec4<f32>>;")
    s = _splice(s, "        let b = e * D + d0;\n        o.x = src_o[b];", "        return Elem(src_ml[e], o);",
                "        o = src_o[(e * D) / 4u + d0];\n")
    return _splice(s, "    let b = dest * D + d0;\n    dst_o[b] = o.x;", "    if (d0 == 0u) {\n        dst_ml",
                   "    dst_o[(dest * D) / 4u + d0] = o;\n")


def mergepf(s: str) -> str:
    loads = "".join(f"        let e{n} = elem(eo, c{f' + {n}u' if n else ''}, end, gs, sub, d0);\n" for n in range(8))
    head = "        let c = start + c_i * 8u;\n"
    first = "".join(f"    var a{n} = elem(eo, start + {n}u, end, gs, sub, d0);\n" for n in range(8))
    swap = ("        let c = start + (c_i + 1u) * 8u;  // the next chunk's loads fly while this one merges\n"
            + "".join(f"        let e{n} = a{n};\n" for n in range(8))
            + "".join(f"        a{n} = elem(eo, c + {n}u, end, gs, sub, d0);\n" for n in range(8)))
    s = _rep(s, head + loads, swap)
    return _rep(s, "    for (var c_i = 0u; c_i < c_n; c_i++) {\n", first + "    for (var c_i = 0u; c_i < c_n; c_i++) {\n")


def nofbar(s: str) -> str:
    old = "            workgroupBarrier();  // (the tile is stored; its flag read as in FLAG READS)\n"
    if s.count(old) != 2:
        raise SystemExit(f"edit does not apply ({s.count(old)} matches): {old!r}")
    return s.replace(old, "")


def mergebr(s: str) -> str:
    s = _rep(s, "    if (i < end) {\n        let e = plan[eo + i] * gs + sub;",
             "    {  // (end > 0 where it is called)\n        let e = plan[eo + min(i, end - 1u)] * gs + sub;")
    return _rep(s, "        return Elem(src_ml[e], o);",
                "        let ok = i < end;\n"
                "        return Elem(select(vec2<f32>(0.0), src_ml[e], ok), select(vec4<f32>(0.0), o, ok));")


def merge256(s: str) -> str:
    s = _rep(s, "@compute @workgroup_size(WG)", "@compute @workgroup_size(256)")
    return _rep(s, "    let x = (wid.y * params.grid_x + wid.x) * WG + lid;", "    let x = (wid.y * params.grid_x + wid.x) * 256u + lid;")


def merge16(s: str) -> str:
    s = _rep(s, "let c_n = select(0u, (end - start + 7u) / 8u, end > start);",
             "let c_n = select(0u, (end - start + 15u) / 16u, end > start);")
    s = _rep(s, "        let c = start + c_i * 8u;\n", "        let c = start + c_i * 16u;\n")
    s = _rep(s, "        let e7 = elem(eo, c + 7u, end, gs, sub, d0);\n",
             "".join(f"        let e{n} = elem(eo, c + {n}u, end, gs, sub, d0);\n" for n in range(7, 16)))
    s = _rep(s, "        take_max(e7.ml, &cm, &cs);\n",
             "".join(f"        take_max(e{n}.ml, &cm, &cs);\n" for n in range(7, 16)))
    return _rep(s, "            add_term(e7.ml, e7.o, m_new, &l, &o);\n",
                "".join(f"            add_term(e{n}.ml, e{n}.o, m_new, &l, &o);\n" for n in range(7, 16)))


VERSIONS = {  # name: (kernel file, edit, label)
    "kdirect": (PARTIALS, kdirect, "K from the cache"),
    "chain2": (PARTIALS, chain2, "two chains (timing)"),
    "recsmem": (PARTIALS, recsmem, "next record in workgroup memory"),
    "recend": (PARTIALS, recend, "next record read at the softmax"),
    "qreload": (PARTIALS, qreload, "queries reloaded per tile (timing)"),
    "nolo": (PARTIALS, nolo, "no low halves (timing)"),
    "kvhot": (PARTIALS, kvhot, "K/V from hot rows (timing)"),
    "qhot": (PARTIALS, qhot, "q from hot rows (timing)"),
    "nowrite": (PARTIALS, nowrite, "rows not written (timing)"),
    "nosoftmax": (PARTIALS, nosoftmax, "no softmax (timing)"),
    "nocheck": (PARTIALS, nocheck, "K/V unchecked (timing)"),
    "noexp": (PARTIALS, noexp, "no exp (timing)"),
    "spfast": (PARTIALS, spfast, "softmax fast loop"),
    "noqsplit": (PARTIALS, noqsplit, "queries not split (timing)"),
    "qk0": (PARTIALS, qk0, "tile 0 stored with the queries"),
    "mergeseq": (MERGE, mergeseq, "combine in buffer order (timing)"),
    "merge4": (MERGE, merge4, "combine vec4"),
    "mergepf": (MERGE, mergepf, "combine chunks prefetched"),
    "mergebr": (MERGE, mergebr, "combine loads without branches"),
    "merge256": (MERGE, merge256, "combine in workgroups of 256"),
    "merge16": (MERGE, merge16, "combine in chunks of 16"),
    "nofbar": (PARTIALS, nofbar, "no barrier after a tile's stores (timing)"),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="+", choices=list(VERSIONS), default=list(VERSIONS))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--calls", type=int, default=4)
    ap.add_argument("--write", metavar="DIR", help="only write the versions' kernels under DIR/NAME/")
    a = ap.parse_args()
    root = Path(a.write) if a.write else Path(tempfile.mkdtemp(prefix="psa-variants-"))
    by_kernel: dict[str, list[str]] = {}
    for name in a.only:
        kernel, edit, label = VERSIONS[name]
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / kernel).write_text(edit(original(kernel)))
        by_kernel.setdefault(kernel, []).append(f"{label}={folder}")
    if a.write:
        return 0
    ab = Path(__file__).resolve().parent / "experiment_partials_ab.py"
    rc = 0
    for kernel, specs in by_kernel.items():
        print(f"## {kernel}", flush=True)
        cmd = [sys.executable, str(ab), "--kernel", kernel, "--rounds", str(a.rounds), "--calls", str(a.calls)]
        for spec in specs:
            cmd += ["--variant", spec]
        rc |= subprocess.run(cmd, check=False).returncode
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
