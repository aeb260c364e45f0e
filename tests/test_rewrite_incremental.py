"""The rewrite loop re-tries a rule only near what changed since its last run
(rewrite.apply_rules, CompiledRule.reach): the result must be the one a full re-try of
every node on every pass gives, with fewer match attempts."""

from __future__ import annotations

import glob
import os
from collections import Counter

import numpy as np
import onnx
import onnx.parser
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

import fusectl
from fusectl import compile as compile_module
from fusectl import traffic
from fusectl.compile import compile_rules
from fusectl.modelio import from_proto
from fusectl.prepare import prepare
from fusectl.rewrite import _Touched, apply_rules
from fusectl.rulefile import load_rule_text

RULES = {target: fusectl.load_rule_set(target=target) for target in ("onnx", "onnxruntime")}
SAMPLES = os.path.join(os.path.dirname(__file__), "..", "samples")
LIGHT = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light")


def _rewrite(proto: onnx.ModelProto, *, incremental: bool, target: str = "onnx",
             monkeypatch: pytest.MonkeyPatch | None = None) -> tuple[ir.Model, list, int]:
    """Prepare and rewrite ``proto``; the applications and how many match attempts."""
    model = from_proto(onnx.ModelProto.FromString(proto.SerializeToString()))
    prepare(model)
    attempts = Counter()
    if monkeypatch is not None:
        find = compile_module.CompiledRule.find

        def counting(self, *args):  # noqa: ANN001, ANN202 - a spy
            attempts["find"] += 1
            return find(self, *args)

        monkeypatch.setattr(compile_module.CompiledRule, "find", counting)
    result = apply_rules(model, RULES[target], target=target, incremental=incremental)
    if monkeypatch is not None:
        monkeypatch.undo()
    applications = [(a.pass_number, a.rule_id, a.matched, a.created) for a in result.applications]
    return model, applications, attempts["find"]


def _graph(model: ir.Model) -> list[tuple[str, tuple[str, ...]]]:
    return [(n.op_type, tuple(v.name if v is not None else "" for v in n.inputs))
            for n in model.graph]


def _reshape_cascade() -> onnx.ModelProto:
    """A Reshape that sinks one op per pass (reshape-sink-*), meets the last Reshape in the
    fourth pass and is gone in the fifth: each pass depends on the one before."""
    return onnx.parser.parse_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2,3,4] x) => (float[2,3,4] z)
        <int64[2] s1 = {6, 4}, int64[3] s0 = {2, 3, 4}, float c = {0.1}, float d = {0.5}>
        { y = Reshape(x, s1)  a = Add(y, c)  e = Erf(a)  m = Mul(e, d)  t = Tanh(m)
          z = Reshape(t, s0) }""")


def test_a_cascade_over_many_passes_ends_where_full_passes_end(
        monkeypatch: pytest.MonkeyPatch) -> None:
    model, applied, attempts = _rewrite(_reshape_cascade(), incremental=True,
                                        monkeypatch=monkeypatch)
    full_model, full_applied, full_attempts = _rewrite(_reshape_cascade(), incremental=False,
                                                       monkeypatch=monkeypatch)
    assert applied == full_applied
    assert max(p for p, *_ in applied) == 5  # five passes fired, one after the other
    # (the Identity keeping the output's name goes in prepare.tidy, after the loop)
    assert [n.op_type for n in model.graph] == ["Add", "Erf", "Mul", "Tanh", "Identity"]
    assert _graph(model) == _graph(full_model)
    # The later passes look only near the moving Reshape (measured: 85 against 346).
    assert attempts * 2 < full_attempts


def _siblings_after_a_transpose_pair() -> onnx.ModelProto:
    """Two 1x1 Convs read x, one through a Transpose pair that transpose-cancel removes in
    the first pass, after conv-sibling-merge (an earlier rule) has looked: the two become
    siblings only then, and the merge happens in the second pass."""
    rng = np.random.default_rng(0)
    weights = [numpy_helper.from_array(rng.normal(size=(4, 64, 1, 1)).astype(np.float32), w)
               for w in ("w1", "w2")]
    nodes = [helper.make_node("Conv", ["x", "w1"], ["a"], name="A"),
             helper.make_node("Transpose", ["x"], ["t"], perm=[0, 2, 3, 1]),
             helper.make_node("Transpose", ["t"], ["u"], perm=[0, 3, 1, 2]),
             helper.make_node("Conv", ["u", "w2"], ["b"], name="B")]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64, 16, 16])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 4, 16, 16]) for n in "ab"],
        weights)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def test_a_sibling_group_formed_by_a_later_change_is_found() -> None:
    """The application detaches the Transposes from x: what they read is taken before,
    else the readers of x (the future siblings) are never stamped as changed."""
    model, applied, _ = _rewrite(_siblings_after_a_transpose_pair(), incremental=True)
    _, full_applied, _ = _rewrite(_siblings_after_a_transpose_pair(), incremental=False)
    assert [(p, rule) for p, rule, *_ in applied] == [(1, "transpose-cancel"),
                                                     (2, "conv-sibling-merge")]
    assert applied == full_applied
    assert sorted(n.op_type for n in model.graph) == ["Conv", "Split"]


def _test_models() -> list[str]:
    samples = sorted(glob.glob(os.path.join(SAMPLES, "*.onnx")))
    light = [os.path.join(LIGHT, f"light_{name}.onnx")
             for name in ("inception_v2", "shufflenet", "squeezenet")]
    return samples + [p for p in light if os.path.exists(p)]


@pytest.mark.parametrize("target", ["onnx", "onnxruntime"])
@pytest.mark.parametrize("path", _test_models(), ids=os.path.basename)
def test_incremental_passes_give_the_full_result(path: str, target: str) -> None:
    proto = onnx.load(path)
    model, applied, _ = _rewrite(proto, incremental=True, target=target)
    full_model, full_applied, _ = _rewrite(proto, incremental=False, target=target)
    assert applied == full_applied
    assert _graph(model) == _graph(full_model)


def test_reach_is_the_pattern_size_unless_a_check_reads_further() -> None:
    rules = compile_rules(load_rule_text("""
