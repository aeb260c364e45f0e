"""Tests for fusectl.statements: node statements of match/replace -> flat NodeSpecs."""

from __future__ import annotations

import math

import pytest

from fusectl.statements import (
    AttrSpec,
    Literal,
    NodeSpec,
    OpRef,
    Ref,
    StatementError,
    alias_of,
    consumed_names,
    parse_statements,
    produced_names,
    split_alternatives,
)


def match(*texts: str) -> list[NodeSpec]:
    return parse_statements(list(texts), replace=False)


def replace(*texts: str) -> list[NodeSpec]:
    return parse_statements(list(texts), replace=True)


def one(text: str, *, replace_: bool = False) -> NodeSpec:
    specs = parse_statements([text], replace=replace_)
    assert len(specs) == 1, specs
    return specs[0]


# --------------------------------------------------------------------------- forms


def test_simple_statement() -> None:
    spec = one("y = Relu(x)")
    assert spec == NodeSpec(("y",), (OpRef("", "Relu"),), (Ref("x"),), (), None, 0)
    assert spec.op == OpRef("", "Relu")
    assert str(spec.op) == "Relu"


def test_whitespace_is_free() -> None:
    assert one("y=Relu(x)") == one("  y  =  Relu ( x )  ")


def test_several_outputs() -> None:
    spec = one(" a , b = Split<axis=1>(x) ")
    assert spec.outputs == ("a", "b")
    assert spec.attrs == (AttrSpec("axis", "1", literal=1),)


def test_optional_input_in_match() -> None:
    spec = one("y = Conv(x, W, B?)")
    assert spec.inputs == (Ref("x"), Ref("W"), Ref("B", optional=True))
    assert one("y = Conv(x, W, B ?)").inputs[2] == Ref("B", optional=True)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("com.microsoft.FusedConv", OpRef("com.microsoft", "FusedConv")),
        ("ai.onnx.ml.TreeEnsemble", OpRef("ai.onnx.ml", "TreeEnsemble")),
        ("ai.onnx.Relu", OpRef("", "Relu")),
        ("onnx.Relu", OpRef("", "Relu")),
        ("custom.Op", OpRef("custom", "Op")),
        ("Relu", OpRef("", "Relu")),
    ],
)
def test_domain_qualified_ops(name: str, expected: OpRef) -> None:
    spec = one(f"y = {name}(x)")
    assert spec.op == expected
    assert str(spec.op) == (f"{expected.domain}.{expected.op_type}" if expected.domain
                            else expected.op_type)


@pytest.mark.parametrize(
    ("text", "literal"),
    [
        ("3", 3),
        ("-2", -2),
        ("+7", 7),
        ("1.5", 1.5),
        ("-1.5e-3", -0.0015),
        (".5", 0.5),
        ("1e3", 1000.0),
        ("inf", math.inf),
        ("-inf", -math.inf),
        ('"Relu"', "Relu"),
        ("'NOTSET'", "NOTSET"),
        ("'a,b'", "a,b"),
        ("[1, 2, 3]", [1, 2, 3]),
        ("[1.0, 2]", [1.0, 2]),
        ("[-1]", [-1]),
        ("['a', 'b']", ["a", "b"]),
        ("[]", []),
    ],
)
def test_attribute_literals(text: str, literal: object) -> None:
    (attr,) = one(f"y = Foo<a={text}>(x)").attrs
    assert attr.name == "a"
    assert attr.text == text
    assert attr.literal == literal
    assert type(attr.literal) is type(literal)
    assert not attr.is_capture


def test_nan_attribute_literal() -> None:
    (attr,) = one("y = Foo<a=nan>(x)").attrs
    assert isinstance(attr.literal, float) and math.isnan(attr.literal)


def test_attribute_captures_and_literals_together() -> None:
    spec = one("z = BatchNormalization<epsilon=eps, training_mode=0>(y, s, b, m, v)")
    assert spec.attrs == (
        AttrSpec("epsilon", "eps", is_capture=True),
        AttrSpec("training_mode", "0", literal=0),
    )
    assert spec.inputs == tuple(Ref(n) for n in "ysbmv")


def test_attribute_separators_are_lenient() -> None:
    assert one("y = Foo<a=1,>(x)").attrs == one("y = Foo<, a=1>(x)").attrs
    assert one("y = Foo<>(x)").attrs == ()
    assert one("y = Foo <a=1> (x)").attrs == (AttrSpec("a", "1", literal=1),)


