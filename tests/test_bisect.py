"""Tests for fusectl.bisect: the search for guilty rule applications, over fake oracles."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fusectl
from fusectl import api, ortprocess
from fusectl import validate as validation
from fusectl.bisect import bisect
from fusectl.cli import main
from fusectl.validate import ValidationResult, generate_inputs, run_model, validate


class Monotone:
    """Validates unless a guilty item is kept; records every veto set it was asked about."""

    def __init__(self, n: int, guilty: set[int]):
        self.everything = frozenset(range(n))
        self.guilty = guilty
        self.asked: list[frozenset[int]] = []

    def __call__(self, vetoed: frozenset[int]) -> bool:
        self.asked.append(vetoed)
        return not (self.everything - vetoed) & self.guilty


def test_one_guilty_among_sixteen_in_four_rules():
    groups = ["a"] * 4 + ["b"] * 4 + ["c"] * 4 + ["d"] * 4
    oracle = Monotone(16, {9})
    outcome = bisect(groups, oracle)
    assert outcome.guilty == (9,) and outcome.unverified == () and outcome.explained
    # Worked by hand. Rules: the prepared model (1); keep rules a+b: ok (2); add rule c:
    # fails (3); add rule d instead: ok (4). Inside rule c, with a, b, d kept: add 8, 9:
    # fails (5); add 8: ok (6), so 9 is guilty; add 10, 11: ok (7). Seven calls.
    assert outcome.calls == len(oracle.asked) == 7
    assert oracle.asked[0] == frozenset(range(16))
    assert oracle.asked[1] == frozenset(range(8, 16))  # keep rules a and b: first half of rules
    assert oracle.asked[4] == frozenset({10, 11})  # keep a, b, d and 8, 9 of rule c
    assert oracle(frozenset(outcome.guilty))  # the final configuration validates


def test_two_guilty_in_different_rules_keep_everything_else():
    groups = ["conv-bn"] * 5 + ["gemm"] * 3 + ["gelu"] * 2
    outcome = bisect(groups, Monotone(10, {1, 8}))
    assert outcome.guilty == (1, 8) and outcome.unverified == ()


def test_every_application_of_one_wrong_rule():
    groups = ["ok"] * 3 + ["wrong"] * 4 + ["fine"] * 3
    outcome = bisect(groups, Monotone(10, {3, 4, 5, 6}))
    assert outcome.guilty == (3, 4, 5, 6)


def test_guilty_only_in_combination_reverts_the_one_that_broke_it():
    """Items 2 and 6 break the model only together: reverting 6 (added last) is enough."""
    everything = frozenset(range(8))

    def oracle(vetoed: frozenset[int]) -> bool:
        return not {2, 6} <= everything - vetoed

    outcome = bisect(["r"] * 8, oracle)
    assert outcome.guilty == (6,)
    assert oracle(frozenset(outcome.guilty))


def test_unexplained_when_even_the_prepared_model_fails():
    calls = []

    def oracle(vetoed: frozenset[int]) -> bool:
        calls.append(vetoed)
        return False

    outcome = bisect(["a", "b", "c"], oracle)
    assert not outcome.explained and outcome.guilty == () and outcome.calls == 1
    assert calls == [frozenset({0, 1, 2})]


def test_budget_reverts_the_unresolved_rest_and_still_validates():
    oracle = Monotone(32, set(range(32)))  # every application is wrong
    outcome = bisect(["r"] * 32, oracle, budget=10)
    assert outcome.calls == 10 == len(oracle.asked)
    assert outcome.guilty == tuple(range(32))
    assert 0 < len(outcome.unverified) < 32  # some were proven guilty before the budget ran out
    assert set(outcome.unverified) <= set(outcome.guilty)
    assert oracle(frozenset(outcome.guilty))


def test_budget_running_out_inside_a_wrong_rule_spares_the_other_rules():
    groups = ["a"] * 4 + ["wrong"] * 16 + ["b"] * 4
    oracle = Monotone(24, set(range(4, 20)))
    outcome = bisect(groups, oracle, budget=8)
    assert outcome.guilty == tuple(range(4, 20))  # all of the wrong rule, nothing else
    assert set(outcome.unverified) < set(range(4, 20)) and outcome.unverified
    assert oracle(frozenset(outcome.guilty))


def test_budget_must_be_positive():
    with pytest.raises(ValueError, match="budget"):
        bisect(["a"], lambda _v: True, budget=0)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.sampled_from("abcde"), min_size=1, max_size=40).flatmap(
        lambda groups: st.tuples(
            st.just(groups), st.sets(st.integers(0, len(groups) - 1), min_size=1)
        )
    )
)
def test_finds_exactly_the_guilty_set_of_a_monotone_oracle(case):
    """Each reverted item is a witness (keeping it breaks a validated set), so with a
    monotone oracle the reverted set is exactly the guilty set, at a logarithmic cost."""
    groups, guilty = case
    oracle = Monotone(len(groups), guilty)
    outcome = bisect(groups, oracle, budget=10_000)
    assert set(outcome.guilty) == guilty and outcome.unverified == ()
    n, k = len(groups), len(guilty)
    assert outcome.calls <= 1 + 2 * k * (math.ceil(math.log2(n)) + 1) + 2


# --------------------------------------------------------------------------- end to end
# A deliberately wrong rule, written only here: it folds a per-channel Mul into the Conv
# before it with the multiplier scaled by 1.25. On samples/cnn.onnx it fires once (conv2 +
# scale2) among four applications: conv-bn-fold twice (bn1, bn3) and, in the second pass,
# conv-add-fold on the Conv it created (shift2).

WRONG_MUL_FOLD = """\
version: 1
rules:
  - id: wrong-conv-mul-fold
    summary: Broken on purpose - folds the Mul into the weights with the wrong constant.
    match:
      - y = Conv(x, W, B?)
      - z = Mul(y, m)
    where:
      - expr: is_const(W, m) and (B is None or is_const(B))
      - expr: is_per_channel(m, shape(W)[0], 1, rank(W))
    let:
      wrong: per_channel(m, shape(W)[0], 1, rank(W)) * 1.25
      W2: W * along(wrong, 0, W)
      B2: None if B is None else B * wrong
    replace:
      - z = Conv<**y>(x, W2, B2)
