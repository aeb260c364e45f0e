"""Replacements that write a matched intermediate again (``z, _, _, s = Op(...)``), omitted
optional outputs, ordered sibling groups, and onnxruntime's default-domain contrib ops.

A skip-norm kernel can also write the residual sum; the pre-norm blocks of GPT-2 and
LLaMA read that sum again, so the fusion must rewire those readers to the kernel's
fourth output and leave the output empty when nobody reads it.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx.parser
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper
from values import const, dynamic

from fusectl.api import load_rule_set, optimize
from fusectl.compile import compile_rules
from fusectl.errors import RuleFileError
from fusectl.rewrite import apply_rules
from fusectl.rulefile import load_rule_text, load_rules
from fusectl.ruletest import check_model

ORT = "rules/70-onnxruntime.yaml"
SIBLINGS = "rules/25-siblings.yaml"


def _pre_norm_block(sum_read_outside: bool) -> onnx.ModelProto:
    """s = x + r; z = LayerNorm(s); the next residual t = s + z when ``sum_read_outside``."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Add", ["x", "r"], ["s"], name="residual"),
             helper.make_node("LayerNormalization", ["s", "gamma", "beta"], ["z"], name="ln")]
    outputs = [helper.make_tensor_value_info("z", TensorProto.FLOAT, [2, 5, 16])]
    if sum_read_outside:
        nodes.append(helper.make_node("Add", ["s", "z"], ["t"], name="next_residual"))
        outputs.append(helper.make_tensor_value_info("t", TensorProto.FLOAT, [2, 5, 16]))
    inits = [onnx.numpy_helper.from_array(rng.uniform(0.5, 1.5, 16).astype(np.float32), n)
             for n in ("gamma", "beta")]
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 5, 16]) for n in "xr"]
    graph = helper.make_graph(nodes, "block", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


# The built-in skip rules refuse a sum read again (onnxruntime's kernel is slower when it
# writes the sum out); the engine feature is tested with the same rule minus that guard.
SKIP_LAYERNORM_WITH_SUM = """
version: 1
rules:
  - id: skip-layernorm-with-sum
    summary: Add + LayerNormalization -> SkipLayerNormalization, writing the sum again
    when: {opset: ">=17", target: onnxruntime, imports: {com.microsoft: 1}}
    match:
      - s = Add(a, skip)
      - z = LayerNormalization<axis=-1, epsilon=eps>(s, gamma, beta)
    replace:
      - z, _, _, s = com.microsoft.SkipLayerNormalization<epsilon=eps>(a, skip, gamma, beta)
    tests: []
"""


def _fused(proto: onnx.ModelProto) -> tuple[ir.Model, ir.Node]:
    rules = compile_rules(load_rule_text(SKIP_LAYERNORM_WITH_SUM))
    result = optimize(ir.serde.deserialize_model(proto), target="onnxruntime", rules=rules)
    assert result.passed, result.validation
    kernels = [n for n in result.model.graph if n.op_type == "SkipLayerNormalization"]
    assert len(kernels) == 1
    return result.model, kernels[0]


def test_sum_read_outside_comes_from_the_kernel() -> None:
    model, kernel = _fused(_pre_norm_block(sum_read_outside=True))
    sum_out = kernel.outputs[3]
    assert sum_out.name  # written, and the next residual reads it
    assert [use.node.name for use in sum_out.uses()] == ["next_residual"]
    assert [n.op_type for n in model.graph].count("Add") == 1  # only the next residual


def test_sum_nobody_reads_is_an_omitted_output() -> None:
    _, kernel = _fused(_pre_norm_block(sum_read_outside=False))
    assert [v.name for v in kernel.outputs[1:]] == ["", "", ""]


def test_intermediate_read_by_an_unlisted_node_blocks_the_match() -> None:
    """Only the intermediates ``replace`` writes again may escape the match."""
    text = """
version: 1
rules:
  - id: neg-of-square
    summary: -((a + b)^2) becomes 0 - (a + b)^2, writing the sum and the square again
    match:
      - s = Add(a, b)
      - m = Mul(s, s)
      - z = Neg(m)
    let:
      zero: float32(0.0)
    replace:
      - s = Add(a, b)
      - m = Mul(s, s)
      - z = Sub(zero, m)
    tests: []
"""
    rule = load_rule_text(text)[0]
    assert rule.kept == ("s", "m")
    compiled = compile_rules([rule])
    for escaping, fires in (("s", 1), ("m", 1)):
        model = _escape_model(escaping)
        assert len(apply_rules(model, compiled).applications) == fires
    rule2 = load_rule_text(text.replace("      - s = Add(a, b)\n      - m = Mul(s, s)\n"
                                        "      - z = Sub(zero, m)\n    tests",
                                        "      - z = Sub(zero, Mul(Add(a, b), Add(a, b)))\n"
                                        "    tests"))
    assert rule2[0].kept == ()
    model = _escape_model("s")
    assert apply_rules(model, compile_rules(rule2)).applications == ()


def _escape_model(name: str) -> ir.Model:
    nodes = [helper.make_node("Add", ["a", "b"], ["s"]), helper.make_node("Mul", ["s", "s"], ["m"]),
             helper.make_node("Neg", ["m"], ["z"]), helper.make_node("Relu", [name], ["extra"])]
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [4]) for n in "ab"]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [4]) for n in ("z", "extra")]
    graph = helper.make_graph(nodes, "g", inputs, outputs)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    return ir.serde.deserialize_model(proto)