version: 1
rules:
  - id: local
    summary: three nodes, checks on the match only
    match:
      - y = Relu(Mul(Add(x, b), c))
    where:
      - expr: is_const(b) and num_uses(x) == 1
        message: b constant
    replace:
      - y = Relu(x)
    tests: []
  - id: far
    summary: a check that looks three hops down
    match:
      - y = Relu(x)
    where:
      - expr: transpose_ahead(y)
        message: a Transpose follows
    replace:
      - y = Relu(x)
    tests: []
"""))
    assert [rule.reach for rule in rules] == [3, None]
    by_id = {rule.id: rule for rule in RULES["onnx"]}
    assert by_id["softmax-nan-guard"].reach is None  # is_finite_scores walks the mask
    assert by_id["conv-bn-fold"].reach == 2


def _chain(length: int) -> list[ir.Node]:
    """n0 -> n1 -> ... (Relu nodes, each reading the one before)."""
    value = ir.Value(name="x")
    nodes = []
    for i in range(length):
        node = ir.Node("", "Relu", [value], name=f"n{i}")
        value = node.outputs[0]
        nodes.append(node)
    return nodes


def test_near_looks_reach_hops_up_and_only_at_later_runs() -> None:
    nodes = _chain(5)
    touched = _Touched()
    touched.stamps[id(nodes[1])] = (nodes[1], 7)
    assert touched.near(nodes[1], 0, 7)
    assert touched.near(nodes[4], 3, 7)  # n4 -> n3 -> n2 -> n1
    assert not touched.near(nodes[4], 2, 7)  # n1 is three hops up
    assert not touched.near(nodes[4], 3, 8)  # stamped before the rule's last run
    assert not touched.near(nodes[0], 4, 7)  # n1 is below n0, not above


def test_a_widely_shared_constant_counts_as_changing_everything() -> None:
    shared = ir.Value(name="scale")
    readers = [ir.Node("", "Mul", [ir.Value(name=f"x{i}"), shared], name=f"m{i}")
               for i in range(_Touched.MAX_READERS + 1)]
    touched = _Touched()

    class Rewrite:  # what record() reads of a compile.Rewrite
        new_nodes: list[ir.Node] = []

    touched.record(Rewrite(), [shared], 3)  # type: ignore[arg-type]
    assert touched.everything == 3
    far = _chain(3)[-1]
    assert touched.near(far, 1, 3) and not touched.near(far, 1, 4)
    few = _Touched()
    few.record(Rewrite(), [readers[0].inputs[0]], 3)  # type: ignore[arg-type]
    assert few.everything == -1 and few.near(readers[0], 0, 3)


def _paddle_flatten() -> onnx.ModelProto:
    """Paddle2ONNX's flatten before a classifier: the Reshape target is computed from
    Shape, so the Reshape and the MatMul after it have no shape until a rule gives the
    Reshape a constant target."""
    return onnx.parser.parse_model("""
        <ir_version: 7, opset_import: ["" : 11]>
        g (float[N,200,1,1] x) => (float[N,2] y)
        <int64[1] b0 = {0}, int64[1] e1 = {1}, int64[1] c = {200}, float[200,2] w = {""" +
        ", ".join(f"{(i % 7) * 0.01:.2f}" for i in range(400)) + """}, float[2] b = {0.5, -0.5}>
        { s = Shape(x)  a = Cast<to=6>(s)  p = Slice(a, b0, e1, b0, e1)  q = Cast<to=7>(p)
          t = Concat<axis=0>(q, c)  r = Reshape(x, t)  m = MatMul(r, w)  y = Add(m, b) }
    """)


def test_readers_are_typed_after_an_application() -> None:
    """Once the Reshape gets its constant target, the MatMul reading it is typed at once, so
    matmul-add-to-gemm fires in the next pass (it needs the rank); the same in full passes."""
    proto = _paddle_flatten()
    incremental, applied, _ = _rewrite(proto, incremental=True)
    full, applied_full, _ = _rewrite(proto, incremental=False)
    assert applied == applied_full and _graph(incremental) == _graph(full)
    assert [n.op_type for n in incremental.graph] == ["Reshape", "Gemm"]
    result = fusectl.optimize(ir.serde.deserialize_model(proto))
    assert result.passed, result.validation


# ------------------------------------------------------------- the loop's byte counts


METERED = """
version: 1
rules:
  - id: neg-to-sub
    summary: -c is 0 - c
    match:
      - z = Neg(c)
    let:
      zero: float32(0.0)
    replace:
      - z = Sub(zero, c)
    tests: []
  - id: double-to-sum
    summary: a * 2 is a + a
    match:
      - z = Mul(a, two)
    where:
      - expr: is_const(two) and allclose(two, 2, 0, 0)
    replace:
      - z = Add(a, a)
    tests: []
  - id: negated-relu-to-min
    summary: 0 - relu(b) is min(0 - b, 0)
    match:
      - z = Sub(zero, Relu(b))
    where:
      - expr: is_const(zero) and not any(zero)
    replace:
      - z = Min(Sub(zero, b), zero)
    tests: []
