"""Tests for fusectl.rulefile: YAML rule files -> frozen Rules, every error with file:line.

The YAML texts are written out in full so that line numbers can be read off
the left margin comments; problems are compared as (line, message fragment).
"""

from __future__ import annotations

import dataclasses
import textwrap
import time
from pathlib import Path

import pytest

from fusectl import rulefile
from fusectl.errors import BadInputError, RuleFileError, SourceSpan
from fusectl.rulefile import load_rule_file, load_rule_text, load_rules, rule_files
from fusectl.statements import OpRef, Ref

FILE = "rules.yaml"


def yaml_text(text: str) -> str:
    return textwrap.dedent(text).lstrip("\n")


def problems(text: str) -> list[tuple[int, str]]:
    """Load ``text`` expecting failure; check the error's shape; return (line, message)."""
    start = time.perf_counter()
    with pytest.raises(RuleFileError) as info:
        load_rule_text(text, FILE)
    assert time.perf_counter() - start < 2.0
    err = info.value
    assert isinstance(err, BadInputError) and err.exit_code == 2
    assert err.problems, "a RuleFileError must carry problems"
    for span, _ in err.problems:
        assert isinstance(span, SourceSpan) and span.file == FILE and span.line >= 1
    assert str(err) == "\n".join(f"{FILE}:{span.line}: {msg}" for span, msg in err.problems)
    return [(span.line, msg) for span, msg in err.problems]


def assert_problems(text: str, expected: list[tuple[int, str]]) -> None:
    """Exactly the expected problems (any order): each (line, fragment) matches one."""
    actual = problems(text)
    remaining = list(actual)
    for line, fragment in expected:
        for i, (got_line, message) in enumerate(remaining):
            if got_line == line and fragment in message:
                del remaining[i]
                break
        else:
            pytest.fail(f"no problem ({line}, {fragment!r}) in {actual}")
    assert not remaining, f"unexpected problems {remaining}; all: {actual}"


GOOD = yaml_text(
    """
    version: 1
    rules:
      - id: relu-relu
        summary: Two Relus are one.
        match:
          - y = Relu(x)
          - z = Relu(y)
        replace:
          - z = Relu(x)
    """
)


def test_good_file_loads() -> None:
    (rule,) = load_rule_text(GOOD, FILE)
    assert rule.id == "relu-relu"
    assert rule.summary == "Two Relus are one."
    assert rule.file == FILE and rule.line == 3
    assert str(rule.source) == f"{FILE}:3"
    assert rule.captures == ("x",)
    assert rule.outputs == ("z",)
    assert [str(s.op) for s in rule.match] == ["Relu", "Relu"]
    assert rule.match_variants == (rule.match,)
    assert rule.match_text == ("y = Relu(x)", "z = Relu(y)")
    assert rule.replace_text == ("z = Relu(x)",)
    assert rule.when == rulefile.When()
    assert rule.where == () and rule.let == () and rule.tests == ()
    with pytest.raises(dataclasses.FrozenInstanceError):
        rule.id = "other"  # type: ignore[misc]


def test_empty_rule_list_is_fine() -> None:
    assert load_rule_text("version: 1\nrules: []\n") == []


# ------------------------------------------------------------------- golden errors


def test_unknown_top_level_key() -> None:
    assert_problems(GOOD + "extra: 1\n", [(10, "unknown key 'extra' in the rule file")])


def test_unknown_rule_key_at_its_line() -> None:
    text = yaml_text(
        """
        version: 1
        rules:
          - id: relu-relu
            sumary: Two Relus are one.
            match:
              - y = Relu(x)
              - z = Relu(y)
            replace:
              - z = Relu(x)
        """
    )
    assert_problems(text, [
        (4, "unknown key 'sumary' in a rule; allowed: fuse, group, id, let, match, merge, "
            "opt_in, replace, summary, tests, when, where"),
        (3, "a rule is missing required key 'summary'"),
    ])


def test_opt_in_keeps_its_reason_and_a_rule_is_on_without_it() -> None:
    opt_in = GOOD.replace("    match:", "    opt_in: slower on the CPU kernel\n    match:")
    assert load_rule_text(opt_in, FILE)[0].opt_in == "slower on the CPU kernel"
    assert load_rule_text(GOOD, FILE)[0].opt_in == ""


def test_opt_in_needs_a_reason() -> None:
    text = GOOD.replace("    match:", "    opt_in: ''\n    match:")
    assert_problems(text, [(5, "opt_in (why the rule is off by default) must be a non-empty "
                               "string")])


def test_unknown_key_with_block_value_at_the_key_line() -> None:
    text = yaml_text(
        """
        version: 1
        rules:
          - id: relu-relu
            summary: Two Relus are one.
            match:
              - y = Relu(x)
              - z = Relu(y)
            bogus:
              - a
            replace:
              - z = Relu(x)
        """
    )
    assert_problems(text, [(8, "unknown key 'bogus' in a rule")])