@pytest.mark.parametrize(("replace", "problem"), [
    ("      - m, _ = TopK(x, k)\n      - z = Neg(_)\n",
     "'_' names an omitted output and cannot be read"),
    ("      - z = @x(x)\n", "'@x' must name a value the match produces"),
], ids=["read-omitted-output", "same-op-of-an-input"])
def test_replace_statements_are_checked_at_load(replace: str, problem: str) -> None:
    text = ("version: 1\nrules:\n  - id: r\n    summary: s\n    match:\n      - z = Relu(x)\n"
            f"    replace:\n{replace}    tests: []\n")
    with pytest.raises(RuleFileError) as info:
        load_rule_text(text)
    assert any(problem in str(p) for p in info.value.problems)


# ----------------------------------------------------------------- ordered sibling groups


def _halves(first: tuple[int, int], second: tuple[int, int]) -> onnx.ModelProto:
    """Two Slices of x along the last axis, in this graph order, concatenated as -b, a."""
    inits = [onnx.numpy_helper.from_array(np.array([v], np.int64), n) for n, v in
             (("s0", first[0]), ("e0", first[1]), ("s1", second[0]), ("e1", second[1]),
              ("ax", -1))]
    nodes = [helper.make_node("Slice", ["x", "s0", "e0", "ax"], ["a"]),
             helper.make_node("Slice", ["x", "s1", "e1", "ax"], ["b"]),
             helper.make_node("Neg", ["b"], ["nb"]),
             helper.make_node("Concat", ["nb", "a"], ["z"], axis=-1)]
    graph = helper.make_graph(nodes, "rot", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [2, 8])], [helper.make_tensor_value_info(
            "z", TensorProto.FLOAT, [2, 8])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize(("first", "second"), [((0, 3), (3, 8)), ((3, 8), (0, 3)),
                                               ((5, 2**62), (-8, 5))])
def test_split_outputs_follow_the_axis_not_the_graph_order(first, second) -> None:
    rules = [r for r in compile_rules(load_rules([SIBLINGS])) if r.id == "slice-siblings-to-split"]
    result = optimize(ir.serde.deserialize_model(_halves(first, second)), rules=rules)
    assert result.passed, result.validation
    splits = [n for n in result.model.graph if n.op_type == "Split"]
    assert len(splits) == 1
    sizes = splits[0].inputs[1].const_value.numpy().tolist()
    low, high = sorted([first, second])
    assert sizes == [min(low[1], 8) - low[0] % 8, 8 - min(low[1], 8)]


# ------------------------------------------------- onnxruntime's default-domain contrib ops


def test_checker_sets_aside_onnxruntime_default_domain_ops_only() -> None:
    node = helper.make_node("SimplifiedLayerNormalization", ["x", "w"], ["y"], axis=-1)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [2, 4])], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, [2, 4])],
        [onnx.numpy_helper.from_array(np.ones(4, np.float32), "w")])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    check_model(proto)  # accepted, and the model itself is left as it was
    assert proto.graph.node[0].domain == ""
    node.op_type = "NotAnOnnxruntimeOp"
    proto.graph.node[0].op_type = "NotAnOnnxruntimeOp"
    with pytest.raises(onnx.checker.ValidationError):
        check_model(proto)


