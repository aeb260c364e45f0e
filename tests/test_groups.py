"""Sibling-group rules: one Split for any number of siblings, never a node twice,
linear matching, and chained groups that feed each other."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from fusectl.compile import CompiledRule, compile_rules
from fusectl.prepare import prepare
from fusectl.rewrite import apply_rules
from fusectl.rulefile import load_rule_text, load_rules
from fusectl.ruletest import op_histogram
from fusectl.validate import ValidationOptions, validate

SIBLINGS = "rules/25-siblings.yaml"


def _rules(*ids: str) -> list[CompiledRule]:
    rules = compile_rules(load_rules([SIBLINGS]))
    return [r for r in rules if r.id in ids]


def _matmul_fan(n: int, width: int = 64, seed: int = 0) -> onnx.ModelProto:
    """x -> n MatMuls (different output widths) -> n graph outputs."""
    rng = np.random.default_rng(seed)
    nodes, inits, outputs = [], [], []
    for i in range(n):
        cols = 1 + i % 5
        inits.append(onnx.numpy_helper.from_array(
            rng.standard_normal((width, cols)).astype(np.float32), f"W{i}"))
        nodes.append(helper.make_node("MatMul", ["x", f"W{i}"], [f"y{i}"], name=f"mm{i}"))
        outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, [3, cols]))
    graph = helper.make_graph(nodes, "fan", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [3, width])], outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _run(proto: onnx.ModelProto, rules: list[CompiledRule]) -> tuple[ir.Model, object]:
    model = ir.serde.deserialize_model(proto)
    prepare(model)
    return model, apply_rules(model, rules)


@pytest.mark.parametrize("n", [2, 3, 17, 64])
def test_any_number_of_siblings_becomes_one_split(n: int) -> None:
    proto = _matmul_fan(n)
    model, result = _run(proto, _rules("matmul-sibling-merge"))
    ops = op_histogram(model.graph)
    assert ops == {"MatMul": 1, "Split": 1}
    split = next(node for node in model.graph if node.op_type == "Split")
    assert len(split.outputs) == n
    assert [v.name for v in model.graph.outputs] == [f"y{i}" for i in range(n)]
    assert len(result.applications) == 1
    assert len(result.applications[0].matched) == n
    assert validate(ir.serde.deserialize_model(proto), model, ValidationOptions()).passed


def test_merge_reaches_a_fixed_point() -> None:
    model, _ = _run(_matmul_fan(5), _rules("matmul-sibling-merge"))
    again = apply_rules(model, _rules("matmul-sibling-merge"))
    assert again.applications == ()
    assert op_histogram(model.graph)["MatMul"] == 1


def test_matching_is_linear_in_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    """One match attempt per candidate node per pass, whatever the number of siblings."""
    calls = {"n": 0}
    original = CompiledRule._member

    def counting(self, model, graph, node):  # noqa: ANN001, ANN202
        calls["n"] += 1
        return original(self, model, graph, node)

    monkeypatch.setattr(CompiledRule, "_member", counting)
    for n in (10, 100):
        calls["n"] = 0
        _, result = _run(_matmul_fan(n), _rules("matmul-sibling-merge"))
        # pass 1 tries the n MatMuls; in pass 2 the merged one is x's only reader, so it
        # is not even tried (no group can form); nothing quadratic
        assert result.passes == 2
        assert calls["n"] == n


def test_groups_that_feed_each_other() -> None:
    """x -> (a, b, e) and a -> (c, d, f): both groups merge, the second reading the Split."""
    rng = np.random.default_rng(1)
    shapes = {"W1": (64, 16), "W2": (64, 16), "W5": (64, 16),
              "W3": (16, 4), "W4": (16, 4), "W6": (16, 4)}
    inits = [onnx.numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), n)
             for n, shape in shapes.items()]
    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["a"]),
        helper.make_node("MatMul", ["x", "W2"], ["b"]),
        helper.make_node("MatMul", ["x", "W5"], ["e"]),
        helper.make_node("MatMul", ["a", "W3"], ["c"]),
        helper.make_node("MatMul", ["a", "W4"], ["d"]),
        helper.make_node("MatMul", ["a", "W6"], ["f"]),
    ]
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 16]) for n in "be"]
    outs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 4]) for n in "cdf"]
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [2, 64])], outs, inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    model, result = _run(proto, _rules("matmul-sibling-merge"))
    assert op_histogram(model.graph) == {"MatMul": 2, "Split": 2}
    assert len(result.applications) == 2
    assert all(app.bytes_saved > 0 for app in result.applications)
    onnx.checker.check_model(ir.to_proto(model), full_check=True)
    assert validate(ir.serde.deserialize_model(proto), model, ValidationOptions()).passed


def test_merge_that_costs_traffic_is_refused_unless_allowed() -> None:
    """Q/K/V-like siblings as wide as their input: the Split copy costs more than the
    reads it saves, so the default rule refuses; ``require_saving: false`` merges."""
    proto = _matmul_fan(3, width=4)
    for i, (node, init) in enumerate(zip(proto.graph.node, proto.graph.initializer,
                                         strict=True)):
        init.CopyFrom(onnx.numpy_helper.from_array(  # distinct: equal weights would be merged
            np.full((4, 4), i + 1.0, dtype=np.float32), init.name))
        proto.graph.output[list(proto.graph.node).index(node)].type.tensor_type.shape.dim[
            1].dim_value = 4
    model, result = _run(proto, _rules("matmul-sibling-merge"))
    assert result.applications == ()
    assert any("more bytes" in r.reason for r in result.rejections)
    text = Path(SIBLINGS).read_text().replace(
        'key: ["shape(W)[0]", "dtype(W)"]\n    match:\n      - y = MatMul(x, W)',
        'key: ["shape(W)[0]", "dtype(W)"]\n      require_saving: false\n    match:\n'
        '      - y = MatMul(x, W)')
    assert "require_saving: false" in text
    allowed = [r for r in compile_rules(load_rule_text(text, "siblings.yaml"))
               if r.id == "matmul-sibling-merge"]
    model, result = _run(proto, allowed)
    assert len(result.applications) == 1 and result.applications[0].bytes_saved < 0


def test_a_node_is_never_in_two_members() -> None:
    """MatMul(x, x) consumes the shared value twice: it is one member, not two."""
    rng = np.random.default_rng(2)
    w = onnx.numpy_helper.from_array(rng.standard_normal((4, 4)).astype(np.float32), "W")
    nodes = [helper.make_node("MatMul", ["x", "W"], ["a"]),
             helper.make_node("MatMul", ["x", "x"], ["b"])]
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [4, 4]) for n in "ab"]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [4, 4])], outs, [w])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    model, result = _run(proto, _rules("matmul-sibling-merge"))
    assert result.applications == ()
    assert op_histogram(model.graph) == {"MatMul": 2}


def test_a_lone_reader_is_not_matched(monkeypatch: pytest.MonkeyPatch) -> None:
    """A MatMul alone on its input can never join a group: it is skipped before matching,
    while two MatMuls on one input still merge."""
    tried: list[str] = []
    original = CompiledRule._member

    def recording(self, model, graph, node):  # noqa: ANN001, ANN202
        tried.append(node.name)
        return original(self, model, graph, node)

    monkeypatch.setattr(CompiledRule, "_member", recording)
    rng = np.random.default_rng(0)
    weights = [numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), f"w{i}")
               for i, shape in enumerate([(64, 64), (64, 2), (64, 3)])]
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w0"], ["a"], name="alone"),
         helper.make_node("MatMul", ["a", "w1"], ["b"], name="left"),
         helper.make_node("MatMul", ["a", "w2"], ["c"], name="right")],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 64])],
        [helper.make_tensor_value_info("b", TensorProto.FLOAT, [3, 2]),
         helper.make_tensor_value_info("c", TensorProto.FLOAT, [3, 3])],
        weights)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model, result = _run(proto, _rules("matmul-sibling-merge"))
    assert "alone" not in tried
    assert {"left", "right"} <= set(tried)
    assert [a.matched for a in result.applications] == [("left", "right")]