def test_missing_required_rule_keys() -> None:
    text = yaml_text(
        """
        version: 1
        rules:
          - id: lonely
          - summary: no id
            match:
              - y = Relu(x)
            replace:
              - y = Relu(x)
        """
    )
    assert_problems(text, [
        (3, "a rule is missing required key 'summary'"),
        (3, "a rule is missing required key 'match'"),
        (3, "a rule needs exactly one of 'replace' and 'fuse'"),
        (4, "a rule is missing required key 'id'"),
    ])


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("rules: []\n", [(1, "the rule file is missing required key 'version'")]),
        ("version: 1\n", [(1, "the rule file is missing required key 'rules'")]),
        ("version: 1\nrules: {}\n", [(2, "'rules' must be a list")]),
        ("version: 1\nrules:\n  - 5\n", [(3, "a rule must be a mapping")]),
    ],
)
def test_missing_or_malformed_top_level(text: str, expected: list[tuple[int, str]]) -> None:
    assert_problems(text, expected)


@pytest.mark.parametrize(
    ("value", "shown"), [("2", "2"), ("0", "0"), ("'1'", "'1'"), ("null", "None"), ("v1", "'v1'")]
)
def test_wrong_version(value: str, shown: str) -> None:
    assert_problems(f"version: {value}\nrules: []\n",
                    [(1, f"unsupported version {shown}; expected 1")])


def test_boolean_version_is_rejected() -> None:
    assert_problems("version: true\nrules: []\n", [(1, "unsupported version True")])


def test_duplicate_top_level_key() -> None:
    assert_problems(
        "version: 1\nversion: 1\nrules: []\n",
        [(2, "duplicate key 'version' (first at line 1)")],
    )


def test_duplicate_key_in_a_rule_is_reported_at_the_second_key() -> None:
    text = yaml_text(
        """
        version: 1
        rules:
          - id: relu-relu
            summary: Two Relus are one.
            match:
              - y = Relu(x)
              - z = Relu(y)
            match:
              - z = Relu(x)
            replace:
              - z = Relu(x)
        """
    )
    assert_problems(text, [(8, "duplicate key 'match' (first at line 5)")])


def test_duplicate_key_in_a_nested_mapping() -> None:
    text = yaml_text(
        """
        version: 1
        rules:
          - id: relu-relu
            summary: Two Relus are one.
            match:
              - y = Relu(x)
              - z = Relu(y)
            let:
              a: 1
              b: 2
              a: 3
            replace:
              - z = Relu(x)
        """
    )
    assert_problems(text, [(11, "duplicate key 'a' (first at line 9)")])


def test_duplicate_rule_ids() -> None:
    text = GOOD + GOOD.split("rules:\n", 1)[1]
    assert_problems(text, [(10, "duplicate rule id 'relu-relu' (first at line 3)")])


@pytest.mark.parametrize(
    "bad_id", ["Relu_Relu", "relu_relu", "Relu", "-relu", "relu-", "relu relu", "relu.relu"]
)
def test_bad_rule_id(bad_id: str) -> None:
    assert_problems(GOOD.replace("relu-relu", f"'{bad_id}'"),
                    [(3, f"rule id {bad_id!r} must be lowercase-kebab-case")])


@pytest.mark.parametrize("good_id", ["a1", "conv-bn-fold", "gelu-erf", "x2-y3"])
def test_good_rule_ids(good_id: str) -> None:
    assert [r.id for r in load_rule_text(GOOD.replace("relu-relu", good_id))] == [good_id]


def test_single_character_rule_id() -> None:
    assert [r.id for r in load_rule_text(GOOD.replace("relu-relu", "x"))] == ["x"]


def test_non_string_id_and_summary() -> None:
    text = GOOD.replace("relu-relu", "123").replace("Two Relus are one.", "''")
    assert_problems(text, [(3, "id must be a non-empty string"),
                           (4, "summary must be a non-empty string")])


def test_statement_syntax_error_in_replace() -> None:
    assert_problems(GOOD.replace("- z = Relu(x)", "- z = Relu(x"),
                    [(9, "replace: missing closing ')'")])


def test_statement_syntax_error_in_match_is_reported_at_its_line() -> None:
    text = GOOD.replace("- z = Relu(y)", "- z = Relu<alpha>(y)")
    first_line, first_message = problems(text)[0]
    assert first_line == 7
    assert first_message == "match: bad attribute 'alpha'; expected name=value"


def test_match_syntax_error_does_not_cascade() -> None:
    assert_problems(GOOD.replace("- z = Relu(y)", "- z = Relu(y"),
                    [(7, "match: missing closing ')'")])


def test_statement_errors_in_several_statements_are_all_reported() -> None:
    text = yaml_text(
        """
        version: 1
        rules:
          - id: relu-relu
            summary: Two Relus are one.
            match:
              - y = Relu(x)
              - z = Relu(y)
            replace:
              - t = Relu(x?)
              - z = Relu | Sigmoid (t)
              - q = Add(t, 1.0)
        """
    )
    assert_problems(text, [
        (9, "replace: '?' (optional input) is only for match statements"),
        (10, "replace: alternatives ('|') are only allowed in match statements"),
        (11, "replace: replace inputs must be names"),
    ])