def test_copy_attributes_only_in_replace() -> None:
    spec = one("z = Conv<**y, group=g * 2>(x, W2, B2)", replace_=True)
    assert spec.copy_attrs_from == "y"
    assert spec.attrs == (AttrSpec("group", "g * 2"),)  # replace attrs are expression text
    assert spec.inputs == (Ref("x"), Ref("W2"), Ref("B2"))
    with pytest.raises(StatementError, match=r"'\*\*y' \(copy attributes\) is only for replace"):
        match("z = Conv<**y>(x, W, B)")


def test_replace_attribute_expressions_keep_commas_and_quotes() -> None:
    spec = one("y = Foo<a=compose_perm(p, [1, 0]), b='x>y', c=r < 2>(x)", replace_=True)
    assert spec.attrs == (
        AttrSpec("a", "compose_perm(p, [1, 0])"),
        AttrSpec("b", "'x>y'"),
        AttrSpec("c", "r < 2"),
    )


def test_optional_input_only_in_match() -> None:
    with pytest.raises(StatementError, match=r"'\?' \(optional input\) is only for match"):
        replace("y = Conv(x, W, B?)")


def test_nested_calls_are_flattened_in_order() -> None:
    specs = match("y = Add(Relu(Neg(x)), Sigmoid(b))")
    # temporaries are numbered as calls are met (pre-order); each producer comes
    # before its user
    assert [(s.outputs, str(s.op), s.inputs) for s in specs] == [
        (("%2",), "Neg", (Ref("x"),)),
        (("%1",), "Relu", (Ref("%2"),)),
        (("%3",), "Sigmoid", (Ref("b"),)),
        (("y",), "Add", (Ref("%1"), Ref("%3"))),
    ]
    assert [s.index for s in specs] == [0, 1, 2, 3]


def test_temporaries_number_across_statements() -> None:
    specs = match("t = Relu(Neg(x))", "z = Mul(Exp(t), Neg(t))")
    assert [s.outputs for s in specs] == [("%1",), ("t",), ("%2",), ("%3",), ("z",)]
    assert specs[-1].inputs == (Ref("%2"), Ref("%3"))


def test_nested_calls_with_attributes_and_domains() -> None:
    specs = replace("y = com.microsoft.Foo<a=1>(Transpose<perm=compose_perm(p, q)>(x), w)")
    assert specs[0].op == OpRef("", "Transpose")
    assert specs[0].attrs == (AttrSpec("perm", "compose_perm(p, q)"),)
    assert specs[1].op == OpRef("com.microsoft", "Foo")
    assert specs[1].inputs == (Ref("%1"), Ref("w"))


@pytest.mark.parametrize(
    "text", ["y = Relu | Sigmoid (x)", "y = Relu|Sigmoid(x)", "y = (Relu | Sigmoid)(x)"]
)
def test_op_alternatives(text: str) -> None:
    spec = one(text)
    assert spec.ops == (OpRef("", "Relu"), OpRef("", "Sigmoid"))
    assert spec.op == OpRef("", "Relu")
    assert spec.inputs == (Ref("x"),)


def test_op_alternatives_with_domains_and_attributes() -> None:
    spec = one("y = LeakyRelu | com.microsoft.QuickGelu <alpha=a>(x)")
    assert spec.ops == (OpRef("", "LeakyRelu"), OpRef("com.microsoft", "QuickGelu"))
    assert spec.attrs == (AttrSpec("alpha", "a", is_capture=True),)


def test_op_alternatives_only_in_match() -> None:
    with pytest.raises(StatementError, match=r"alternatives \('\|'\) are only allowed in match"):
        replace("y = Relu | Sigmoid (x)")


def test_skipped_inputs() -> None:
    assert one("y = Clip(x, , hi)").inputs == (Ref("x"), None, Ref("hi"))
    assert one("y = Clip(x,,)").inputs == (Ref("x"), None, None)
    assert one("y = Clip(x, , hi)", replace_=True).inputs == (Ref("x"), None, Ref("hi"))


def test_no_inputs() -> None:
    assert one("y = RandomNormal<shape=[2]>()").inputs == ()


def test_numeric_literal_inputs_in_match() -> None:
    specs = match("h = Add(Erf(t), 1.0)")
    assert specs[-1].inputs == (Ref("%1"), Literal(1.0))
    assert one("y = Pow(d, 2)").inputs[1] == Literal(2)
    assert isinstance(one("y = Pow(d, 2)").inputs[1].value, int)
    assert one("y = Add(x, -1e-5)").inputs[1] == Literal(-1e-5)
    assert one("y = Add(x, +1.5e3)").inputs[1] == Literal(1500.0)


