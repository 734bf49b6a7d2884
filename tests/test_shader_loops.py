"""Every loop of every WGSL kernel has the form Tint proves finite, or says why not.

With its bounds checks on (the default of the ``dawn`` backend), Tint gives every loop it cannot
prove finite an iteration guard: a 64-bit counter in function memory, decremented and tested on
every iteration, which also keeps the driver from unrolling the loop. Its loop analysis proves a
loop finite only when the loop's index variable goes up by exactly one in the continuing block
and the loop's first statement exits once the index reaches a bound fixed before the body: a
constant or override expression, a ``let`` declared before the loop or a parameter. So the
kernels' loops are written ``for (var i = a; i < n; i++)``; a loop over a stride counts its
iterations into a ``let`` first. A loop left to the guard on purpose says so on its line with a
``// rolled:`` comment and the reason (a rare path whose unrolled code would cost registers, or
a kernel measured faster that way); a file whose loops all stay so says it once, in a line
``// rolled (every loop): <why>``. Measured on the H200 (Dawn, bounds checks on, the same bits):
the prefill tensor-core partials 12.9 -> 10.0 ms, the decode partials 119.6 -> 103.0 µs per
call (see the benchmarks page).
"""

import re
from pathlib import Path

import pytest

SHADERS = Path(__file__).resolve().parents[1] / "shaders"
FOR = re.compile(r"\bfor\s*\((.*?)\)\s*\{")


def loop_problems(src: str) -> list[str]:
    """The loops of ``src`` not of the finite form, each as its line and why."""
    lets = set(re.findall(r"\b(?:let|const|override)\s+([A-Za-z_]\w*)", src))
    variables = set(re.findall(r"\bvar(?:<[^>]*>)?\s+([A-Za-z_]\w*)", src))
    params = {name for sig in re.findall(r"\bfn\s+\w+\s*\(([^)]*)\)", src)
              for name in re.findall(r"(\w+)\s*:", sig)}
    if re.search(r"^// rolled \(every loop\): \S", src, re.MULTILINE):
        return []  # the file says why its loops are left to Tint's guards
    bad = []
    for n, line in enumerate(src.splitlines(), 1):
        code, _, comment = line.partition("//")
        if comment.strip().startswith("rolled:"):
            continue  # left to Tint's guard on purpose; the comment says why
        if re.search(r"\bwhile\b|\bloop\s*\{", code):
            bad.append(f"{n}: a while or loop statement: {line.strip()}")
            continue
        m = FOR.search(code)
        if not m:
            continue
        parts = [p.strip() for p in m.group(1).split(";")]
        head = re.fullmatch(r"var (\w+) = .+", parts[0]) if len(parts) == 3 else None
        if not head or parts[2] != f"{head.group(1)}++":
            bad.append(f"{n}: not `for (var i = a; ...; i++)`: {line.strip()}")
            continue
        cond = re.fullmatch(rf"{head.group(1)} < (.+)", parts[1])
        if not cond:
            bad.append(f"{n}: the condition is not `i < bound`: {line.strip()}")
            continue
        b = cond.group(1)
        names = re.findall(r"[A-Za-z_]\w*", re.sub(r"\b\d+u\b", "", b))
        constant = re.fullmatch(r"[\w\s+\-*/()]+", b) and all(x[0].isupper() for x in names)
        fixed = constant or (re.fullmatch(r"\w+", b) and (b in params or (b in lets and b not in variables)))
        if not fixed:
            bad.append(f"{n}: the bound {b} is not a literal, override, const, let or parameter: {line.strip()}")
    return bad


@pytest.mark.parametrize("path", sorted(SHADERS.glob("*.wgsl")), ids=lambda p: p.name)
def test_every_loop_counts_by_one_to_a_fixed_bound(path):
    bad = loop_problems(path.read_text())
    assert not bad, f"{path.name}: loops Tint cannot prove finite:\n" + "\n".join(bad)


@pytest.mark.parametrize("loop", [
    "for (var x = lid; x < n; x += WG) {",           # a stride
    "for (var m = 1u; m < WG; m = m * 2u) {",        # doubling
    "for (var i = 0u; i < params.k; i++) {",         # a bound loaded in the body
    "for (var i = 0u; i < min(a, b); i++) {",        # a bound computed in the body
    "var n = 4u;\nfor (var i = 0u; i < n; i++) {",   # a bound that may change
    "loop {",
])
def test_the_check_finds_the_forms_tint_guards(loop):
    assert loop_problems(f"fn f(lid: u32) {{\n{loop}\n}}\n}}")


def test_the_check_accepts_the_finite_forms_and_rolled_loops():
    src = ("override WG: u32 = 64u;\nfn f(lid: u32, n_e: u32) {\n"
           "let x_n = (n + WG - 1u - lid) / WG;\nfor (var x_i = 0u; x_i < x_n; x_i++) {}\n"
           "for (var i = 0u; i < 4u; i++) {}\nfor (var i = 0u; i < NST; i++) {}\nfor (var e = 0u; e < n_e; e++) {}\n"
           "for (var j = 0u; j < (RMAX * TK + WG - 1u) / WG; j++) {}\n"
           "for (var x = lid; x < n; x += WG) {  // rolled: a rare path\n}")
    assert loop_problems(src) == []
    assert loop_problems("// rolled (every loop): measured slower counted\nfn f() { loop { } }") == []
    # an expression with a run-time value in it is not fixed before the body
    assert loop_problems("fn f(n: u32) {\nfor (var j = 0u; j < (n + WG - 1u) / WG; j++) {}\n}")