def test_where_with_undefined_name_at_the_expression_line() -> None:
    text = yaml_text(
        """
        version: 1
        rules:
          - id: relu-relu
            summary: Two Relus are one.
            match:
              - y = Relu(x)
              - z = Relu(y)
            where:
              - rank(x) == 2
              - expr: rank(q) == 1
                message: q is wrong
              - expr: >-
                  rank(x) == 2
                  and size(w) == 1
              - rank(y) > 0
            replace:
              - z = Relu(x)
        """
    )
    assert_problems(text, [
        (10, "where: undefined name 'q'"),
        (12, "where: undefined name 'w'"),
    ])


def test_where_entry_keys() -> None:
    text = yaml_text(
        """
        version: 1
        rules:
          - id: relu-relu
            summary: Two Relus are one.
            match:
              - y = Relu(x)
              - z = Relu(y)
            where:
              - message: no expression
              - expr: rank(x) == 2
                msg: typo
            replace:
              - z = Relu(x)
        """
    )
    assert_problems(text, [
        (9, "a where entry is missing required key 'expr'"),
        (11, "unknown key 'msg' in a where entry; allowed: expr, message"),
    ])


@pytest.mark.parametrize(
    ("line_text", "fragment"),
    [
        ("x.__class__", "where: attribute access is not allowed"),
        ("().__class__.__bases__", "where: attribute access is not allowed"),
        ("__import__('os').system('echo hi')", "where: "),
        ("eval('1')", "where: unknown function 'eval'"),
        ("[v for v in x]", "where: a comprehension is not allowed"),
        ("2 ** 2 ** 2 ** 2 ** 2 if _x else 1", "where: name '_x' is not allowed"),
    ],
)
def test_hostile_where_expression_at_its_line(line_text: str, fragment: str) -> None:
    text = GOOD.replace("    replace:", f"    where:\n      - \"{line_text}\"\n    replace:")
    assert_problems(text, [(9, fragment)])


def test_hostile_let_and_replace_attribute_expressions() -> None:
    text = yaml_text(
        """
        version: 1
        rules:
          - id: relu-relu
            summary: Two Relus are one.
            match:
              - y = Relu(x)
              - z = Relu(y)
            let:
              s: x.__class__
              t: open('/etc/passwd')
            replace:
              - "z = LeakyRelu<alpha=(lambda: 1)()>(x)"
        """
    )
    assert_problems(text, [
        (9, "let s: attribute access is not allowed"),
        (10, "let t: unknown function 'open'"),
        (12, "replace: attribute alpha: unknown function"),
    ])


def test_let_shadowing_and_bad_names() -> None:
    text = yaml_text(
        """
        version: 1
        rules:
          - id: relu-relu
            summary: Two Relus are one.
            match:
              - y = Relu(x)
              - z = Relu(y)
            let:
              x: 1
              rank: 2
              _t: 3
              u: v + 1
              v: 1
              w: v * 2
            replace:
              - z = Relu(x)
        """
    )
    assert_problems(text, [
        (9, "let name 'x' is already defined"),
        (10, "let name 'rank' is already defined"),
        (11, "let name '_t' is not a valid name"),
        (12, "let u: undefined name 'v'"),  # let is ordered: v is defined later
    ])


def test_let_must_be_a_mapping() -> None:
    text = GOOD.replace("    replace:", "    let:\n      - a: 1\n    replace:")
    # problems with a value are reported where the value starts
    assert_problems(text, [(9, "let must be a mapping of name: expression")])


def test_replace_missing_a_match_output() -> None:
    assert_problems(GOOD.replace("- z = Relu(x)", "- w = Relu(x)"),
                    [(9, "replace must produce the match output 'z'")])


def test_replace_using_unknown_names() -> None:
    text = yaml_text(
        """
        version: 1
        rules:
          - id: relu-relu
            summary: Two Relus are one.
            match:
              - y = Relu(x)
              - z = Relu(y)
            replace:
              - z = Add(q, y)
        """
    )
    assert_problems(text, [
        (9, "replace: 'q' is not a capture, a let name or an earlier replacement output"),
        (9, "replace: 'y' is not a capture"),  # an intermediate of the match is gone
    ])


def test_replace_unknown_name_at_its_statement_line() -> None:
    text = yaml_text(
        """
        version: 1
        rules:
          - id: relu-relu
            summary: Two Relus are one.
            match:
              - y = Relu(x)
              - z = Relu(y)
            replace:
              - t = Relu(x)
              - z = Add(t, q)
        """
    )
    assert_problems(text, [(10, "replace: 'q' is not a capture")])


