"""Experiment: the tensor-core prefill partials with their K/V tile staged as 16-byte words.

``psa_partials_sgmat.wgsl`` stages each K or V tile in its float16 workgroup array, each 16-byte
unit written as eight 2-byte stores (the array the matrix loads read holds float16). The GEMM
ceiling gained 5-11 % from staged tiles declared as ``array<vec4<u32>>``, one store per unit,
the float16 matrices loaded from the same words (``psa_gemm_sgmat_tiled.wgsl``). This writes
that variant of the partials kernel (the K/V tile in an array of words of its own, its matrix
loads' offsets and strides in words, the FMA path's scalar reads unpacked from the words; the
query and weight tiles unchanged) into a folder and times it against the kernel as it is with
``experiment_partials_ab.py`` (same bits expected). The kernel is taken at a revision from
before its items of 64 rows (``--rev``, default c74a2ef; since then every tile it stages is
words), and both versions run with that kernel's 32 rows per item.

    python scripts/experiment_partials_kv_words.py [--rev c74a2ef] [--out DIR] [--rounds 2]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KERNEL = "psa_partials_sgmat.wgsl"


def kv_words_source(src: str) -> str:
    """``src`` with its K/V tile moved to ``kvmem: array<vec4<u32>, 544>`` (the prefill geometry's
    32 keys x 136 halves; the float16 array keeps the query and weight tiles)."""
    def rep(s: str, old: str, new: str) -> str:
        if s.count(old) != 1:
            raise SystemExit(f"the kernel no longer has exactly one {old!r}")
        return s.replace(old, new)

    src = rep(src, "const HCAP: u32 = 13056u;", "const HCAP: u32 = 8704u;")
    src = rep(src, "var<workgroup> hmem: array<f16, HCAP>;",
              "var<workgroup> hmem: array<f16, HCAP>;\nconst KVCAP: u32 = 544u;\n"
              "var<workgroup> kvmem: array<vec4<u32>, KVCAP>;  // the K or V tile, 8 halves a word\n"
              "fn kvh(i: u32) -> f16 {\n    return bitcast<vec2<f16>>(kvmem[i / 8u][(i % 8u) / 2u])[i % 2u];\n}")
    a = src.index("    let b = KVO + k * HS + 8u * j;")
    end = "    hmem[b + 7u] = h3.y;\n"
    b = src.index(end) + len(end)
    src = src[:a] + "    kvmem[(k * HS + 8u * j) / 8u] = u;\n" + src[b:]
    src = rep(src, "(&hmem, KVO + kt * 16u * HS + d0, HS)", "(&kvmem, (kt * 16u * HS + d0) / 8u, HS / 8u)")
    for s in ("", " + 1u", " + 2u", " + 3u"):
        src = rep(src, f"f32(hmem[KVO + kb{s}])", f"f32(kvh(kb{s}))")
    src, n = re.subn(r"\(&hmem, KVO \+ kk \* HS \+ \(cb \+ CS \* (\d)u\) \* 16u, HS\)",
                     r"(&kvmem, (kk * HS + (cb + CS * \1u) * 16u) / 8u, HS / 8u)", src)
    if n != 8 or "KVO +" in src:
        raise SystemExit("the kernel's V-tile loads are not the eight this script rewrites")
    return src


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="folder for the variant (default: a temporary one)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--rev", default="c74a2ef", help="the revision whose kernel to vary")
    a = ap.parse_args()
    out = Path(a.out or tempfile.mkdtemp(prefix="kv-words-"))
    out.mkdir(parents=True, exist_ok=True)
    base = subprocess.run(["git", "show", f"{a.rev}:shaders/{KERNEL}"], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout
    (out / KERNEL).write_text(kv_words_source(base))
    return subprocess.call([sys.executable, str(ROOT / "scripts" / "experiment_partials_ab.py"),
                            "--rev", a.rev, "--rows", f"at {a.rev}=32", "--variant", f"kv-words={out}",
                            "--rows", "kv-words=32", "--rounds", str(a.rounds)])


if __name__ == "__main__":
    raise SystemExit(main())
