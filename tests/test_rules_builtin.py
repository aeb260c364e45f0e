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


def test_a_test_model_onnxruntime_cannot_run_is_that_tests_failure() -> None:
    """A bfloat16 attention (no CPU kernels) fused by a rule whose dtype check is gone: the
    test fails with the reason, where before the whole ``rules test`` run stopped (exit 2)."""
    from fusectl.compile import compile_rules
    from fusectl.rulefile import load_rule_text

    loose = compile_rules(load_rule_text(BFLOAT16_SDPA))
    outcome = run_rule_test(loose[0], loose[0].rule.tests[0])
    assert not outcome.passed
    assert any(p.startswith("outputs not checked: onnxruntime cannot run the input model")
               for p in outcome.problems), outcome.problems


BFLOAT16_SDPA = """
version: 1
rules:
  - id: sdpa-any-dtype
    summary: Softmax(Q.K^T).V -> Attention, with no dtype check
    when: {opset: ">=23"}
    match:
      - s = MatMul(Q, Transpose<perm=[0, 1, 3, 2]>(K))
      - y = MatMul(Softmax<axis=-1>(s), V)
    replace:
      - y = Attention(Q, K, V)
    tests:
      - name: bfloat16-must-not-fire
        model: |
          <ir_version: 10, opset_import: ["" : 23]>
          g (bfloat16[2,4,6,16] Q, bfloat16[2,4,6,16] K, bfloat16[2,4,6,16] V)
            => (bfloat16[2,4,6,16] y)
          {
            kt = Transpose<perm=[0, 1, 3, 2]>(K)
            s = MatMul(Q, kt)
            p = Softmax<axis=-1>(s)
            y = MatMul(p, V)
          }
        expect: {fires: 0}
"""