def test_replace_may_use_lets_and_earlier_outputs() -> None:
    text = yaml_text(
        """
        version: 1
        rules:
          - id: relu-relu
            summary: Two Relus are one.
            match:
              - y = Relu(x)
              - z = Relu<alpha=a>(y)
            let:
              k: a * 2
            replace:
              - t = Relu<**z, beta=k + 1>(x, k)
              - z = Relu(t)
        """
    )
    (rule,) = load_rule_text(text)
    assert rule.captures == ("x", "a")
    assert [b.name for b in rule.let] == ["k"]
    assert rule.let[0].line == 9
    assert rule.replace[0].copy_attrs_from == "z"


def test_replace_checks() -> None:
    text = yaml_text(
        """
        version: 1
        rules:
          - id: relu-relu
            summary: Two Relus are one.
            match:
              - y = Relu(x)
              - z = Relu(y)
            replace:
              - x = Relu<**q>(x)
              - z = Relu<alpha=nope>(x)
        """
    )
    assert_problems(text, [
        (9, "replace: '**q' must name a value the match produces"),
        (9, "replace: 'x' is a capture and cannot be produced"),
        (10, "replace: attribute alpha: undefined name 'nope'"),
    ])


def test_match_structure_checks() -> None:
    text = yaml_text(
        """
        version: 1
        rules:
          - id: cycle
            summary: every value is consumed
            match:
              - y = Relu(x)
              - x = Relu(y)
            replace:
              - y = Relu(y)
          - id: both-kinds
            summary: a name used as a value and an attribute
            match:
              - z = LeakyRelu<alpha=x>(x)
            replace:
              - z = Relu(x)
          - id: alternatives-differ
            summary: alternatives with different outputs
            match:
              - y = Relu(x)
              - z = Relu(y) | Neg(x)
            replace:
              - z = Relu(x)
        """
    )
    assert_problems(text, [
        (6, "the match has no output (every value is consumed)"),
        (9, "replace: 'y' is not a capture, a let name or an earlier replacement output"),
        (13, "'x' is used both as a value and an attribute"),
        (19, "alternatives produce different outputs: ['z'] vs ['y', 'z']"),
    ])


def test_value_produced_twice_in_match() -> None:
    text = GOOD.replace("      - z = Relu(y)\n", "      - y = Neg(x)\n      - z = Relu(y)\n")
    assert any("'y'" in message for _, message in problems(text))


def test_too_many_alternative_combinations() -> None:
    text = yaml_text(
        """
        version: 1
        rules:
          - id: many
            summary: too many alternatives
            match:
              - y = Relu(x) | Neg(x) | Abs(x) | Exp(x) | Log(x)
              - w = Relu(y) | Neg(y) | Abs(y) | Exp(y)
              - z = Relu(w) | Neg(w)
            replace:
              - z = Relu(x)
        """
    )
    assert (6, "more than 32 alternative combinations") in problems(text)


OPTIONAL_SCALE = """
version: 1
rules:
  - id: scaled-relu
    summary: Relu of a 2-D product, scaled or not, becomes a Relu of a Gemm.
    match:
      - p = MatMul(a, b)
      - s = Mul(p, c) | Div(p, d) | p
      - z = Relu(s)
    where:
      - expr: (c is None or is_const(c)) and (d is None or is_const(d))
    let:
      k: "1.0 if s is p else (item(c) if c is not None else 1.0 / item(d))"
    replace:
      - z = Relu(Gemm<alpha=k>(a, b))
    tests:
      - name: fires-with-scale
        model: |
          <ir_version: 8, opset_import: ["" : 17]>
          g (float[2,3] a, float[3,4] b) => (float[2,4] z)
          <float c = {2.0}>
          { p = MatMul(a, b)  s = Mul(c, p)  z = Relu(s) }
        expect: {fires: 1, ops: {Relu: 1, Gemm: 1, Mul: 0}}
      - name: fires-without-scale
        model: |
          <ir_version: 8, opset_import: ["" : 17]>
          g (float[2,3] a, float[3,4] b) => (float[2,4] z)
          { p = MatMul(a, b)  z = Relu(p) }
        expect: {fires: 1, ops: {Relu: 1, Gemm: 1, MatMul: 0}}
      - name: scale-not-constant
        model: |
          <ir_version: 8, opset_import: ["" : 17]>
          g (float[2,3] a, float[3,4] b, float c) => (float[2,4] z)
          { p = MatMul(a, b)  s = Mul(c, p)  z = Relu(s) }
        expect: {fires: 0}
"""


def test_bare_name_alternative_makes_a_node_optional() -> None:
    (rule,) = load_rule_text(OPTIONAL_SCALE, "optional.yaml")
    assert len(rule.match_variants) == 3
    assert rule.match_aliases == ((), (), (("s", "p"),))
    unscaled = rule.match_variants[2]
    assert [str(spec.op) for spec in unscaled] == ["MatMul", "Relu"]
    assert unscaled[1].inputs == (Ref("p"),)
    assert set(rule.captures) == {"a", "b", "c", "d"}
    from fusectl.compile import CompiledRule
    from fusectl.ruletest import run_tests

    results = run_tests([CompiledRule(rule)])
    assert [r.passed for r in results] == [True, True, True], [r.problems for r in results]


