"""Experiment: how the GEMM ceiling's staged tiles are written: one store per 16-byte unit (as
the kernel is now), eight float16 stores per unit (as it was), or subgroup-matrix copies.

``psa_gemm_sgmat_tiled.wgsl`` copies each K step's A and B tiles into workgroup memory as 16-byte
units read from storage into registers. Three ways of writing them, the same products in the same
order (so the same bits), each checked against its float32 bound and timed at 4096^3:

* ``16-byte words`` (the kernel as it is): the staged tiles are ``array<vec4<u32>>``, one store per
  unit, the float16 matrices loaded from those words (offsets and strides in words);
* ``at REV``: the kernel at a revision whose staged tiles are ``array<f16>`` (the matrix loads'
  element type), each unit written as eight 2-byte stores (``--rev``, default e2bc358);
* ``matrices``: that revision's kernel with each subgroup loading its share of the step's 16 x 16
  tiles from storage as subgroup matrices (an ``array<f16>`` view of A and B) and storing them
  into the staged tiles with ``subgroupMatrixStore``.

    python scripts/experiment_gemm_matrix_staging.py [--backend dawn] [--rounds 2] [--rev REV] [--no-torch]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _wgsl_variants import use
from experiment_gemm_peak import SIZE, add_arguments, torch_rate

from paged_sparse_attn import registry
from paged_sparse_attn.backends.wgpu._ceilings import (
    GEMM_TILED_KERNEL,
    _variant,
    matmul_variants,
)

SHAPES = (
    ("128 x 256, 8 subgroups of 64 x 64, BK 32, 1 stage", {"SGM": 2, "SGN": 4, "TM": 4, "TN": 4, "BK": 32, "STAGES": 1}),
    ("128 x 256, 8 subgroups of 64 x 64, BK 16, 2 stages", {"SGM": 2, "SGN": 4, "TM": 4, "TN": 4, "BK": 16, "STAGES": 2}),
    ("128 x 128, 4 subgroups of 64 x 64, BK 32, 2 stages", {"SGM": 2, "SGN": 2, "TM": 4, "TN": 4, "BK": 32, "STAGES": 2}),
    ("128 x 128, 8 subgroups of 64 x 32, BK 32, 2 stages", {"SGM": 2, "SGN": 4, "TM": 4, "TN": 2, "BK": 32, "STAGES": 2}),
)

# staging slots per subgroup: pa0 .. pa{MAX_SLOTS-1} (A), pb0 .. (B); named variables, used under ifs
MAX_SLOTS = 8


def _slots(kind: str, n: int, body) -> str:
    return "\n".join(f"        if ({kind}_PER > {s}u) {{ {body(s)} }}" for s in range(n))


def matrix_staged_source(src: str) -> str:
    """The tiled kernel ``src`` (staged tiles of ``array<f16>``) with its staging done by
    subgroup-matrix loads and stores."""
    head, _, _ = src.partition("@compute @workgroup_size(WG)")
    head = head.replace("@group(0) @binding(1) var<storage, read> a: array<vec4<u32>>;",
                        "@group(0) @binding(1) var<storage, read> a: array<f16>;")
    head = head.replace("@group(0) @binding(2) var<storage, read> b: array<vec4<u32>>;",
                        "@group(0) @binding(2) var<storage, read> b: array<f16>;")
    head = head.split("// The 8 halves of a unit")[0]
    decl_a = "\n".join(f"    var pa{s}: Left;" for s in range(MAX_SLOTS))
    decl_b = "\n".join(f"    var pb{s}: Right;" for s in range(MAX_SLOTS))

    def loads(kk: str) -> str:
        la = _slots("A", MAX_SLOTS, lambda s: f"pa{s} = subgroupMatrixLoad<Left, row_major>(&a, a_src(sg + {s}u * NSG, row0, {kk}, k_len), k_len);")
        lb = _slots("B", MAX_SLOTS, lambda s: f"pb{s} = subgroupMatrixLoad<Right, row_major>(&b, b_src(sg + {s}u * NSG, col0, {kk}, n), n);")
        return la + "\n" + lb

    def stores(stage: str) -> str:
        sa_ = _slots("A", MAX_SLOTS, lambda s: f"subgroupMatrixStore<row_major>(&sa, {stage} * A_STAGE + a_dst(sg + {s}u * NSG), pa{s}, SA);")
        sb_ = _slots("B", MAX_SLOTS, lambda s: f"subgroupMatrixStore<row_major>(&sb, {stage} * B_STAGE + b_dst(sg + {s}u * NSG), pb{s}, SB);")
        return sa_ + "\n" + sb_

    body = src.partition("@compute @workgroup_size(WG)")[2]
    products = body[body.index("        let sa0 = (t % STAGES)"):body.index("        if (more) {\n            if (STAGES == 1u)")]
    tail = body[body.index("    let c0 = (row0 + srow) * n + col0 + scol;"):]
    # the kernel's signature, sizes, block offsets and result / right-hand matrices, as they are
    prologue = body[:body.index("    var ra: array<vec4<u32>, MAX_UNITS>;")]
    return f"""{head}