def test_rmsnorm_below_opset_23_reaches_one_onnxruntime_kernel() -> None:
    """x * 1/sqrt(mean(x^2) + eps) * w after a residual Add: the normalize, fold-scale and
    (opt-in) skip rules compose into one SkipSimplifiedLayerNormalization."""
    rng = np.random.default_rng(1)
    inits = [onnx.numpy_helper.from_array(np.array(v, np.float32), n) for n, v in
             (("two", 2.0), ("eps", 1e-6), ("one", 1.0))]
    inits.append(onnx.numpy_helper.from_array(rng.uniform(0.5, 1.5, 16).astype(np.float32), "w"))
    nodes = [helper.make_node("Add", ["x", "r"], ["s"]),
             helper.make_node("Pow", ["s", "two"], ["sq"]),
             helper.make_node("ReduceMean", ["sq"], ["ms"], axes=[-1]),
             helper.make_node("Add", ["ms", "eps"], ["v"]),
             helper.make_node("Sqrt", ["v"], ["std"]),
             helper.make_node("Div", ["one", "std"], ["inv"]),
             helper.make_node("Mul", ["s", "inv"], ["n"]),
             helper.make_node("Mul", ["n", "w"], ["z"]),
             helper.make_node("Add", ["z", "x"], ["t"])]
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 5, 16]) for n in "xrt"]
    graph = helper.make_graph(nodes, "llama", io[:2], io[2:], inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    every = load_rule_set(target="onnxruntime", opt_in=True)
    result = optimize(ir.serde.deserialize_model(proto), target="onnxruntime", rules=every)
    assert result.passed, result.validation
    assert sorted(n.op_type for n in result.model.graph) == ["Add",
                                                             "SkipSimplifiedLayerNormalization"]
    # By default the skip rule is opt-in (a slower CPU kernel): the Add stays before the norm.
    default = optimize(ir.serde.deserialize_model(proto), target="onnxruntime")
    assert default.passed, default.validation
    assert sorted(n.op_type for n in default.model.graph) == ["Add", "Add",
                                                              "SimplifiedLayerNormalization"]


def test_new_nodes_see_the_values_of_small_constant_inputs() -> None:
    """A Reshape to a new constant shape gets concrete dims, so the traffic model and the
    require_saving guard see real bytes, not unknowns."""
    from fusectl.shapes import infer_node

    x = dynamic("x", [2, 3, 4])
    target = const("t", np.array([-1, 4], np.int64))
    node = ir.Node("", "Reshape", [x, target])
    assert infer_node(node, {"": 17})
    assert list(node.outputs[0].shape) == [6, 4]


def test_tidy_merges_the_duplicates_rewrites_create() -> None:
    from fusectl.prepare import tidy

    shape_a = helper.make_tensor("sa", TensorProto.INT64, [2], [-1, 4])
    shape_b = helper.make_tensor("sb", TensorProto.INT64, [2], [-1, 4])
    nodes = [helper.make_node("Reshape", ["x", "sa"], ["a"]),
             helper.make_node("Reshape", ["x", "sb"], ["b"]),
             helper.make_node("Add", ["a", "b"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [2, 3, 4])], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, None)], [shape_a, shape_b])
    model = ir.serde.deserialize_model(helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8))
    tidy(model)  # the model's own equal constants are left alone
    assert [n.op_type for n in model.graph] == ["Reshape", "Reshape", "Add"]
    tidy(model, ["sa", "sb"])  # as if a rewrite had created them
    assert [n.op_type for n in model.graph] == ["Reshape", "Add"]
    assert list(model.graph.outputs[0].shape) == [6, 4]


# A rule that writes its intermediate again has no reader limit before matching, so the
# engine's own refusal of a capture bound to a matched value is what protects it.
RELU_ADD_KEPT = """
version: 1
rules:
  - id: relu-add-kept
    summary: Relu + Add written again as Relu + Add (keeps y), to reach the capture check
    match:
      - y = Relu(x)
      - z = Add(y, b)
    replace:
      - y = Relu(x)
      - z = Add(y, b)
    tests: []
"""


