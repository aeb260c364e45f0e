"""Every built-in rule's embedded tests, run exactly as ``fusectl rules test`` runs them."""

from __future__ import annotations

import pytest

from fusectl.api import load_rule_set
from fusectl.ruletest import lint_tests, run_rule_test

RULES = load_rule_set(opt_in=True)  # opt-in rules are tested like the others
CASES = [(rule, test) for rule in RULES for test in rule.rule.tests]


@pytest.mark.parametrize(
    ("rule", "test"), CASES, ids=[f"{r.id}/{t.name}" for r, t in CASES]
)
def test_embedded(rule, test) -> None:
    outcome = run_rule_test(rule, test)
    assert outcome.passed, "\n".join(outcome.problems)
    if (test.expect.fires or 0) > 0:
        assert outcome.max_abs_error is not None, "a firing test must be checked numerically"


def test_library_proves_both_sides() -> None:
    assert lint_tests(RULES) == []
    assert len(RULES) >= 10