override NSG: u32 = SGM * SGN;
override A_TK: u32 = BK / 16u;                 // 16-column tiles along K of a staged tile
override B_TN: u32 = BN / 16u;                 // 16-column tiles of a staged B tile
override A_PER: u32 = (BM / 16u) * A_TK / NSG;  // A matrices each subgroup stages per step
override B_PER: u32 = A_TK * B_TN / NSG;

// A matrix i of the step at column kk: storage offset and staged offset (row-major 16 x 16 tiles)
fn a_src(i: u32, row0: u32, kk: u32, k_len: u32) -> u32 {{
    return (row0 + 16u * (i / A_TK)) * k_len + kk + 16u * (i % A_TK);
}}
fn a_dst(i: u32) -> u32 {{
    return 16u * (i / A_TK) * SA + 16u * (i % A_TK);
}}
fn b_src(j: u32, col0: u32, kk: u32, n: u32) -> u32 {{
    return (kk + 16u * (j / B_TN)) * n + col0 + 16u * (j % B_TN);
}}
fn b_dst(j: u32) -> u32 {{
    return 16u * (j / B_TN) * SB + 16u * (j % B_TN);
}}

@compute @workgroup_size(WG){prologue}{decl_a}
{decl_b}

{loads("0u")}
{stores("0u")}
    workgroupBarrier();

    for (var t = 0u; t < steps; t++) {{
        let more = t + 1u < steps;
        if (more) {{
            let kn = (t + 1u) * BK;
{loads("kn")}
        }}
{products}
        if (more) {{
            if (STAGES == 1u) {{
                workgroupBarrier();
            }}
            let s = (t + 1u) % STAGES;
{stores("s")}
        }}
        workgroupBarrier();
    }}

{tail}"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(ap)
    ap.add_argument("--rev", default="e2bc358", help="a revision whose staged tiles are array<f16>")
    ap.add_argument("--print-source", action="store_true")
    a = ap.parse_args()
    root = Path(__file__).resolve().parents[1]
    at_rev = subprocess.run(["git", "show", f"{a.rev}:shaders/{GEMM_TILED_KERNEL}"], cwd=root, check=True,
                            capture_output=True, text=True).stdout
    staged = matrix_staged_source(at_rev)
    if a.print_source:
        print(staged)
        return 0
    fails = 0
    for r in range(a.rounds):
        for label, src in (("16-byte words (as it is)", None), (f"at {a.rev}", at_rev), ("matrices", staged)):
            use({} if src is None else {GEMM_TILED_KERNEL: src})
            be = type(registry.get_backend(a.backend))()  # a fresh device: no pipeline of the other source
            try:
                variants = tuple(_variant(GEMM_TILED_KERNEL, **c) for _, c in SHAPES)
                for (shape, _), row in zip(SHAPES, matmul_variants(be.device_context, SIZE, repeat=a.repeat,
                                                                     variants=variants)):
                    if row["skipped"]:
                        print(f"round {r}: {label:26s} {shape:52s} skipped: {row['skipped']}")
                        continue
                    ok = row["ok"]
                    fails += not ok
                    print(f"round {r}: {label:26s} {shape:52s} {row['flop_per_s'] / 1e12:7.1f} TFLOP/s"
                          f"{'' if ok else '  FAIL max err {:.3g} > {:.3g}'.format(row['max_abs_err'], row['err_bound'])}",
                          flush=True)
            finally:
                be.close()
        use({})
    if not a.no_torch:
        t = torch_rate()
        print("torch bf16 matmul: torch with CUDA not available" if t is None else
              f"torch bf16 matmul {SIZE}^3: {t:.1f} TFLOP/s; 50 % of it: {t / 2:.1f} TFLOP/s")
    return fails


if __name__ == "__main__":
    raise SystemExit(main())