def test_bare_name_alternative_errors() -> None:
    unread = OPTIONAL_SCALE.replace("      - z = Relu(s)\n", "      - z = Relu(s) | s\n")
    assert any("'z' has a bare-name alternative but no statement reads it" in m
               for _, m in problems(unread))
    cycle = OPTIONAL_SCALE.replace("      - p = MatMul(a, b)\n",
                                   "      - p = MatMul(a, b) | s\n")
    assert any("cycle" in m for _, m in problems(cycle))


def test_when_and_tests_errors() -> None:
    text = yaml_text(
        """
        version: 1
        rules:
          - id: relu-relu
            summary: Two Relus are one.
            when: {opset: '>=x', target: [1], imports: {com.microsoft: a}, foo: 1}
            match:
              - y = Relu(x)
              - z = Relu(y)
            replace:
              - z = Relu(x)
            tests:
              - name: t
                model: m
                expect: {fires: -1, ops: {Relu: x}, nodes: 1.5, bar: 1}
                init: {W: 'uniform(1)'}
                rtol: -1
              - name: u
        """
    )
    assert_problems(text, [
        (5, "unknown key 'foo' in when; allowed: imports, opset, target"),
        (5, "bad opset range '>=x'"),
        (5, "target must be a name or a list of names"),
        (5, "imports must map a domain to an opset version"),
        (14, "unknown key 'bar' in expect; allowed: fires, nodes, ops"),
        (14, "expect counts must be non-negative integers"),
        (14, "expect counts must be non-negative integers"),
        (14, "expect.ops must map op names to counts"),
        (15, "init W: use uniform(lo, hi), normal(mean, std), a number or a list"),
        (16, "rtol must be a non-negative number"),
        (17, "a test is missing required key 'model'"),
        (17, "a test is missing required key 'expect'"),
    ])


def test_when_and_tests_parsed() -> None:
    text = yaml_text(
        """
        version: 1
        rules:
          - id: relu-relu
            summary: Two Relus are one.
            when:
              opset: {ai.onnx: '>=13,<18', com.microsoft: 1}
              target: [onnxruntime]
              imports: {com.microsoft: 1}
            match:
              - y = Relu(x)
              - z = Relu(y)
            replace:
              - z = Relu(x)
            tests:
              - name: fires
                model: some model text
                init: {W: 'uniform(-1, 1)', b: [1, 2], c: 0.5}
                expect: {fires: 1, ops: {Relu: 1, Neg: 0}, nodes: 1}
                atol: 0.001
        """
    )
    (rule,) = load_rule_text(text)
    opsets = dict(rule.when.opsets)
    assert set(opsets) == {"", "com.microsoft"}
    assert opsets[""].bounds == ((">=", 13), ("<", 18))
    assert [v for v in (12, 13, 17, 18) if opsets[""].allows(v)] == [13, 17]
    assert opsets["com.microsoft"].allows(1) and not opsets["com.microsoft"].allows(2)
    assert rule.when.targets == ("onnxruntime",)
    assert rule.when.imports == (("com.microsoft", 1),)
    (test,) = rule.tests
    assert test.name == "fires" and test.model == "some model text" and test.line == 15
    assert test.expect == rulefile.Expect(fires=1, ops=(("Neg", 0), ("Relu", 1)), nodes=1)
    assert dict(test.init) == {"W": "uniform(-1, 1)", "b": [1, 2], "c": 0.5}
    assert test.atol == 0.001 and test.rtol is None


# --------------------------------------------------------------------- YAML safety