"""


def test_bytes_of_a_value_typed_after_an_application_are_counted() -> None:
    """neg-to-sub costs the Neg while c is untyped (unknown: 0 bytes); double-to-sum then
    types the Relu writing c (a reader of its new Add); negated-relu-to-min must count c's
    write and read (4*8 floats each) in its bytes before, not what the meter had cached."""
    model = ir.from_proto(onnx.parser.parse_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4,8] x) => (float[4,8] z)
        <float two = {2.0}>
        { b = Mul(x, two)  c = Relu(b)  z = Neg(c) }"""))
    result = apply_rules(model, compile_rules(load_rule_text(METERED)))
    assert [(a.rule_id, a.bytes_before) for a in result.applications] == [
        ("neg-to-sub", 128),  # c unknown, z: 128 bytes
        ("double-to-sum", 128 + 4),  # x and the scalar 2; b untyped
        ("negated-relu-to-min", 128 * 4 + 4),  # Relu: b and c; Sub: c, z and the zero
    ]


def test_the_loop_reads_dim_expressions_as_the_report_does() -> None:
    """``seq-len`` is a name (1) in a model with no input dim ``len``, not seq - len = 7;
    ``seq+past`` is an expression of input dims (8 + 1): the bytes before of each
    application are those of the traffic report."""
    text = """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[seq] a, float[past] p, float["seq-len"] x, float["seq+past"] u)
        => (float["seq-len"] y, float["seq+past"] v) { y = Neg(x)  v = Neg(u) }"""
    dims = {"seq": 8}
    report = traffic.measure(ir.from_proto(onnx.parser.parse_model(text)), dims=dims)
    model = ir.from_proto(onnx.parser.parse_model(text))
    result = apply_rules(model, compile_rules(load_rule_text(METERED)), dims=dims)
    assert [a.bytes_before for a in result.applications] == [2 * 4 * 1, 2 * 4 * 9]
    assert [n.bytes_total for n in report.nodes] == [2 * 4 * 1, 2 * 4 * 9]
