"""Decode kernel variants on the MSA decode layer (GPU timestamps): what each part costs.

Usage: ``python scripts/experiment_decode.py [--backends wgpu dawn] [--repeat 8] [--quick]``. For the
decode layer workload of the bench (B=32, L=32k, Hq=32, Hkv=4, D=128, top-16, f16, index dim
128) it prints, per backend:

* the block-score pass of ``AttentionPlan.run_sparse`` with ``psa_block_scores_decode_sg.wgsl``
  (key groups, the default; with ``--sweep`` several workgroup sizes, with and without the
  next chunk's loads in flight) and with ``psa_block_scores_decode.wgsl`` (one key row per invocation), median GPU
  time, and the index keys' read bandwidth;
* (Dawn also with ``robustness=False``: the device without Dawn's bounds checks)
* the partials + combine of one decode call (``profile_forward``'s ``call_s``, steady state) as
  it is, with its exact pass never taken (what the R26 handling costs on data without special
  values) and with both passes on every edge (what the exact pass costs).

``--kernels decode sgmat generic`` instead times the partials + combine of one decode call with each
``partials_kernel`` choice (and its largest difference to the numpy backend's output);
``--loads-only`` times the decode partials and the decode block scores as they are and with their
arithmetic left out (loads kept), to tell what bounds them, the partials with float16 widened by
``bitcast`` instead of ``unpack2x16float``, and the block scores with the per-position reduction
(the joint one turned off).

Each variant runs on a fresh device, so no pipeline is shared between variants.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import paged_sparse_attn as psa
from paged_sparse_attn import registry
from paged_sparse_attn._validation import validate_forward
from paged_sparse_attn.backends.wgpu import _index_branch as ib
from paged_sparse_attn.backends.wgpu import _kernels
from paged_sparse_attn.bench.layer import LAYER_WORKLOADS, QUICK_LAYER_WORKLOADS
from paged_sparse_attn.bench.layer import _plan as layer_plan
from paged_sparse_attn.bench.workloads import make_problem

DECODE = "psa_partials_decode.wgsl"
# (text, replacement) edits of psa_partials_decode.wgsl; every text must occur in the file
R26_VARIANTS = {
    "as is": [],
    "fast pass only (no exact redo)": [("if (workgroupUniformLoad(&redo_u) != 0u) {", "if (false) {")],
    "fast and exact pass every edge": [("if (workgroupUniformLoad(&redo_u) != 0u) {", "if (true) {")],
}


# "loads only": the kernels' loads kept (their values feed the result) and their arithmetic left
# out, to tell loads from math. (start, end, replacement) edits replace the text from start up to end.
# float16 units widened by bitcast to vec2<f16> and a conversion (needs the shader-f16 feature)
# instead of unpack2x16float: whether the two compilers treat the two forms alike
F16_BITCAST = [("// psa_partials_decode.wgsl", "enable f16;\n// psa_partials_decode.wgsl")] + [
    (f"unpack2x16float(u.{c})", f"vec2<f32>(bitcast<vec2<f16>>(u.{c}))") for c in "xyzw"]
SCORES_SG = "psa_block_scores_decode_sg.wgsl"
LOADS_ONLY = {
    DECODE: [("        // scores of head slot hs for the 4 keys", "    return Edge(m, l, a0",
              "        a0 += bitcast<vec4<f32>>((c.k0 ^ c.k1 ^ c.k2 ^ c.k3 ^ c.v0 ^ c.v1 ^ c.v2 ^ c.v3)"
              " & vec4<u32>(0x3fffffffu));\n        l = 1.0;\n    }\n")],
    SCORES_SG: [(f"let z{i} = logit(qs, lo4(c.u{i}), hi4(c.u{i}), r);",
                 f"let z{i} = bitcast<f32>((c.u{i}.x ^ c.u{i}.y ^ c.u{i}.z ^ c.u{i}.w) & 0x3fffffffu);")
                for i in range(4)],
}


# The decode partials' per-key divisions by override constants replaced by shifts and masks for
# the decode workload (S = 64, RH = 1, EU = 8): whether the runtime's compiler keeps them as
# divisions (timing only; right only for those constants)
DIVISION_FREE = [("plan[pages + pos / S]", "plan[pages + (pos >> 6u)]"),
                 ("    let page = slab / RH;\n    return page * RH * (params.slab_stride * 4u / EU) + ((pos % S) * RH",
                  "    let page = slab;\n    return page * RH * (params.slab_stride >> 1u) + ((pos & 63u) * RH"),
                 ("min(pos / S, R - 1u)", "min(pos >> 6u, R - 1u)")]


def _with_edits(edits, kernel=DECODE):
    orig = _kernels.shader_source

    def src(name, f16=False):
        text = orig(name, f16=f16)
        if name == kernel:
            for edit in edits:
                if len(edit) == 3:
                    start, end, new = edit
                    i, j = text.find(start), text.find(end)
                    if i < 0 or j < i:
                        raise SystemExit(f"variant edit not found in {kernel}: {start!r} .. {end!r}")
                    text = text[:i] + new + text[j:]
                    continue
                old, new = edit
                if old not in text:
                    raise SystemExit(f"variant edit not found in {kernel}: {old!r}")
                text = text.replace(old, new)
        return text

    return orig, src


def _scores_time(be, p, w, lw, ik, iq, repeat):
    """Median GPU seconds of the block-score pass of a planned decode MSA layer on ``be``."""
    k, v = be.upload_kv_cache(p["k_cache"], p["v_cache"])
    ikd = be.upload_index_cache(ik)
    plan = layer_plan(be, lw, p)
    ts = []
    for _ in range(repeat + 2):
        plan.run_sparse(p["q"], k, v, iq, ikd)
        ts.append(be.last_timings.get("gpu_scores_s", np.nan))
    plan.close()
    return float(np.median(ts[2:]))


def _time_call(be, p, w, repeat, label):
    """Print the steady-state GPU time of one decode call's partials + combine on ``be``, and how
    far its output is from the numpy reference."""
    k, v = be.upload_kv_cache(p["k_cache"], p["v_cache"])
    prob = validate_forward("experiment", p["q"], k, v, p["block_tables"], p["selected"], p["cu_seqlens_q"],
                            used_kv_lens=p["used_kv_lens"], block_size=w.block_size, softmax_scale=None,
                            causal=w.causal)
    ix = psa.build_kvouter_index(p["selected"], p["block_tables"], p["cu_seqlens_q"], p["used_kv_lens"],
                                 block_size=w.block_size, page_size=w.page_size, causal=w.causal)
    prof = be.profile_forward(prob, ix, repeat=repeat, replay="auto", warmup_s=0.5)
    out = np.asarray(psa.forward(p["q"], k, v, p["block_tables"], p["selected"], p["cu_seqlens_q"],
                                 used_kv_lens=p["used_kv_lens"], block_size=w.block_size, causal=w.causal, backend=be))
    ref = np.asarray(psa.forward(p["q"], p["k_cache"], p["v_cache"], p["block_tables"], p["selected"], p["cu_seqlens_q"],
                                 used_kv_lens=p["used_kv_lens"], block_size=w.block_size, causal=w.causal,
                                 backend="numpy"))
    print(f"  decode partials+combine, {label:28s}: {prof['call_s'] * 1e6:8.1f} us "
          f"(partials {prof['partials_s'] * 1e6:.1f}, combine {prof['combine_s'] * 1e6:.1f}) "
          f"(kernel {prof.get('kernel')}; max abs diff to numpy {float(np.max(np.abs(out - ref))):.2e})", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", nargs="*", default=None)
    ap.add_argument("--repeat", type=int, default=8)
    ap.add_argument("--sweep", action="store_true", help="block scores: every workgroup size and load schedule")
    ap.add_argument("--quick", action="store_true", help="the bench's small decode workload (a smoke run)")
    ap.add_argument("--loads-only", action="store_true",
                    help="only time the decode partials and block scores as they are and with their math left out")
    ap.add_argument("--kernels", nargs="*", default=None,
                    help="only time the partials + combine of one decode call with these partials_kernel choices")
    a = ap.parse_args()
    lw = (QUICK_LAYER_WORKLOADS if a.quick else LAYER_WORKLOADS)[0]
    w = lw.w
    p = make_problem(w, seed=1, fill="selected")
    rng = np.random.default_rng(3)
    ik = rng.standard_normal((p["k_cache"].shape[0], 1, w.page_size, lw.index_dim), dtype=np.float32).astype(w.dtype)
    iq = rng.standard_normal((p["q"].shape[0], w.Hkv, lw.index_dim), dtype=np.float32)
    key_bytes = int(np.minimum(p["used_kv_lens"], w.L).sum()) * lw.index_dim * np.dtype(w.dtype).itemsize
    names = a.backends or [n for n, av in registry.list_backends().items() if av.ok and n != "numpy"]
    t_all = time.perf_counter()
    default_wg_pf = (ib.SCORES_DECODE_SG_WG, ib.SCORES_DECODE_SG_PF)
    runs = [(n, {}) for n in names] + [(n, {"robustness": False}) for n in names if n == "dawn"]
    if a.loads_only:
        for name, opts in runs:
            cls = type(registry.get_backend(name))
            for vname, edits in (("as is", []), ("loads only", LOADS_ONLY[DECODE]),
                                 ("divisions as shifts (S = 64)", DIVISION_FREE),
                                 ("float16 by bitcast, not unpack2x16float", F16_BITCAST)):
                orig, src = _with_edits(edits)
                _kernels.shader_source = src
                try:
                    be = cls(timestamps=True, **opts)
                    _time_call(be, p, w, a.repeat, f"{name} {opts} partials {vname}")
                    be.close()
                finally:
                    _kernels.shader_source = orig
            for vname, edits, jr in (("as is", [], True), ("per-position reduction (JR off)", [], False),
                                     ("loads only", LOADS_ONLY[SCORES_SG], False)):
                orig, src = _with_edits(edits, SCORES_SG)
                _kernels.shader_source = src
                ib.SCORES_DECODE_SG_JR = jr
                try:
                    be = cls(timestamps=True, **opts)
                    sc = _scores_time(be, p, w, lw, ik, iq, a.repeat)
                    print(f"  {name} {opts} block scores {vname}: {sc * 1e6:8.1f} us "
                          f"({key_bytes / sc / 1e12:.2f} TB/s of index keys)", flush=True)
                    be.close()
                finally:
                    _kernels.shader_source = orig
                    ib.SCORES_DECODE_SG_JR = True
        print(f"done in {time.perf_counter() - t_all:.1f} s")
        return
    if a.kernels:
        for name, opts in runs:
            cls = type(registry.get_backend(name))
            for kern in a.kernels:
                try:
                    be = cls(timestamps=True, partials_kernel=kern, **opts)
                    _time_call(be, p, w, a.repeat, f"{name} {opts} partials_kernel={kern!r}")
                    be.close()
                except psa.UnsupportedError as e:
                    print(f"  {name} {opts} partials_kernel={kern!r}: unsupported: {e}", flush=True)
        print(f"done in {time.perf_counter() - t_all:.1f} s")
        return
    for name, opts in runs:
        cls = type(registry.get_backend(name))
        ref_out = None
        print(f"== {name} {opts}: {registry.get_backend(name)}", flush=True)
        # (key groups?, workgroup size, next chunk in flight)
        sweep = ((True, 128, 0), (True, 128, 1), (True, 64, 0), (True, 64, 1), (True, 256, 0), (True, 32, 1),
                 (False, 0, 0))
        for sg, wg, pf in (sweep if a.sweep else ((True, *default_wg_pf), (False, 0, 0))):
            ib.SCORES_DECODE_SG_WG, ib.SCORES_DECODE_SG_PF = (wg, pf) if sg else default_wg_pf
            be = cls(timestamps=True, **opts)
            be._decode_scores_sg = sg
            k, v = be.upload_kv_cache(p["k_cache"], p["v_cache"])
            ikd = be.upload_index_cache(ik)
            plan = layer_plan(be, lw, p)
            ts, sel = [], None
            for i in range(a.repeat + 2):
                out = plan.run_sparse(p["q"], k, v, iq, ikd)
                ts.append(dict(be.last_timings))
            kern = sorted({x[0] for x in be._device().pipelines if "block_scores" in str(x[0])})
            sc = float(np.median([t.get("gpu_scores_s", np.nan) for t in ts[2:]]))
            tot = float(np.median([t.get("gpu_total_s", np.nan) for t in ts[2:]]))
            print(f"  block scores {kern} WG {wg} PF {pf}: {sc * 1e6:8.1f} us ({key_bytes / sc / 1e12:.2f} TB/s of index keys); "
                  f"whole layer GPU {tot * 1e6:8.1f} us", flush=True)
            sel = np.asarray(out[0] if isinstance(out, tuple) else out)
            if ref_out is None:
                ref_out = sel
            else:
                print(f"    same output as the first: {np.array_equal(ref_out, sel)}", flush=True)
            plan.close()
            be.close()
        ib.SCORES_DECODE_SG_WG, ib.SCORES_DECODE_SG_PF = default_wg_pf
        for vname, edits in R26_VARIANTS.items():
            orig, src = _with_edits(edits)
            _kernels.shader_source = src
            try:
                be = cls(timestamps=True, **opts)
                _time_call(be, p, w, a.repeat, vname)
                be.close()
            finally:
                _kernels.shader_source = orig
    print(f"done in {time.perf_counter() - t_all:.1f} s")


if __name__ == "__main__":
    main()
