"""The spec and its tests stay in step: every rule has a test, every breakable rule a SpecError path.

Rules are the ``{#rN}`` anchors of the spec pages (``docs/spec/*.md``). A test checks rule RN when
its name holds ``RN`` between underscores or at an end (``test_R13_...``, ``test_R22_R10_...``,
``test_R17_...[R6]`` through the mutation catalogue). The rules an input can break are the rule
ids the validation modules raise ``SpecError`` with; each must have a mutation in the kit's
catalogue (:mod:`paged_sparse_attn.testing.mutations`), so that the conformance kit's R17 tests
break it on every backend, or an exemption below that says why not.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import paged_sparse_attn
from paged_sparse_attn.testing import mutations

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "docs" / "spec"
PKG = Path(paged_sparse_attn.__file__).resolve().parent
VALIDATION = [PKG / "_validation.py", PKG / "index_branch" / "_validation.py"]

pytestmark = pytest.mark.skipif(not SPEC.is_dir(), reason="the spec pages are not in this tree")

# Rules an input can break that have no mutation in the catalogue, and why.
NO_MUTATION = {
    "R13": "raised for a hand-built or tampered KVOuterIndex passed to forward_partials() or "
           "combine_partials(), not for an input of forward() or sparse_attention(); the R13 "
           "tests of tests/test_validation.py and tests/test_reliability.py break it field by field",
    "R14": "raised for malformed Partials passed to combine_partials(); the R14 tests of "
           "tests/test_validation.py break it",
}


def spec_rules() -> set[str]:
    """Every rule id with an anchor on a spec page."""
    return {f"R{n}" for page in SPEC.glob("*.md") for n in re.findall(r"\{#r(\d+)\}", page.read_text())}


def suite_test_names() -> list[str]:
    """Names of every test function of the project's suite and of the packaged kit."""
    files = [*ROOT.joinpath("tests").rglob("test_*.py"), *PKG.joinpath("testing").glob("test_*.py")]
    names = []
    for f in files:
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
                names.append(node.name)
    return names


def names_rule(name: str, rule: str) -> bool:
    return re.search(rf"(^|_){rule}(_|$)", name) is not None


def breakable_rules() -> set[str]:
    """Rule ids the validation modules raise SpecError with."""
    return {r for f in VALIDATION for r in re.findall(r'"(R\d+)"', f.read_text())}


def test_the_spec_has_its_rules():
    rules = spec_rules()
    assert {f"R{n}" for n in range(1, 27)} <= rules, sorted(rules, key=lambda r: int(r[1:]))


def test_every_rule_has_a_test_named_after_it():
    names = suite_test_names()
    # the kit's R17 tests are parametrized by the catalogue's rules: their ids name them
    catalogued = set(mutations.MUTATIONS) | set(mutations.INDEX_MUTATIONS)
    missing = [r for r in spec_rules() if not any(names_rule(n, r) for n in names) and r not in catalogued]
    assert not missing, f"rules without a test whose name holds the id: {sorted(missing, key=lambda r: int(r[1:]))}"


def test_every_rule_an_input_can_break_has_a_mutation_or_a_reason():
    catalogued = set(mutations.MUTATIONS) | set(mutations.INDEX_MUTATIONS)
    breakable = breakable_rules()
    missing = breakable - catalogued - set(NO_MUTATION)
    assert not missing, f"rules an input can break without a mutation in the catalogue: {sorted(missing)}"
    stale = set(NO_MUTATION) & (catalogued | (set(NO_MUTATION) - breakable))
    assert not stale, f"exemptions that no longer apply (catalogued, or no longer raised): {sorted(stale)}"


def test_the_catalogue_names_only_rules_of_the_spec_and_each_has_mutations():
    rules = spec_rules()
    for table in (mutations.MUTATIONS, mutations.INDEX_MUTATIONS):
        assert set(table) <= rules, sorted(set(table) - rules)
        assert all(table[r] for r in table), [r for r in table if not table[r]]
    assert tuple(mutations.MUTATIONS) == mutations.RULES
    assert tuple(mutations.INDEX_MUTATIONS) == mutations.INDEX_RULES


def test_exempt_rules_have_their_own_tests():
    names = suite_test_names()
    assert all(any(names_rule(n, r) for n in names) for r in NO_MUTATION), NO_MUTATION


def test_the_meta_test_sees_a_missing_rule():
    """The checks above would notice a rule nobody tests, and a test name that only mentions R1x."""
    assert not any(names_rule(n, "R999") for n in suite_test_names())
    assert names_rule("test_R22_R10_unmapped", "R10") and not names_rule("test_R100_x", "R10")