def test_a_capture_bound_to_a_matched_value_is_refused() -> None:
    """``z = Add(y, y)``: the capture ``b`` would be ``y``, which the match replaces."""
    model = onnx.parser.parse_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2,3] x) => (float[2,3] z)
        { y = Relu(x)  z = Add(y, y) }""")
    rules = compile_rules(load_rule_text(RELU_ADD_KEPT))
    assert rules[0].rule.kept  # the engine sees a rule that keeps an intermediate
    result = optimize(ir.from_proto(model), rules=rules)
    assert result.passed and not result.rewrite.applications
    reasons = [r.reason for r in result.rewrite.rejections if r.rule_id == "relu-add-kept"]
    assert reasons and "b is a value the match itself produces" in reasons[0]


def test_a_kept_intermediate_nobody_reads_is_gone_before_the_next_rule() -> None:
    """matmul-merged-batch-sink-transposed-b writes the folded key and its Transpose again
    for outside readers; here there are none. Left in the graph until the final cleanup, the
    dead Reshape was a second reader of K's head Transpose, and transpose-compose never
    merged it with the swap the rule adds (two Transposes stayed)."""
    proto = onnx.parser.parse_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2,4,5,6] q, float[2,7,4,6] k0) => (float[2,4,5,7] z)
        <int64[3] s1 = {8, 5, 6}, int64[3] s2 = {8, 7, 6}, int64[4] s3 = {2, 4, 5, 7}>
        {
          k = Transpose<perm=[0, 2, 1, 3]>(k0)
          a = Reshape(q, s1)  r = Reshape(k, s2)  b = Transpose<perm=[0, 2, 1]>(r)
          m = MatMul(a, b)  z = Reshape(m, s3)
        }""")
    result = optimize(ir.serde.deserialize_model(proto), rules=load_rule_set())
    assert result.passed, result.validation
    ops = [n.op_type for n in result.model.graph]
    assert sorted(ops) == ["MatMul", "Transpose"]
    (transpose,) = [n for n in result.model.graph if n.op_type == "Transpose"]
    assert list(transpose.attributes["perm"].value) == [0, 2, 3, 1]


def test_readers_of_a_rewrite_lose_the_dims_onnx_minted() -> None:
    """DeBERTa with dynamic axes splits the 3-D product back with a -1 target, so onnx
    names the batch ``unk__N`` downstream. Once matmul-merged-batch-unfold computes the
    product as [B,4,S,16], the readers get B again (the attention fusions compare it with
    the query's batch), not only in the final tidy."""
    from fusectl.prepare import prepare

    proto = onnx.parser.parse_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[B,4,S,S] p, float[B,4,S,16] v) => (float[B,S,64] w)
        <int64[2] h = {-1, 4}, int64[3] merged = {0, 0, 64}>
        {
          m1 = Constant<value_ints=[-1]>()
          tp = Shape<start=2>(p)  s1 = Concat<axis=0>(m1, tp)
          tv = Shape<start=2>(v)  s2 = Concat<axis=0>(m1, tv)
          a = Reshape(p, s1)  b = Reshape(v, s2)  m = MatMul(a, b)
          tm = Shape<start=1>(m)  s3 = Concat<axis=0>(h, tm)  z = Reshape(m, s3)
          t = Transpose<perm=[0, 2, 1, 3]>(z)  w = Reshape(t, merged)
        }""")
    model = ir.serde.deserialize_model(proto)
    prepare(model)
    (transpose,) = [n for n in model.graph if n.op_type == "Transpose"]
    (split,) = [n for n in model.graph if n.op_type == "Reshape" and n.outputs[0].name == "z"]
    # what onnx says when symdims cannot name the -1 (DeBERTa's second layer)
    split.outputs[0].shape = ir.Shape(["unk__7", 4, "S", 16])
    transpose.outputs[0].shape = ir.Shape(["unk__7", "S", 4, 16])
    rules = [r for r in load_rule_set() if r.id == "matmul-merged-batch-unfold"]
    assert len(apply_rules(model, rules).applications) == 1
    assert transpose.outputs[0].shape == ir.Shape(["B", "S", 4, 16])