@pytest.mark.parametrize(
    "tag",
    [
        "!!python/object/apply:os.system",
        "!!python/object/new:os.system",
        "!!python/name:os.system",
        "!!python/module:os",
    ],
)
def test_python_tags_are_rejected_without_executing(tag: str, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    text = f'version: 1\nrules: {tag} ["touch {marker}"]\n'
    found = problems(text)
    assert found[0][0] == 2
    assert "YAML tag" in found[0][1] and "is not allowed in rule files" in found[0][1]
    assert all(line == 2 for line, _ in found)
    assert not marker.exists()


def test_python_tag_in_a_rule_value(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    text = GOOD.replace("Two Relus are one.",
                        f'!!python/object/apply:os.system ["touch {marker}"]')
    # one line: what the tag stood for is not reported again as a missing summary
    assert_problems(text, [
        (4, "YAML tag 'tag:yaml.org,2002:python/object/apply:os.system' is not allowed"),
    ])
    assert not marker.exists()


def test_every_refused_tag_is_reported() -> None:
    found = problems("version: 1\nrules: []\nx: !custom 1\ny: !!binary aGk=\n")
    assert [line for line, _ in found] == [3, 4]
    assert all("YAML tag" in message for _, message in found)


@pytest.mark.parametrize(
    ("value", "tag"),
    [
        ("!custom 1", "'!custom'"),
        ("!!binary aGk=", "binary"),
        ("!!set {a: null}", "set"),
        ("2001-01-01", "timestamp"),
    ],
)
def test_other_tags_are_rejected(value: str, tag: str) -> None:
    found = problems(f"version: 1\nrules: []\nx: {value}\n")
    assert any(line == 3 and "YAML tag" in msg and tag in msg for line, msg in found), found


def test_explicit_standard_tags_are_fine() -> None:
    assert load_rule_text("version: !!int 1\nrules: !!seq []\n") == []


def test_aliases_are_rejected() -> None:
    text = yaml_text(
        """
        version: 1
        rules:
          - id: &name relu-relu
            summary: *name
            match:
              - y = Relu(x)
              - z = Relu(y)
            replace:
              - z = Relu(x)
        """
    )
    # PyYAML resolves an alias to its anchored node, so it is reported at the anchor
    assert_problems(text, [
        (3, "YAML anchors and aliases are not allowed in rule files"),
    ])


def test_merge_keys_are_rejected() -> None:
    found = problems("version: 1\nrules: []\n<<: {a: 1}\n")
    assert any(line == 3 and "merge" in msg for line, msg in found), found


def _laughs(levels: int, width: int) -> str:
    lines = ["version: 1", "rules: []", "lol:", "  l0: &l0 [lol]"]
    for level in range(1, levels):
        refs = ", ".join([f"*l{level - 1}"] * width)
        lines.append(f"  l{level}: &l{level} [{refs}]")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(("levels", "width"), [(9, 9), (40, 10)])
def test_billion_laughs_rejected_quickly(levels: int, width: int) -> None:
    start = time.perf_counter()
    found = problems(_laughs(levels, width))
    assert time.perf_counter() - start < 1.0
    anchors = [p for p in found if "anchors and aliases" in p[1]]
    # one problem per alias written in the file, never per expanded copy
    assert len(anchors) == (levels - 1) * width
    others = [message for _, message in found if "anchors and aliases" not in message]
    assert others == ["unknown key 'lol' in the rule file; allowed: rules, target, version"]


# -------------------------------------------------------------------- broken files


@pytest.mark.parametrize(
    ("text", "line", "fragment"),
    [
        ("version: 1\nrules:\n  - id: a\n   summary: b\n", 4, "invalid YAML: expected <block end>"),
        ("version: 1\nrules:\n\t- id: a\n", 3, "invalid YAML: found character '\\t'"),
        ("version: 1\nrules: [\n", 3, "invalid YAML: "),
        ("version: 1\nrules: 'unterminated\n", 3, "invalid YAML: "),
        ("version: 1\nrules: []\n---\nversion: 1\n", 3, "invalid YAML: "),
        ("version: 1\n  rules: []\n", 2, "invalid YAML: mapping values are not allowed here"),
    ],
)
def test_invalid_yaml_reports_its_line(text: str, line: int, fragment: str) -> None:
    found = problems(text)
    assert len(found) == 1, found
    assert found[0][0] == line
    assert found[0][1].startswith(fragment)


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n", "# one\n\n# two\n"])
def test_empty_file(text: str) -> None:
    assert_problems(text, [(1, "empty rule file")])


@pytest.mark.parametrize("text", ["- 1\n- 2\n", "hello\n", "42\n", "[version, rules]\n"])
def test_non_mapping_root(text: str) -> None:
    assert_problems(text, [(1, "the rule file must be a mapping")])


def test_non_string_mapping_key() -> None:
    assert_problems("version: 1\nrules: []\n1: x\n", [(3, "mapping keys must be strings, got 1")])


def test_several_independent_errors_are_all_reported() -> None:
    text = yaml_text(
        """
        version: 1
        bogus: true
        rules:
          - id: Bad_Id
            summary: First rule.
            match:
              - y = Relu(x)
            where:
              - rank(q) == 1
            replace:
              - y = Relu(x)
          - id: second
            summary: Second rule.
            match:
              - y = Relu(x)
            let:
              x: 1
            replace:
              - y = Relu(x
          - id: third
            summary: Third rule.
            match:
              - y = Relu(x)
            replace:
              - y = Relu(x)
            tests:
              - name: t
                model: m
                expect: {fires: -1}
          - id: fine
            summary: Nothing wrong here.
            match:
              - y = Relu(x)
            replace:
              - y = Relu(x)
        """
    )
    assert_problems(text, [
        (2, "unknown key 'bogus' in the rule file"),
        (4, "rule id 'Bad_Id' must be lowercase-kebab-case"),
        (9, "where: undefined name 'q'"),
        (17, "let name 'x' is already defined"),
        (19, "replace: missing closing ')'"),
        (29, "expect counts must be non-negative integers"),
    ])


# --------------------------------------------------------------- built-in library


BUILTIN = rulefile.load_builtin_rules()
BY_ID = {rule.id: rule for rule in BUILTIN}


def test_builtin_rules_load() -> None:
    assert len(BUILTIN) >= 10
    assert len(BY_ID) == len(BUILTIN)  # ids are unique
    for path in rulefile.builtin_rule_paths():
        assert path.is_dir()
    for rule in BUILTIN:
        assert rulefile.RULE_ID.fullmatch(rule.id)
        assert rule.file.endswith(".yaml") and rule.line >= 1
        assert rule.summary and rule.match and rule.replace and rule.outputs
        assert rule.match_variants and rule.match_variants[0] == rule.match


@pytest.mark.parametrize("rule", BUILTIN, ids=[r.id for r in BUILTIN])
def test_builtin_rule_tests_prove_both_sides(rule: rulefile.Rule) -> None:
    fires = [t.expect.fires for t in rule.tests]
    assert any(f is not None and f >= 1 for f in fires), f"{rule.id}: no firing test"
    assert any(f == 0 for f in fires), f"{rule.id}: no non-firing test"
    assert len({t.name for t in rule.tests}) == len(rule.tests)


def test_conv_bn_fold_shape() -> None:
    rule = BY_ID["conv-bn-fold"]
    assert rule.outputs == ("z",)
    assert set(rule.captures) == {"x", "W", "B", "scale", "bias", "mean", "var", "eps"}
    assert rule.captures[:3] == ("x", "W", "B")
    assert [spec.op for spec in rule.match] == [OpRef("", "Conv"),
                                                OpRef("", "BatchNormalization")]
    assert rule.match[0].inputs[2] == Ref("B", optional=True)
    assert [b.name for b in rule.let] == ["s", "W2", "B2"]
    assert len(rule.where) == 3 and all(c.message for c in rule.where)
    (replacement,) = rule.replace
    assert replacement.op == OpRef("", "Conv")
    assert replacement.copy_attrs_from == "y"
    assert replacement.inputs == (Ref("x"), Ref("W2"), Ref("B2"))


def test_gelu_erf_alternatives_expand_into_variants() -> None:
    rule = BY_ID["gelu-erf"]
    assert len(rule.match_variants) == 6
    assert rule.captures == ("x", "c", "r") and rule.outputs == ("z",)
    first_ops = [str(variant[0].op) for variant in rule.match_variants]
    assert sorted(first_ops) == ["Div"] * 3 + ["Mul"] * 3
    assert len({variant for variant in rule.match_variants}) == 6
    for variant in rule.match_variants:
        assert variant[-1].outputs == ("z",)
        assert "Erf" in [str(spec.op) for spec in variant]


# ----------------------------------------------------------------- files and folders


def test_load_rules_reports_duplicate_ids_across_files(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text(GOOD)
    (tmp_path / "b.yaml").write_text(GOOD)
    with pytest.raises(RuleFileError) as info:
        load_rules([tmp_path])
    (span, message), = info.value.problems
    assert span == SourceSpan(str(tmp_path / "b.yaml"), 3)
    assert message == f"rule id 'relu-relu' already defined at {tmp_path / 'a.yaml'}:3"


def test_load_rules_collects_problems_from_every_file(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text("version: 2\nrules: []\n")
    (tmp_path / "b.yaml").write_text(GOOD + "extra: 1\n")
    with pytest.raises(RuleFileError) as info:
        load_rules([tmp_path, tmp_path / "missing.yaml"])
    assert [(str(s) if s else None, m.split(";")[0]) for s, m in info.value.problems] == [
        (f"{tmp_path / 'a.yaml'}:1", "unsupported version 2"),
        (f"{tmp_path / 'b.yaml'}:10", "unknown key 'extra' in the rule file"),
        (None, f"{tmp_path / 'missing.yaml'}: rule file not found"),
    ]


def test_load_rules_in_order(tmp_path: Path) -> None:
    (tmp_path / "b.yaml").write_text(GOOD)
    (tmp_path / "a.yaml").write_text(GOOD.replace("relu-relu", "first-rule"))
    other = tmp_path.parent / f"{tmp_path.name}-other"
    other.mkdir()
    single = other / "single.yml"
    single.write_text(GOOD.replace("relu-relu", "from-file"))
    rules = load_rules([single, tmp_path])
    assert [r.id for r in rules] == ["from-file", "first-rule", "relu-relu"]
    assert rules[1].file == str(tmp_path / "a.yaml")


def test_rule_files_sorting(tmp_path: Path) -> None:
    for name in ["b.yaml", "a.yml", "10-x.yaml", "9-x.yaml", "notes.txt", "UPPER.YAML"]:
        (tmp_path / name).write_text(GOOD)
    (tmp_path / "folder.yaml").mkdir()
    assert [p.name for p in rule_files(tmp_path)] == ["10-x.yaml", "9-x.yaml", "a.yml", "b.yaml"]
    assert rule_files(tmp_path / "b.yaml") == [tmp_path / "b.yaml"]
    assert rule_files(str(tmp_path / "whatever.txt")) == [tmp_path / "whatever.txt"]


def test_empty_folder(tmp_path: Path) -> None:
    with pytest.raises(RuleFileError) as info:
        load_rules([tmp_path])
    assert info.value.problems == [(None, f"{tmp_path}: folder holds no .yaml rule files")]


def test_load_rule_file_missing(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(RuleFileError) as info:
        load_rule_file(missing)
    assert info.value.problems == [(None, f"{missing}: rule file not found")]
    assert str(info.value) == f"{missing}: rule file not found"


def test_load_rule_file_reports_its_path(tmp_path: Path) -> None:
    path = tmp_path / "r.yaml"
    path.write_text(GOOD + "extra: 1\n")
    with pytest.raises(RuleFileError) as info:
        load_rule_file(path)
    assert str(info.value).startswith(f"{path}:10: unknown key 'extra'")
    path.write_text(GOOD)
    assert [r.file for r in load_rule_file(str(path))] == [str(path)]


def test_load_rule_file_unreadable(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(RuleFileError) as info:
        load_rule_file(path)
    ((span, message),) = info.value.problems
    assert span is None and message.startswith(f"{path}: cannot read rule file")
    with pytest.raises(RuleFileError, match="cannot read rule file"):
        load_rule_file(tmp_path)  # a folder is not a file


def test_load_rule_file_too_large(tmp_path: Path) -> None:
    path = tmp_path / "huge.yaml"
    path.write_bytes(b"#" * (rulefile.MAX_FILE_BYTES + 1))
    with pytest.raises(RuleFileError) as info:
        load_rule_file(path)
    assert info.value.problems == [(SourceSpan(str(path), 1), "rule file larger than 4 MiB")]



# ------------------------------------------------------- groups, fused kernels, targets


def test_group_rule_errors_are_reported_at_their_lines() -> None:
    text = yaml_text(
        """
        version: 1
        rules:
          - id: bad-group
            summary: siblings
            group: {shared: W, min: 1, require_saving: maybe}
            match:
              - y = MatMul(x, W)
            merge:
              Wc: concat(W, 1)
            replace:
              - m = MatMul(x, Wc)
              - y = Split(m)
          - id: merge-without-group
            summary: merge needs a group
            match:
              - y = Relu(x)
            merge:
              a: x
            replace:
              - y... = Relu(x)
        """
    )
    assert_problems(text, [
        (5, "group: min must be an integer >= 2"),
        (5, "require_saving must be true or false"),
        (11, "replace: 'x' is not the shared value"),
        (11, "replace must produce 'y...'"),
        (18, "'merge' is only for group rules"),
        (20, "replace must produce the match output 'y'"),
    ])


def test_fuse_needs_a_custom_domain_and_excludes_replace() -> None:
    text = yaml_text(
        """
        version: 1
        rules:
          - id: fuse-standard
            summary: not a custom domain
            match:
              - z = Relu(x)
            fuse: com.microsoft.FusedRelu
          - id: fuse-and-replace
            summary: both
            match:
              - z = Relu(x)
            fuse: npu.Relu
            replace:
              - z = Relu(x)
        """
    )
    assert_problems(text, [
        (7, "must be in a custom domain"),
        (8, "exactly one of 'replace' and 'fuse'"),
    ])


def test_target_header_errors() -> None:
    text = yaml_text(
        """
        version: 1
        target:
          name: onnxruntime
          domain: ai.onnx
          opset: 0
          base: tensorrt
          kernels: [A, B]
        rules: []
        """
    )
    assert_problems(text, [
        (3, "target name 'onnxruntime' must be kebab-case and not one of"),
        (4, "must be a custom domain"),
        (5, "target opset must be a positive integer"),
        (6, "target base must be one of"),
        (7, "kernels must map a kernel op name"),
    ])


def test_test_fold_flag_must_be_boolean() -> None:
    model = '<ir_version: 8, opset_import: ["" : 17]> g (float[2] x) => (float[2] z) {}'
    text = GOOD + (
        "    tests:\n"
        "      - name: t\n"
        f"        model: '{model}'\n"
        "        fold: nope\n"
        "        expect: {fires: 0}\n"
    )
    assert_problems(text, [(13, "fold must be true or false")])


def test_test_model_declares_value_shapes_beside_initializers() -> None:
    """A data-less declaration of a value a node computes is value_info (what exporters
    write, symbolic dims by name); one of an initializer gets data; an initializer cannot
    have symbolic dims."""
    from fusectl.ruletest import TestModelError, build_test_model

    model = """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N,4] x) => (float[N,4] z)
        <float[4] w, float[N,4] y>
        { y = Add(x, w)  z = Relu(y) }
    """
    test = rulefile.RuleTest("t", model, rulefile.Expect())
    proto = build_test_model(test)
    assert [i.name for i in proto.graph.initializer] == ["w"]
    (info,) = proto.graph.value_info
    dims = info.type.tensor_type.shape.dim
    assert info.name == "y" and [dims[0].dim_param, dims[1].dim_value] == ["N", 4]
    symbolic = rulefile.RuleTest("t", model.replace("float[4] w", "float[M] w"),
                                 rulefile.Expect())
    with pytest.raises(TestModelError, match="symbolic dims"):
        build_test_model(symbolic)
    negative = rulefile.RuleTest("t", model.replace("float[4] w", "float[-1] w"),
                                 rulefile.Expect())
    with pytest.raises(TestModelError, match="negative"):
        build_test_model(negative)