"""


@pytest.fixture(scope="module")
def wrong_rules(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("rules") / "wrong.yaml"
    path.write_text(WRONG_MUL_FOLD)
    return fusectl.load_rule_set([path], exclude=["conv-mul-fold"])


def test_wrong_rule_is_bisected_reverted_and_the_rest_kept(samples: Path, wrong_rules):
    result = fusectl.optimize(samples / "cnn.onnx", rules=wrong_rules)
    bisection = result.bisection
    assert bisection is not None and bisection.explained
    assert not bisection.initial.passed
    assert [(a.rule_id, a.matched) for a in bisection.reverted] == [
        ("wrong-conv-mul-fold", ("scale2", "conv2"))
    ]
    assert bisection.unverified == ()
    # conv-add-fold matched the Conv the wrong rule created: with the Mul back, it cannot.
    assert [(a.rule_id, a.matched) for a in bisection.lost] == [
        ("conv-add-fold", ("shift2", "scale2"))
    ]
    # Worked by hand: prepared model (1), keep conv-bn-fold (2), add the wrong rule: fails
    # (3), add conv-add-fold instead (4) -- that set is the kept model, validated already.
    assert bisection.validations == 4
    assert result.rewrite.counts() == {"conv-bn-fold": 2}
    assert result.verified and not result.passed
    ops = {node.op_type for node in result.model.graph}
    assert "BatchNormalization" not in ops and "Mul" in ops
    # The kept model is what was validated: check it again, independently.
    assert validate(str(samples / "cnn.onnx"), result.model).passed


def test_reference_runs_once_and_sessions_never_coexist(samples: Path, wrong_rules,
                                                        monkeypatch):
    sources: list[object] = []
    created: list[ortprocess.Session] = []
    alive_at_creation: list[int] = []
    real = ortprocess.open_session

    def tracking(source):
        alive_at_creation.append(sum(s._open for s in created))
        sources.append(source)
        created.append(real(source))
        return created[-1]

    monkeypatch.setattr(validation, "open_session", tracking)
    result = fusectl.optimize(samples / "cnn.onnx", rules=wrong_rules)
    assert result.bisection is not None
    reference = str(samples / "cnn.onnx")
    assert sources.count(reference) == 1  # never rerun per bisection step
    assert len(sources) == 1 + 1 + result.bisection.validations  # reference, full, steps
    assert set(alive_at_creation) == {0}


def test_cli_exit_codes_and_written_model(capsys, samples: Path, tmp_path: Path):
    rules = tmp_path / "wrong.yaml"
    rules.write_text(WRONG_MUL_FOLD)
    model = tmp_path / "cnn.onnx"
    shutil.copy(samples / "cnn.onnx", model)
    out = tmp_path / "out.onnx"
    report = tmp_path / "r.json"
    args = ["optimize", str(model), "-o", str(out), "--rules", str(rules),
            "--skip-rule", "conv-mul-fold", "--json", str(report)]
    assert main([*args, "-v"]) == 1
    stdout, stderr = capsys.readouterr()
    assert "wrong-conv-mul-fold on scale2, conv2" in stderr and "--allow-revert" in stderr
    assert "wrong-conv-mul-fold on scale2, conv2" in stdout
    assert "|candidate - reference| of logits" in stdout  # -v: the error histograms
    assert out.exists()  # the model that keeps every verified fusion
    assert validate(str(model), str(out)).passed
    doc = json.loads(report.read_text())
    assert doc["passed"] is False and doc["validation"]["passed"] is True
    assert doc["bisection"]["reverted"] == [
        {"rule": "wrong-conv-mul-fold", "matched": ["scale2", "conv2"], "created": ["scale2"]}
    ]
    assert doc["bisection"]["initial_validation"]["passed"] is False
    out.unlink()
    assert main([*args, "--allow-revert", "-q"]) == 0
    _, stderr = capsys.readouterr()
    assert stderr.startswith("warning: reverted 1 rule application") and out.exists()


def test_check_intermediates_names_the_first_drift(capsys, samples: Path, tmp_path: Path,
                                                   wrong_rules):
    result = fusectl.optimize(samples / "cnn.onnx", rules=wrong_rules, intermediates=True)
    boundaries = result.intermediates
    assert boundaries is not None
    # The outputs of bn1 and bn3 (conv-bn-fold), scale2's Conv is gone into shift2's:
    # in topological order bn1 is exact enough, shift2 (wrong-conv-mul-fold + conv-add-fold)
    # is the first to drift, and bn3 downstream of it drifts too.
    assert [b.value for b in boundaries] == ["bn1", "shift2", "bn3"]
    assert [b.comparison.passed for b in boundaries] == [True, False, False]
    drift = result.first_drift
    assert drift is not None and drift.value == "shift2"
    assert drift.application.rule_id == "conv-add-fold"
    # shift2 = conv2 * m + shift, and the wrong fold computes conv2 * (1.25 m) + shift:
    # the error is a quarter of scale2's value (conv2 * m) in the original model.
    original = ir.load(samples / "cnn.onnx")
    feeds = generate_inputs(original)
    original.graph.outputs.append(next(n for n in original.graph if n.name == "scale2").outputs[0])
    scale2 = run_model(original, feeds)["scale2"]
    assert drift.comparison.max_abs == pytest.approx(0.25 * np.abs(scale2).max(), rel=1e-4)


def test_unexplained_mismatch_reverts_nothing(samples: Path, monkeypatch):
    """When even the prepared model fails, no application is to blame: nothing is kept."""
    failing = ValidationResult(error="synthetic failure")
    monkeypatch.setattr(api, "check_candidate", lambda *args, **kwargs: failing)
    result = fusectl.optimize(samples / "cnn.onnx")
    assert result.bisection is not None and not result.bisection.explained
    assert result.bisection.validations == 1 and result.bisection.reverted == ()
    assert not result.verified and not result.passed
    assert result.rewrite.counts()["conv-bn-fold"] == 2  # the full rewrite is returned


def test_bisection_can_be_turned_off(samples: Path, wrong_rules):
    result = fusectl.optimize(samples / "cnn.onnx", rules=wrong_rules, bisect=False)
    assert result.bisection is None and not result.verified
    assert result.rewrite.counts()["wrong-conv-mul-fold"] == 1