@pytest.mark.parametrize("text", ["y = Add(x, 1.0)", "y = Relu(Add(x, 2))"])
def test_numeric_literal_inputs_not_in_replace(text: str) -> None:
    with pytest.raises(StatementError, match="replace inputs must be names"):
        replace(text)


def test_string_literal_inputs_rejected() -> None:
    with pytest.raises(StatementError, match="input literal must be a number"):
        match("y = Add(x, 'a')")


def test_produced_and_consumed_names() -> None:
    specs = match("a, b = Split(x)", "c = Add(Relu(a), b)", "d = Mul(a, a)")
    assert produced_names(specs) == ["a", "b", "%1", "c", "d"]
    assert consumed_names(specs) == ["x", "a", "%1", "b"]
    assert produced_names([]) == [] and consumed_names([]) == []


def test_empty_list() -> None:
    assert parse_statements([], replace=False) == []


# -------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("y Relu(x)", "needs the form 'outputs = Op(inputs)'"),
        ("Relu(x)", "needs the form"),
        ("Foo<a=1>(x)", "needs the form"),
        ("", "needs the form"),
        ("= Relu(x)", "bad output name ''"),
        ("1y = Relu(x)", "bad output name '1y'"),
        ("a, = Split(x)", "bad output name ''"),
        ("y.z = Relu(x)", "bad output name 'y.z'"),
        ("y = ", "expected an operator name"),
        ("y = 3(x)", "expected an operator name"),
        ("y = .Relu(x)", "expected an operator name"),
        ("y = Relu(x", "missing closing ')'"),
        ("y = Add(Relu(x, b)", "missing closing ')'"),
        ("y = Relu x", "expected '(' after Relu"),
        ("y = Relu", "expected '(' after Relu"),
        ("y = Relu | (x)", "expected '(' after Relu"),
        ("y = Foo<a=1>>(x)", "attribute a"),
        ("y = Relu(x))", "unexpected text after the call: ')'"),
        ("y = Relu(x) z", "unexpected text after the call: 'z'"),
        ("y = Mul(x, 0.5) junk", "unexpected text after the call: 'junk'"),
        ("y = Relu(x) | Sigmoid(x)", "unexpected text after the call"),
        ("y = Relu(Sigmoid(x)?)", "unexpected text after the call: '?'"),
        ("y = Foo<a=1(x)", "missing closing '>'"),
        ("y = Foo<a=[1,2>(x)", "missing closing '>'"),
        ("y = Foo<a>(x)", "bad attribute 'a'; expected name=value"),
        ("y = Foo<a=>(x)", "bad attribute 'a='"),
        ("y = Foo<1=2>(x)", "bad attribute '1=2'"),
        ("y = Foo<=2>(x)", "bad attribute '=2'"),
        ("y = Foo<a=f(x)>(x)", "attribute a: expected a literal or a capture name"),
        ("y = Foo<a=b c>(x)", "attribute a: expected a literal or a capture name"),
        ("y = Foo<a=[1,[2]]>(x)", "attribute a: expected a literal or a capture name"),
        ("y = Add(x, 'a')", "input literal must be a number"),
    ],
)
def test_errors_name_the_statement(text: str, fragment: str) -> None:
    with pytest.raises(StatementError) as info:
        match("ok = Relu(v)", text)
    message = str(info.value)
    assert fragment in message
    assert message.startswith(f"statement 2 ({text.strip()!r}): ")


def test_error_in_replace_names_the_statement() -> None:
    with pytest.raises(StatementError) as info:
        replace("a = Relu(x)", "b = Relu(a)", "c = Bad<x>(b)")
    assert str(info.value) == (
        "statement 3 ('c = Bad<x>(b)'): bad attribute 'x'; expected name=value"
    )


def test_non_string_statement() -> None:
    with pytest.raises(StatementError, match="statement 2 must be a string"):
        parse_statements(["y = Relu(x)", 5], replace=False)  # type: ignore[list-item]


def test_error_in_nested_call_names_the_outer_statement() -> None:
    with pytest.raises(StatementError, match=r"statement 1 \('y = Add\(Relu<a>\(x\), b\)'\)"):
        match("y = Add(Relu<a>(x), b)")


@pytest.mark.parametrize("text", ["y = (Relu(x)", "y = Relu)(x)", "y = (Relu | Sigmoid(x)"])
def test_unbalanced_parentheses_around_the_op(text: str) -> None:
    with pytest.raises(StatementError):
        match(text)


@pytest.mark.parametrize("expression", ["1 if r > 2 else 0", "r >= 2"])
def test_replace_attribute_expression_with_greater_than(expression: str) -> None:
    spec = one(f"z = Foo<a={expression}>(x)", replace_=True)
    assert spec.attrs == (AttrSpec("a", expression),)


def test_copy_attributes_needs_a_name() -> None:
    with pytest.raises(StatementError):
        replace("z = Conv<**>(x, W2, B2)")


@pytest.mark.parametrize("text", ["y = Relu.(x)", "y = a..b(x)"])
def test_malformed_op_names(text: str) -> None:
    with pytest.raises(StatementError):
        match(text)


# ------------------------------------------------------------------- alternatives


def test_split_call_alternatives() -> None:
    text = "z = Mul(Mul(x, 0.5), h) | Mul(Mul(x, h), 0.5) | Mul(x, Mul(h, 0.5))"
    assert split_alternatives(text) == [
        "z = Mul(Mul(x, 0.5), h)",
        "z = Mul(Mul(x, h), 0.5)",
        "z = Mul(x, Mul(h, 0.5))",
    ]


def test_split_two_alternatives_with_attributes() -> None:
    assert split_alternatives("t = Div(x, 1.4142135) | Mul<a=[1,2]>(x, 0.7)") == [
        "t = Div(x, 1.4142135)",
        "t = Mul<a=[1,2]>(x, 0.7)",
    ]


@pytest.mark.parametrize(
    "text",
    [
        "y = Relu | Sigmoid (x)",  # op alternatives: left to the parser
        "y = LeakyRelu | Relu <alpha=a>(x)",
        "y = x | Relu(x)",  # a bare name may not come first (names come from the first)
        "y = Relu(x) | Sigmoid + 1",  # neither a call nor a name
        "y = Relu(x)",
        "y = Foo<a=[1|2]>(x)",  # '|' nested in brackets
        "no assignment | here(x)",
    ],
)
def test_split_leaves_other_texts_alone(text: str) -> None:
    assert split_alternatives(text) == [text]


def test_split_bare_name_alternative_makes_the_node_optional() -> None:
    assert split_alternatives("s = Mul(qk, c) | Div(qk, d) | qk") == [
        "s = Mul(qk, c)",
        "s = Div(qk, d)",
        "s = qk",
    ]
    assert alias_of("s = qk") == ("s", "qk")
    assert alias_of("s = Mul(qk, c)") is None
    assert alias_of("a, b = c") is None


def test_split_ignores_bars_nested_in_calls() -> None:
    assert split_alternatives("y = Add(Relu | Sigmoid (x), b) | Sub(x, b)") == [
        "y = Add(Relu | Sigmoid (x), b)",
        "y = Sub(x, b)",
    ]


def test_split_alternatives_each_parse() -> None:
    text = "z = Mul(Mul(x, 0.5), h) | Mul(x, Mul(h, 0.5))"
    parsed = [match(option) for option in split_alternatives(text)]
    assert [[str(s.op) for s in specs] for specs in parsed] == [["Mul", "Mul"], ["Mul", "Mul"]]
    assert [specs[-1].outputs for specs in parsed] == [("z",), ("z",)]
    assert parsed[0][-1].inputs == (Ref("%1"), Ref("h"))
    assert parsed[1][-1].inputs == (Ref("x"), Ref("%1"))


def test_same_op_as_a_matched_value_in_replace() -> None:
    """``u = @z(x)`` re-emits the op that produced z, with its attributes (``**z``)."""
    spec = replace("u = @z(x, c)")[0]
    assert spec.same_op_as == "z"
    assert spec.copy_attrs_from == "z"
    assert spec.inputs == (Ref("x"), Ref("c"))
    spec = replace("u = @z<alpha=a>(x)")[0]
    assert (spec.same_op_as, spec.attrs[0].name) == ("z", "alpha")
    assert replace("u = Relu(x)")[0].same_op_as is None


@pytest.mark.parametrize(("text", "message"), [
    ("u = @z(x)", "only for replace"),
])
def test_same_op_is_not_a_match_pattern(text: str, message: str) -> None:
    with pytest.raises(StatementError, match=message):
        match(text)
