"""Tests for the memory-traffic / FLOPs model.

Every expected number is worked out by hand in the comments next to it, from the
contract in ``fusectl/traffic.py``: a kernel reads each distinct input once and writes
each output once, float32 = 4 bytes, a multiply-add = 2 FLOPs.
"""

from __future__ import annotations

import os
from pathlib import Path

import onnx
import onnx.helper
import onnx.parser
import onnx_ir as ir
import pytest
from onnx_ir.passes.common import ShapeInferencePass

from fusectl import traffic
from fusectl.errors import BadInputError
from fusectl.traffic import NodeTraffic, TrafficReport, constant_values, measure, node_traffic

HEADER = '<ir_version: 10, opset_import: ["" : 18]>'


def zeros(n: int) -> str:
    """Initializer data of the right length (values are irrelevant: we never read data)."""
    return ", ".join(["0"] * n)


def load(text: str, *, infer: bool = True) -> ir.Model:
    model = ir.serde.deserialize_model(onnx.parser.parse_model(text))
    if infer:
        model = ShapeInferencePass()(model).model
    return model


def only(report: TrafficReport, op_type: str) -> NodeTraffic:
    matches = [n for n in report.nodes if n.op_type == op_type]
    assert len(matches) == 1, matches
    return matches[0]


# --------------------------------------------------------------------------- heavy ops


def test_conv_bytes_flops_and_params() -> None:
    model = load(
        f"""{HEADER}
        g (float[1,3,8,8] x) => (float[1,4,6,6] y)
        <float[4,3,3,3] W = {{{zeros(108)}}}>
        {{ y = Conv(x, W) }}"""
    )
    conv = only(measure(model), "Conv")
    # x: 1*3*8*8 = 192 elements, W: 4*3*3*3 = 108 elements, float32
    assert conv.bytes_read == (192 + 108) * 4
    # y: 1*4*6*6 = 144 elements
    assert conv.bytes_written == 144 * 4
    # N*Cout*spatial_out * (Cin/group)*prod(kernel) * 2 = 1*4*36 * 3*9 * 2
    assert conv.flops == 1 * 4 * 36 * 3 * 9 * 2 == 7776
    assert conv.macs == 3888
    assert conv.param_bytes == 108 * 4
    assert conv.is_kernel and conv.known and conv.flops_counted
    assert conv.bytes_total == 1200 + 576


def test_conv_with_bias_padding_stride_and_group() -> None:
    model = load(
        f"""{HEADER}
        g (float[2,4,8,8] x) => (float[2,6,4,4] y)
        <float[6,2,3,3] W = {{{zeros(108)}}}, float[6] B = {{{zeros(6)}}}>
        {{ y = Conv<group: int = 2, pads: ints = [1, 1, 1, 1], strides: ints = [2, 2]>(x, W, B) }}
        """
    )
    conv = only(measure(model), "Conv")
    # out spatial: floor((8 + 2 - 3) / 2) + 1 = 4 -> y [2,6,4,4] = 192 elements
    assert conv.bytes_written == 192 * 4
    # x 2*4*64 = 512, W 6*2*9 = 108, B 6 elements
    assert conv.bytes_read == (512 + 108 + 6) * 4
    # MACs = N*Cout*16 * (Cin/group = 2) * 9 = 2*6*16*2*9 = 3456; + 192 bias adds
    assert conv.macs == 3456
    assert conv.flops == 2 * 3456 + 192
    assert conv.param_bytes == (108 + 6) * 4


def test_conv_transpose_flops() -> None:
    model = load(
        f"""{HEADER}
        g (float[1,2,3,3] x) => (float[1,4,5,5] y)
        <float[2,4,3,3] W = {{{zeros(72)}}}>
        {{ y = ConvTranspose(x, W) }}"""
    )
    node = only(measure(model), "ConvTranspose")
    # N*Cin*spatial_in * (Cout/group)*prod(kernel) * 2 = 1*2*9 * 4*9 * 2
    assert node.flops == 1 * 2 * 9 * 4 * 9 * 2 == 1296
    # out: (3 - 1) * 1 + 3 = 5 -> [1,4,5,5] = 100 elements
    assert node.bytes_written == 100 * 4
    assert node.bytes_read == (18 + 72) * 4


def test_gemm_with_transposed_weight_and_bias() -> None:
    model = load(
        f"""{HEADER}
        g (float[2,3] a) => (float[2,4] y)
        <float[4,3] B = {{{zeros(12)}}}, float[4] C = {{{zeros(4)}}}>
        {{ y = Gemm<transB: int = 1, alpha: float = 0.5>(a, B, C) }}"""
    )
    gemm = only(measure(model), "Gemm")
    # M=2, K=3, N=4 (B is [N,K] with transB): 2*M*N*K + M*N = 48 + 8
    assert gemm.flops == 2 * 2 * 4 * 3 + 2 * 4 == 56
    assert gemm.macs == 24
    # a 6, B 12, C 4 elements read; y 8 written
    assert gemm.bytes_read == (6 + 12 + 4) * 4
    assert gemm.bytes_written == 8 * 4
    assert gemm.param_bytes == (12 + 4) * 4


def test_matmul_broadcasts_batch_dims() -> None:
    model = load(
        f"""{HEADER}
        g (float[2,1,4,8] a, float[3,8,5] b) => (float[2,3,4,5] y)
        {{ y = MatMul(a, b) }}"""
    )
    mm = only(measure(model), "MatMul")
    # batch: broadcast([2,1], [3]) = [2,3] -> 6; M=4, K=8, N=5: 2*6*4*5*8
    assert mm.flops == 2 * 6 * 4 * 5 * 8 == 1920
    assert mm.macs == 960
    # a 2*1*4*8 = 64, b 3*8*5 = 120; y 2*3*4*5 = 120
    assert mm.bytes_read == (64 + 120) * 4
    assert mm.bytes_written == 120 * 4
    assert mm.param_bytes == 0


def test_matmul_with_vector_operand() -> None:
    model = load(
        f"""{HEADER}
        g (float[3,4,8] a, float[8] v) => (float[3,4] y)
        {{ y = MatMul(a, v) }}"""
    )
    mm = only(measure(model), "MatMul")
    # v is [K] -> N=1; batch 3, M=4, K=8: 2*3*4*1*8
    assert mm.flops == 192


# ------------------------------------------------------------------ elementwise chains

LAYERNORM_CHAIN = f"""{HEADER}
g (float[2,4] x) => (float[2,4] y)
<int64[1] axes = {{-1}}, float eps = {{0}}, float[4] gamma = {{{zeros(4)}}},
 float[4] beta = {{{zeros(4)}}}>
{{
  mean = ReduceMean(x, axes)
  d = Sub(x, mean)
  sq = Mul(d, d)
  var = ReduceMean(sq, axes)
  ve = Add(var, eps)
  std = Sqrt(ve)
  n = Div(d, std)
  gn = Mul(n, gamma)
  y = Add(gn, beta)
}}
"""


def test_decomposed_layernorm_chain() -> None:
    report = measure(load(LAYERNORM_CHAIN))
    # [2,4] float = 32 bytes; [2,1] float = 8 bytes; axes int64[1] = 8; eps = 4; gamma/beta 16
    expected = [
        # (op, read, written, flops)
        ("ReduceMean", 32 + 8, 8, 8),  # 1 FLOP per input element
        ("Sub", 32 + 8, 32, 8),
        ("Mul", 32, 32, 8),  # Mul(d, d) reads d once
        ("ReduceMean", 32 + 8, 8, 8),
        ("Add", 8 + 4, 8, 2),
        ("Sqrt", 8, 8, 2),
        ("Div", 32 + 8, 32, 8),
        ("Mul", 32 + 16, 32, 8),
        ("Add", 32 + 16, 32, 8),
    ]
    got = [(n.op_type, n.bytes_read, n.bytes_written, n.flops) for n in report.nodes]
    assert got == expected
    # 308 read + 192 written
    assert report.total_bytes == 308 + 192 == 500
    assert report.flops == 60
    assert report.kernel_count == report.node_count == 9
    # axes is read by both ReduceMeans but is one tensor: 8 + 4 + 16 + 16
    assert report.param_bytes == 44
    assert sum(n.param_bytes for n in report.nodes) == 52
    assert report.unknown_nodes == 0


def test_fused_layernorm_is_much_cheaper_than_the_chain() -> None:
    model = load(
        f"""{HEADER}
        g (float[2,4] x) => (float[2,4] y)
        <float[4] gamma = {{{zeros(4)}}}, float[4] beta = {{{zeros(4)}}}>
        {{ y = LayerNormalization(x, gamma, beta) }}"""
    )
    ln = only(measure(model), "LayerNormalization")
    # x 32 + gamma 16 + beta 16 read, y 32 written (vs 500 bytes for the chain above)
    assert ln.bytes_total == 32 + 16 + 16 + 32 == 96
    assert ln.flops == 8 * 8  # ~8 FLOPs per element
    assert ln.param_bytes == 32


def test_same_tensor_read_twice_counts_once() -> None:
    report = measure(load(f"{HEADER} g (float[3,5] x) => (float[3,5] y) {{ y = Mul(x, x) }}"))
    mul = only(report, "Mul")
    # x is 15 floats = 60 bytes, read once; y 60 bytes
    assert (mul.bytes_read, mul.bytes_written, mul.flops) == (60, 60, 15)


def test_normalization_softmax_gelu_and_pool_flops() -> None:
    model = load(
        f"""{HEADER.replace("18", "20")}
        g (float[1,2,6,6] x, float[2] s, float[2] b, float[2] m, float[2] v) => (float[1,2] z)
        {{
          bn = BatchNormalization(x, s, b, m, v)
          sm = Softmax(bn)
          ge = Gelu(sm)
          mp = MaxPool<kernel_shape: ints = [2, 2], strides: ints = [2, 2]>(ge)
          gp = GlobalAveragePool(mp)
          z = Flatten(gp)
        }}"""
    )
    report = measure(model)
    # x has 1*2*6*6 = 72 elements
    assert only(report, "BatchNormalization").flops == 2 * 72
    assert only(report, "Softmax").flops == 5 * 72
    # Gelu (erf form) like 0.5*x*(1 + erf(x/sqrt(2))): Div, Erf, Add, Mul, Mul per element
    assert only(report, "Gelu").flops == 5 * 72
    # MaxPool out [1,2,3,3] = 18 elements, each over a 2x2 window
    assert only(report, "MaxPool").flops == 18 * 4
    # global pool: 1 per input element (18)
    assert only(report, "GlobalAveragePool").flops == 18
    assert only(report, "Flatten").bytes_total == 0
    assert report.not_counted == ()


def test_sub_byte_dtype_rounds_up_over_whole_tensor() -> None:
    model = load(f"{HEADER} g (int4[3,5] q) => (float[3,5] y) {{ y = Cast<to: int = 1>(q) }}")
    cast = only(measure(model), "Cast")
    # 15 elements * 4 bits = 60 bits -> 8 bytes (not 15 * 1 byte)
    assert cast.bytes_read == 8
    assert cast.bytes_written == 60
    assert cast.flops == 0 and cast.flops_counted  # pure data movement


# ---------------------------------------------------------------------------- views


def test_view_ops_move_no_bytes_but_are_kernels() -> None:
    model = load(
        f"""{HEADER}
        g (float[2,3,4] x) => (float[6,4] y)
        <int64[2] shp = {{6, 4}}>
        {{
          r = Reshape(x, shp)
          i = Identity(r)
          y = Relu(i)
        }}"""
    )
    report = measure(model)
    for op in ("Reshape", "Identity"):
        view = only(report, op)
        assert (view.bytes_read, view.bytes_written, view.flops) == (0, 0, 0)
        assert view.is_kernel and view.known
    # Relu: 24 floats in, 24 out
    assert only(report, "Relu").bytes_total == 2 * 24 * 4
    assert report.kernel_count == 3
    assert report.total_bytes == 192


def test_shape_and_size_read_only_metadata() -> None:
    model = load(
        f"""{HEADER}
        g (float[2,3,4] x) => (int64[3] s, int64 n)
        {{
          s = Shape(x)
          n = Size(x)
        }}"""
    )
    report = measure(model)
    # Shape writes int64[3] = 24 bytes, Size writes an int64 scalar = 8 bytes; nothing read
    assert (only(report, "Shape").bytes_read, only(report, "Shape").bytes_written) == (0, 24)
    assert (only(report, "Size").bytes_read, only(report, "Size").bytes_written) == (0, 8)


# ----------------------------------------------------------------------- constness


def test_all_constant_subgraph_is_folded() -> None:
    model = load(
        f"""{HEADER}
        g (float[4] x) => (float[4] y)
        <float[4] w = {{{zeros(4)}}}>
        {{
          c = Constant<value = float[4] {{1, 2, 3, 4}}>()
          s = Add(c, w)
          t = Neg(s)
          y = Mul(x, t)
        }}"""
    )
    report = measure(model)
    for op in ("Constant", "Add", "Neg"):
        node = only(report, op)
        assert not node.is_kernel
        assert (node.bytes_total, node.flops, node.param_bytes) == (0, 0, 0)
    mul = only(report, "Mul")
    # x (16 bytes) + folded t (16 bytes, a weight now) read, 16 written
    assert (mul.bytes_read, mul.bytes_written, mul.param_bytes) == (32, 16, 16)
    assert report.kernel_count == 1
    assert report.node_count == 4
    assert report.param_bytes == 16  # w itself is only read at load time
    names = {v.name for v in constant_values(model.graph)}
    assert names == {"w", "c", "s", "t"}


def test_random_ops_are_never_folded() -> None:
    model = load(
        f"""{HEADER}
        g (float[4] x) => (float[4] y)
        <float[4] w = {{{zeros(4)}}}>
        {{
          n = RandomNormalLike(w)
          y = Add(x, n)
        }}"""
    )
    noise = only(measure(model), "RandomNormalLike")
    # fresh values every run: a kernel reading w (16 bytes) and writing n (16 bytes)
    assert noise.is_kernel
    assert (noise.bytes_read, noise.bytes_written) == (16, 16)
    assert model.graph.node(0).outputs[0] not in constant_values(model.graph)


def test_constant_propagation_does_not_need_topological_order() -> None:
    w = ir.Value(
        name="w",
        type=ir.TensorType(ir.DataType.FLOAT),
        shape=ir.Shape([4]),
        const_value=ir.tensor([1.0, 2.0, 3.0, 4.0], name="w"),
    )
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([4]))
    neg = ir.Node("", "Neg", [w], num_outputs=1)
    relu = ir.Node("", "Relu", [neg.outputs[0]], num_outputs=1)
    add = ir.Node("", "Add", [x, relu.outputs[0]], num_outputs=1)
    # Stored consumer-first: a single forward scan would miss that Relu folds.
    graph = ir.Graph(
        [x], [add.outputs[0]], nodes=[add, relu, neg], initializers=[w], opset_imports={"": 18}
    )
    constants = constant_values(graph)
    assert neg.outputs[0] in constants and relu.outputs[0] in constants
    assert add.outputs[0] not in constants


def test_initializer_that_is_also_graph_input_is_not_constant() -> None:
    model = load(
        f"""{HEADER}
        g (float[4] x, float[4] w) => (float[4] y)
        <float[4] w = {{{zeros(4)}}}>
        {{
          r = Relu(w)
          y = Add(x, r)
        }}"""
    )
    w = model.graph.initializers["w"]
    assert w.is_graph_input()  # the model really declares it both ways
    assert w not in constant_values(model.graph)
    report = measure(model)
    relu = only(report, "Relu")
    # w can be overridden at run time, so Relu(w) is a real kernel: 16 in, 16 out
    assert relu.is_kernel
    assert (relu.bytes_read, relu.bytes_written, relu.param_bytes) == (16, 16, 0)
    assert report.kernel_count == 2
    assert report.param_bytes == 0


def test_before_ir_version_4_initializer_inputs_are_constants() -> None:
    """IR < 4 had to list every initializer as an input; runtimes treat them as weights."""
    model = load(
        f"""<ir_version: 3, opset_import: ["" : 9]>
        g (float[4] x, float[4] w) => (float[4] y)
        <float[4] w = {{{zeros(4)}}}>
        {{
          r = Relu(w)
          y = Add(x, r)
        }}"""
    )
    assert model.graph.initializers["w"].is_graph_input()
    report = measure(model)
    # Relu(w) is folded; Add reads x and the folded r (16 bytes each), writes 16
    assert not only(report, "Relu").is_kernel
    add = only(report, "Add")
    assert (add.bytes_read, add.bytes_written, add.param_bytes) == (32, 16, 16)
    assert report.kernel_count == 1


def test_constant_node_output_counts_as_weight_of_its_consumer() -> None:
    model = load(
        f"""{HEADER}
        g (float[2,3] x) => (float[2,3] y)
        {{
          c = Constant<value_floats: floats = [1.0, 2.0, 3.0]>()
          y = Mul(x, c)
        }}"""
    )
    mul = only(measure(model), "Mul")
    # x 24 bytes + c 12 bytes read; c is a parameter
    assert (mul.bytes_read, mul.param_bytes) == (36, 12)


def test_node_traffic_default_constness_without_a_constants_set() -> None:
    model = load(
        f"""{HEADER}
        g (float[4] x, float[4] v) => (float[4] y, float[4] z, float[4] r)
        <float[4] w = {{{zeros(4)}}}, float[4] v = {{{zeros(4)}}}>
        {{
          y = Add(x, w)
          z = Add(x, v)
          r = Relu(v)
        }}"""
    )
    add_w, add_v, relu_v = model.graph
    # w is a true initializer: a 16-byte parameter of Add(x, w)
    assert node_traffic(add_w).param_bytes == 16
    # v is also a graph input, so it may be fed at run time: not a parameter, not foldable
    assert node_traffic(add_v).param_bytes == 0
    relu = node_traffic(relu_v)
    assert relu.is_kernel and relu.bytes_total == 32
    # an explicit constants set overrides the default
    assert not node_traffic(add_w, constants=set()).param_bytes


def test_omitted_optional_outputs_are_not_written() -> None:
    node = onnx.helper.make_node("LayerNormalization", ["x", "s"], ["y", "", "istd"], axis=-1)
    graph = onnx.helper.make_graph(
        [node],
        "g",
        [
            onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 4]),
            onnx.helper.make_tensor_value_info("s", onnx.TensorProto.FLOAT, [4]),
        ],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 4])],
    )
    proto = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 18)])
    model = ShapeInferencePass()(ir.serde.deserialize_model(proto)).model
    ln = only(measure(model), "LayerNormalization")
    # writes y (8 floats = 32 bytes) and istd ([2,1] = 8 bytes); the "" Mean output is skipped
    assert (ln.bytes_read, ln.bytes_written, ln.known) == (32 + 16, 32 + 8, True)


# ------------------------------------------------------------------ shapes and dims


def test_symbolic_dim_is_bound_through_dims_and_defaults_to_one() -> None:
    model = load(f"{HEADER} g (float[N,16] x) => (float[N,16] y) {{ y = Relu(x) }}")
    # N = 8: 8*16 floats = 512 bytes each way
    relu8 = only(measure(model, dims={"N": 8}), "Relu")
    assert (relu8.bytes_read, relu8.bytes_written, relu8.flops) == (512, 512, 128)
    # unbound N counts as 1: 16 floats = 64 bytes
    relu1 = only(measure(model), "Relu")
    assert (relu1.bytes_read, relu1.bytes_written, relu1.flops) == (64, 64, 16)
    assert relu1.known


def test_unknown_dim_flags_node_and_counts_known_tensors_only() -> None:
    model = load(
        f"""{HEADER}
        g (float[?,4] a, float[2,4] b) => (float[2,4] y)
        {{
          y = Add(a, b)
          z = Relu(a)
        }}""",
        infer=False,
    )
    report = measure(model)
    add = only(report, "Add")
    # only b (8 floats) and y (8 floats) have known sizes
    assert (add.bytes_read, add.bytes_written, add.known) == (32, 32, False)
    relu = only(report, "Relu")
    assert (relu.bytes_total, relu.known) == (0, False)
    assert report.unknown_nodes == 2


def test_dim_expressions_are_evaluated_with_bindings() -> None:
    dim = ir.SymbolicDim("N*2")
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([dim, 4]))
    node = ir.Node("", "Relu", [x], num_outputs=1)
    node.outputs[0].type = ir.TensorType(ir.DataType.FLOAT)
    node.outputs[0].shape = ir.Shape([dim, 4])
    # N=3 -> [6,4] = 24 floats = 96 bytes; unbound N=1 -> [2,4] = 32 bytes
    assert node_traffic(node, dims={"N": 3}).bytes_read == 96
    assert node_traffic(node).bytes_read == 32


def test_a_hyphenated_dim_name_is_a_name_not_a_difference() -> None:
    """``seq-len`` read as seq - len would cost nothing; it is an expression only in a model
    whose inputs have dims called ``seq`` and ``len`` (as validation reads it)."""
    hyphen = load('''<ir_version: 8, opset_import: ["" : 17]>
        g (float[b, "seq-len"] x) => (float[b, "seq-len"] y) { y = Relu(x) }''', infer=False)
    assert measure(hyphen).nodes[0].bytes_read == 4
    assert measure(hyphen, dims={"seq-len": 5}).nodes[0].bytes_read == 20
    expression = load('''<ir_version: 8, opset_import: ["" : 17]>
        g (float[seq, len] a, float[b, "seq+len"] x) => (float[b, "seq+len"] y) { y = Relu(x) }''')
    assert measure(expression, dims={"seq": 3, "len": 4}).nodes[0].bytes_read == 28
    assert measure(expression).nodes[0].bytes_read == 8  # unbound: 1 + 1
    numbers = load('''<ir_version: 8, opset_import: ["" : 17]>
        g (float[s0] a, float["s0 - 1"] x, float["2*3"] u, float["unk__4*2"] m)
        => (float["s0 - 1"] y, float["2*3"] v, float["unk__4*2"] n)
        { y = Relu(x)  v = Relu(u)  n = Relu(m) }''', infer=False)
    relu, six, minted = measure(numbers).nodes
    assert relu.bytes_read == 4  # s0 unbound: 1 - 1 would be empty, it counts as a name
    assert measure(numbers, dims={"s0": 5}).nodes[0].bytes_read == 16
    assert six.bytes_read == 24 and not minted.known


def test_an_expression_of_a_minted_input_dim_is_unknown_unless_bound() -> None:
    """A model saved after onnx's inference may name an input dim ``unk__4``: a dim of the
    inputs, so ``unk__4*2`` is an expression of them, but of a size nobody knows (not the 1
    an unbound name counts as) until it is bound."""
    model = load('''<ir_version: 8, opset_import: ["" : 17]>
        g (float[unk__4] a, float["unk__4*2"] m) => (float["unk__4*2"] n) { n = Relu(m) }''',
        infer=False)
    assert not measure(model).nodes[0].known
    bound = measure(model, dims={"unk__4": 3}).nodes[0]
    assert bound.known and bound.bytes_read == 4 * 6


def test_shape_inference_placeholder_dims_are_unknown_unless_bound() -> None:
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(["unk__0", 4]))
    node = ir.Node("", "Relu", [x], num_outputs=1)
    node.outputs[0].type = ir.TensorType(ir.DataType.FLOAT)
    node.outputs[0].shape = ir.Shape([2, 4])
    assert not node_traffic(node).known
    bound = node_traffic(node, dims={"unk__0": 2})
    assert bound.known and bound.bytes_read == 32


def test_missing_shape_is_unknown() -> None:
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT))  # shape None
    node = ir.Node("", "Exp", [x], num_outputs=1)
    result = node_traffic(node)
    assert not result.known
    assert result.bytes_total == 0


def test_bad_dims_are_rejected() -> None:
    model = load(f"{HEADER} g (float[N] x) => (float[N] y) {{ y = Relu(x) }}")
    with pytest.raises(BadInputError):
        measure(model, dims={"N": -1})


def test_a_dim_computed_from_other_dims_is_not_bound() -> None:
    """A binding of ``s0 + s1`` could contradict s0's and s1's, and ``seq-len`` is seq - len
    once seq and len are bound; ``seq-len`` alone and ``a+b`` of no known dims are names."""
    model = load('''<ir_version: 8, opset_import: ["" : 17]>
        g (float[s0] a, float[s1] b, float["s0 + s1"] m, float["seq-len"] h)
        => (float["s0 + s1"] y) { y = Relu(m) }''', infer=False)
    for dims, problem in (({"s0 + s1": 5}, "computed from s0 and s1"),
                          ({"2*3": 6}, "a number"),
                          ({"seq": 4, "len": 1, "seq-len": 3}, "computed from len and seq")):
        with pytest.raises(BadInputError, match=problem):
            measure(model, dims=dims)
    assert measure(model, dims={"seq-len": 3, "a+b": 2, "s0": 2}).nodes[0].bytes_read == 4 * 3


def test_a_dotted_dim_name_binds() -> None:
    """onnx-ir reads ``batch.size`` as one symbol, the name itself: binding it is no
    computation from other dims (old exporters name dims ``input.1_dim_0``)."""
    model = load('''<ir_version: 8, opset_import: ["" : 17]>
        g (float["batch.size",3] x) => (float["batch.size",3] y) { y = Relu(x) }''', infer=False)
    assert measure(model, dims={"batch.size": 2}).nodes[0].bytes_read == 4 * 2 * 3


# --------------------------------------------------------------------- fused kernels

FUNCTION_MODEL = f"""
<ir_version: 10, opset_import: ["" : 18, "local": 1]>
g (float[2,3] a, float[4] c) => (float[2,4] y)
<float[3,4] w = {{{zeros(12)}}}>
{{
  y = local.MatAdd(a, w, c)
}}
<domain: "local", opset_import: ["" : 18]>
MatAdd (p, q, r) => (out)
{{
  m = MatMul(p, q)
  out = Add(m, r)
}}
"""


def test_function_call_counts_only_external_inputs_and_outputs() -> None:
    model = load(FUNCTION_MODEL)
    fused = only(measure(model), "MatAdd")
    # external: a 6 + w 12 + c 4 floats read, y 8 floats written; m never hits memory
    assert fused.bytes_read == (6 + 12 + 4) * 4
    assert fused.bytes_written == 8 * 4
    # body: MatMul 2*M*N*K = 2*2*4*3 = 48, Add 1 per output element = 8
    assert fused.flops == 48 + 8
    assert fused.macs == 24
    assert fused.param_bytes == 12 * 4
    assert fused.is_kernel and fused.known and fused.domain == "local"


def test_unfused_equivalent_moves_more_bytes() -> None:
    unfused = measure(
        load(
            f"""{HEADER}
            g (float[2,3] a, float[4] c) => (float[2,4] y)
            <float[3,4] w = {{{zeros(12)}}}>
            {{
              m = MatMul(a, w)
              y = Add(m, c)
            }}"""
        )
    )
    fused = measure(load(FUNCTION_MODEL))
    # the intermediate m (8 floats) is written once and read once more when unfused
    assert unfused.total_bytes - fused.total_bytes == 2 * 8 * 4
    assert unfused.flops == fused.flops == 56


def test_nested_function_with_attribute_reference() -> None:
    model = load(
        """<ir_version: 10, opset_import: ["" : 18, "local": 1]>
        g (float[2,3] a, float[4,3] w) => (float[2,4] y)
        { y = local.Outer<tb: int = 1>(a, w) }
        <domain: "local", opset_import: ["" : 18, "local": 1]>
        Outer <tb> (p, q) => (out)
        {
          m = Gemm<transB: int = @tb>(p, q)
          out = local.Inner(m)
        }
        <domain: "local", opset_import: ["" : 18]>
        Inner (z) => (o)
        {
          e = Exp(z)
          o = Softmax(e)
        }"""
    )
    outer = only(measure(model), "Outer")
    # transB resolved from the call site: M=2, N=4, K=3 -> Gemm 2*2*4*3 = 48;
    # Inner on [2,4]: Exp 8 + Softmax 5*8 = 40
    assert outer.flops == 48 + 8 + 40
    assert outer.macs == 24
    # a 6 + w 12 floats read, y 8 floats written
    assert (outer.bytes_read, outer.bytes_written) == (72, 32)


def test_custom_domain_node_without_function_is_an_elementwise_fused_kernel() -> None:
    model = load(
        """<ir_version: 10, opset_import: ["" : 18, "acme": 1]>
        g (float[2,8] x, float[8] b) => (float[2,8] y)
        { y = acme.BiasSwish(x, b) }""",
        infer=False,
    )
    node = model.graph.node(0)
    node.outputs[0].shape = ir.Shape([2, 8])
    node.outputs[0].type = ir.TensorType(ir.DataType.FLOAT)
    result = only(measure(model), "BiasSwish")
    # reads x 64 + b 32 bytes, writes 64; FLOPs estimated as 1 per output element
    assert (result.bytes_read, result.bytes_written, result.flops) == (96, 64, 16)
    assert result.flops_counted


def test_node_traffic_on_detached_and_new_nodes() -> None:
    model = load(
        f"""{HEADER}
        g (float[1,3,8,8] x) => (float[1,4,6,6] y)
        <float[4,3,3,3] W = {{{zeros(108)}}}>
        {{
          c = Conv(x, W)
          y = Relu(c)
        }}"""
    )
    graph = model.graph
    conv = graph.node(0)
    in_graph = measure(model).nodes[0]
    # A brand-new replacement node over the same values, never added to a graph.
    replacement = ir.Node("", "Conv", list(conv.inputs), num_outputs=1, name="fused")
    replacement.outputs[0].type = ir.TensorType(ir.DataType.FLOAT)
    replacement.outputs[0].shape = ir.Shape([1, 4, 6, 6])
    fresh = node_traffic(replacement)
    assert fresh.name == "fused"
    assert (fresh.bytes_read, fresh.bytes_written, fresh.flops, fresh.param_bytes) == (
        1200,
        576,
        7776,
        432,
    )
    # The matched node, detached from the graph just before replacement.
    relu = graph.node(1)
    relu.replace_input_with(0, replacement.outputs[0])
    graph.remove(conv)  # safe=False keeps its input references
    assert conv.graph is None
    detached = node_traffic(conv, index=0)
    assert detached == in_graph


# ---------------------------------------------------------------- counted / not counted


def test_unmodelled_and_control_flow_ops_are_not_counted() -> None:
    model = load(
        f"""{HEADER}
        g (float[2,3] a, float[3,4] b, bool cond) => (float[2,4] y, float[2,4] z)
        {{
          y = Einsum<equation: string = "ij,jk->ik">(a, b)
          z = If(cond) <
            then_branch = t () => (float[2,4] r) {{ r = Identity(y) }},
            else_branch = e () => (float[2,4] r) {{ r = Neg(y) }}
          >
        }}"""
    )
    report = measure(model)
    einsum = only(report, "Einsum")
    assert (einsum.flops, einsum.flops_counted) == (0, False)
    assert einsum.bytes_total == (6 + 12 + 8) * 4
    branch = only(report, "If")
    # own inputs/outputs only: cond (1 byte) read, z (32 bytes) written; bodies ignored
    assert (branch.bytes_read, branch.bytes_written, branch.flops) == (1, 32, 0)
    assert report.not_counted == ("Einsum", "If")
    assert report.node_count == 2  # subgraph nodes are not listed


def test_gelu_forms_cost_like_their_decompositions() -> None:
    model = _contrib(
        """<ir_version: 10, opset_import: ["" : 20, "com.microsoft": 1]>
        g (float[2,8] x, float[8] b) => (float[2,8] t, float[2,8] f, float[2,8] bg,
                                         float[2,8] q)
        {
          t = Gelu<approximate: string = "tanh">(x)
          f = com.microsoft.FastGelu(x, b)
          bg = com.microsoft.BiasGelu(x, b)
          q = com.microsoft.QuickGelu(x)
        }""",
        {"t": [2, 8], "f": [2, 8], "bg": [2, 8], "q": [2, 8]},
    )
    report = measure(model)
    # 16 elements; tanh form 0.5*x*(1 + tanh(c*(x + 0.044715*x^3))): Pow, Mul, Add, Mul,
    # Tanh, Add, Mul, Mul = 8 per element
    assert only(report, "Gelu").flops == 8 * 16
    assert only(report, "FastGelu").flops == (8 + 1) * 16  # + the bias add
    assert only(report, "BiasGelu").flops == (5 + 1) * 16
    # x * sigmoid(alpha * x): Mul, Sigmoid, Mul
    assert only(report, "QuickGelu").flops == 3 * 16


# ------------------------------------------------------------------------ attention

ATTENTION_HEADER = '<ir_version: 10, opset_import: ["" : 23]>'


def test_attention_4d_costs_like_its_decomposition() -> None:
    fused = only(
        measure(load(
            f"""{ATTENTION_HEADER}
            g (float[2,3,4,8] q, float[2,3,5,8] k, float[2,3,5,6] v) => (float[2,3,4,6] y)
            {{ y = Attention(q, k, v) }}"""
        )),
        "Attention",
    )
    # scores S = B*H*Sq*Skv = 2*3*4*5 = 120; MACs = S*(D + Dv) = 120*(8 + 6) = 1680
    assert fused.macs == 1680
    # 2*MACs + scale (1) and softmax (5) per score = 3360 + 6*120
    assert fused.flops == 3360 + 720 == 4080
    # q 192 + k 240 + v 180 floats read, y 144 written
    assert (fused.bytes_read, fused.bytes_written) == ((192 + 240 + 180) * 4, 144 * 4)

    unfused = measure(load(
        f"""{ATTENTION_HEADER}
        g (float[2,3,4,8] q, float[2,3,5,8] k, float[2,3,5,6] v) => (float[2,3,4,6] y)
        <float c = {{2.0}}>
        {{
          kt = Transpose<perm: ints = [0, 1, 3, 2]>(k)
          s = MatMul(q, kt)
          d = Div(s, c)
          p = Softmax(d)
          y = MatMul(p, v)
        }}"""
    ))
    # MatMul 2*6*4*5*8 = 1920, Div 120, Softmax 5*120 = 600, MatMul 2*6*4*6*5 = 1440
    assert unfused.flops == 1920 + 120 + 600 + 1440 == fused.flops
    assert unfused.macs == fused.macs


def test_attention_3d_with_mask_and_past_key() -> None:
    model = load(
        f"""{ATTENTION_HEADER}
        g (float[1,4,16] q, float[1,6,16] k, float[1,6,12] v, float[1,2,4,9] m,
           float[1,2,3,8] pk, float[1,2,3,6] pv) => (float[1,4,12] y)
        {{ y = Attention<q_num_heads: int = 2, kv_num_heads: int = 2>(q, k, v, m, pk, pv) }}""",
        infer=False,
    )
    node = only(measure(model), "Attention")
    # heads 2, D = 16/2 = 8, Dv = 12/2 = 6; kv length 6 + past 3 = 9
    # S = 1*2*4*9 = 72; MACs = 72*(8 + 6) = 1008; FLOPs = 2016 + (6 + 1 mask)*72
    assert node.macs == 1008
    assert node.flops == 2016 + 7 * 72 == 2520


def test_attention_3d_without_head_counts_is_unknown() -> None:
    model = load(
        f"""{ATTENTION_HEADER}
        g (float[1,4,16] q, float[1,6,16] k, float[1,6,16] v) => (float[1,4,16] y)
        {{ y = Attention(q, k, v) }}""",
        infer=False,
    )
    node = only(measure(model), "Attention")
    assert node.flops == 0 and not node.known


def _contrib(text: str, shapes: dict[str, list[int]]) -> ir.Model:
    """A com.microsoft model; onnx's shape inference does not know these ops."""
    model = load(text, infer=False)
    for node in model.graph:
        for out in node.outputs:
            if out.name in shapes:
                out.shape = ir.Shape(shapes[out.name])
                out.type = ir.TensorType(ir.DataType.FLOAT)
    return model


def test_multihead_attention_and_fused_matmul_gemm() -> None:
    model = _contrib(
        """<ir_version: 10, opset_import: ["" : 18, "com.microsoft": 1]>
        g (float[1,4,16] q, float[1,6,16] k, float[1,6,16] v, float[1,2,4,6] m,
           float[8,4] a, float[8,5] b, float[2,3] x, float[3,4] w)
          => (float[1,4,16] y, float[4,5] z, float[2,4] r)
        {
          y = com.microsoft.MultiHeadAttention<num_heads: int = 2>(q, k, v, , , m)
          z = com.microsoft.FusedMatMul<transA: int = 1, alpha: float = 0.5>(a, b)
          r = com.microsoft.FusedGemm<activation: string = "Relu">(x, w)
        }""",
        {"y": [1, 4, 16], "z": [4, 5], "r": [2, 4]},
    )
    report = measure(model)
    mha = only(report, "MultiHeadAttention")
    # S = 1*2*4*6 = 48, D = Dv = 16/2 = 8: MACs 48*16 = 768; FLOPs 1536 + (6 + 1 mask)*48
    assert mha.macs == 768
    assert mha.flops == 1536 + 7 * 48 == 1872
    matmul = only(report, "FusedMatMul")
    # A^T is [4,8]: M=4, K=8, N=5 -> 160 MACs; alpha != 1 scales the 20 outputs
    assert (matmul.macs, matmul.flops) == (160, 2 * 160 + 20)
    gemm = only(report, "FusedGemm")
    # M=2, K=3, N=4 -> 24 MACs; Relu on the 8 outputs
    assert (gemm.macs, gemm.flops) == (24, 48 + 8)


# ------------------------------------------------------------- convolution algorithm

CONV_MODEL = f"""{HEADER}
g (float[1,3,8,8] x) => (float[1,4,6,6] y)
<float[4,3,3,3] W = {{{zeros(108)}}}>
{{ y = Conv(x, W) }}"""


def test_im2col_adds_the_column_buffer_write_and_read() -> None:
    model = load(CONV_MODEL)
    direct = only(measure(model), "Conv")
    conv = only(measure(model, conv_algo="im2col"), "Conv")
    # column buffer: N*OH*OW*KH*KW*C = 1*6*6*3*3*3 = 972 floats = 3888 bytes, written + read
    assert conv.bytes_written == 144 * 4 + 3888
    assert conv.bytes_read == (192 + 108) * 4 + 3888
    assert conv.workspace_bytes == 2 * 3888
    assert conv.bytes_total - direct.bytes_total == 7776
    assert (conv.flops, conv.macs) == (direct.flops, direct.macs)
    assert direct.workspace_bytes == 0


def test_indirect_adds_the_pointer_buffer_read() -> None:
    conv = only(measure(load(CONV_MODEL), conv_algo="indirect"), "Conv")
    # OH*OW*KH*KW = 36*9 = 324 pointers of 8 bytes, read only
    assert conv.bytes_read == (192 + 108) * 4 + 324 * 8
    assert conv.bytes_written == 144 * 4
    assert conv.workspace_bytes == 2592


def test_im2col_grouped_strided_padded_fp16() -> None:
    model = load(
        f"""{HEADER}
        g (float16[2,4,8,8] x) => (float16[2,6,4,4] y)
        <float16[6,2,3,3] W = {{{zeros(108)}}}>
        {{ y = Conv<group: int = 2, pads: ints = [1, 1, 1, 1], strides: ints = [2, 2]>(x, W) }}
        """
    )
    conv = only(measure(model, conv_algo="im2col"), "Conv")
    # each of the 2 groups fills a buffer of OH*OW*KH*KW*C/group = 16*9*2 = 288 per image:
    # 2 images * 2 groups * 288 = 1152 halfs = 2304 bytes, written and read
    assert conv.workspace_bytes == 2 * 2304
    assert conv.bytes_written == 192 * 2 + 2304
    indirect = only(measure(model, conv_algo="indirect"), "Conv")
    # 2 images * 16 * 9 = 288 pointers
    assert indirect.workspace_bytes == 288 * 8


def test_pointwise_conv_needs_no_buffer_but_a_strided_one_does() -> None:
    text = f"""{HEADER}
        g (float[1,3,8,8] x) => (float[1,4,8,8] y, float[1,4,4,4] z)
        <float[4,3,1,1] W = {{{zeros(12)}}}>
        {{
          y = Conv(x, W)
          z = Conv<strides: ints = [2, 2]>(x, W)
        }}"""
    report = measure(load(text), conv_algo="im2col")
    plain, strided = report.nodes
    assert plain.workspace_bytes == 0
    # the strided 1x1 gathers 4*4*1*1*3 = 48 floats = 192 bytes, written and read
    assert strided.workspace_bytes == 2 * 192
    assert report.workspace_bytes == 384
    assert measure(load(text), conv_algo="indirect").nodes[0].workspace_bytes == 0


def test_unknown_conv_algo_is_bad_input() -> None:
    with pytest.raises(BadInputError, match="winograd"):
        measure(load(CONV_MODEL), conv_algo="winograd")


# ------------------------------------------------------------------- report helpers


def test_report_helpers() -> None:
    report = measure(load(LAYERNORM_CHAIN.replace("mean = ReduceMean(x, axes)", "mean = Relu(x)")))
    # Relu(x): reads 32, writes 32 -> now mean is [2,4] and every [2,4] node is 64+ bytes
    top = report.top(2)
    assert len(top) == 2
    assert top[0].bytes_total >= top[1].bytes_total
    assert all(top[1].bytes_total >= n.bytes_total for n in report.nodes if n not in top)
    assert report.top(0) == []
    by_op = report.by_op()
    assert sum(by_op.values()) == report.total_bytes
    assert list(by_op.values()) == sorted(by_op.values(), reverse=True)
    assert by_op["Relu"] == 64
    hand = TrafficReport(nodes=report.nodes)
    assert hand.param_bytes == sum(n.param_bytes for n in report.nodes)


# -------------------------------------------------------------------------- scaling


def test_linear_in_graph_size(monkeypatch: pytest.MonkeyPatch) -> None:
    n = 20_000
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(["N", 256]))
    graph = ir.Graph([x], [], nodes=[], opset_imports={"": 18})
    current = x
    for _ in range(n):
        node = ir.Node("", "Relu", [current], num_outputs=1)
        node.outputs[0].type = ir.TensorType(ir.DataType.FLOAT)
        node.outputs[0].shape = ir.Shape(["N", 256])
        graph.append(node)
        current = node.outputs[0]
    graph.outputs.append(current)
    model = ir.Model(graph, ir_version=10)

    calls = 0
    original = traffic._Ctx._shape

    def counting(self: traffic._Ctx, value: ir.Value) -> tuple[int, ...] | None:
        nonlocal calls
        calls += 1
        return original(self, value)

    monkeypatch.setattr(traffic._Ctx, "_shape", counting)
    report = measure(model, dims={"N": 2})
    assert report.node_count == report.kernel_count == n
    # each Relu moves 2 * 2*256 floats and does 512 FLOPs
    assert report.total_bytes == n * 2 * 512 * 4
    assert report.flops == n * 512
    # every value's shape is resolved exactly once: n outputs + the graph input
    assert calls == n + 1


# ---------------------------------------------------------------- bound input dims (--dim)

DYNAMIC_WIDTH = f"""{HEADER}
g (float[1,4,H,W] x) => (float[1,8,H2,W2] y)
<float[8,4,3,3] w = {{{zeros(288)}}}, float[8,1,1] s = {{{zeros(8)}}}>
{{
  c = Conv<strides=[2, 2], pads=[1, 1, 1, 1]>(x, w)
  m = Mul(c, s)
  y = Relu(m)
}}"""


def test_bound_input_dims_reach_the_values_behind_a_conv() -> None:
    """Inference names the Conv's output dims unk__N (it cannot write (W + 2 - 3) / 2 + 1),
    and the output is declared with its own names: with the inputs' dims bound, every value
    costs what it costs in the same model with static dims (x: 1*4*64*256*4 bytes, c, m, y:
    1*8*32*128*4 = 131,072 bytes each)."""
    from fusectl.boundshapes import bound_shapes

    dims = {"H": 64, "W": 256}
    model = load(DYNAMIC_WIDTH)
    bound = bound_shapes(model, dims)
    assert bound["c"] == bound["y"] == (1, 8, 32, 128)
    report = measure(model, dims=dims, bound=bound)
    static = measure(load(DYNAMIC_WIDTH.replace("float[1,4,H,W] x", "float[1,4,64,256] x")
                          .replace("float[1,8,H2,W2] y", "float[1,8,32,128] y")))
    assert [n.bytes_total for n in report.nodes] == [n.bytes_total for n in static.nodes]
    relu = only(report, "Relu")
    assert (relu.bytes_read, relu.bytes_written, relu.known) == (131_072, 131_072, True)
    unbound = only(measure(model, dims=dims), "Relu")  # the symbolic shapes alone
    assert unbound.known is False


def test_bound_shapes_of_a_run_time_reshape_below_opset_13() -> None:
    """onnx's data propagation does not go through Unsqueeze-11, so the Reshape to a target
    computed from Shape gets no shape even with static inputs; the copy is prepared as the
    model is (the shape arithmetic folded), so the Relu after it is costed."""
    from fusectl.boundshapes import bound_shapes

    model = load("""
        <ir_version: 7, opset_import: ["" : 12]>
        g (float[N,4,W] x) => (float[4,M] z)
        <int64 two = {2}, int64[1] four = {4}>
        { s = Shape(x)  d = Gather<axis=0>(s, two)  u = Unsqueeze<axes=[0]>(d)
          t = Concat<axis=0>(four, u)  r = Reshape(x, t)  z = Relu(r) }
    """)
    assert only(measure(model, dims={"W": 100}), "Relu").known is False
    bound = bound_shapes(model, {"W": 100})  # N unbound: 1, as the traffic model counts it
    assert bound["r"] == (4, 100)
    relu = only(measure(model, dims={"W": 100}, bound=bound), "Relu")
    assert (relu.bytes_read, relu.bytes_written, relu.known) == (1600, 1600, True)


def test_static_models_need_no_bound_shapes() -> None:
    from fusectl.boundshapes import bound_shapes

    model = load(DYNAMIC_WIDTH.replace("float[1,4,H,W] x", "float[1,4,64,256] x")
                 .replace("float[1,8,H2,W2] y", "float[1,8,32,128] y"))
    assert bound_shapes(model, {}) == {}


def test_optimize_reports_the_saving_of_a_dynamic_width_model() -> None:
    """End to end: the Mul folds into the Conv; with --dim binding H and W the report gives
    the same bytes before and after (and per application) as for the static model, not the
    ~0% the symbolic shapes alone gave."""
    import fusectl

    dynamic = onnx.parser.parse_model(DYNAMIC_WIDTH)
    static = onnx.parser.parse_model(
        DYNAMIC_WIDTH.replace("float[1,4,H,W] x", "float[1,4,64,256] x")
        .replace("float[1,8,H2,W2] y", "float[1,8,32,128] y"))
    results = [fusectl.optimize(ir.serde.deserialize_model(m), dims={"H": 64, "W": 256},
                                check=False) for m in (dynamic, static)]
    totals = [(r.traffic_before.total_bytes, r.traffic_after.total_bytes,
               [a.bytes_saved for a in r.rewrite.applications]) for r in results]
    assert totals[0] == totals[1]
    # the Mul's read and write of the tensor, and its 8 scales
    assert totals[0][0] - totals[0][1] == 2 * 131_072 + 8 * 4


@pytest.mark.parametrize("conv_algo", ["direct", "im2col"])
@pytest.mark.parametrize("name", ["squeezenet", "inception_v1"])
def test_meter_bytes_is_the_byte_total_of_node_traffic(name: str, conv_algo: str) -> None:
    """The rewrite loop ranks applications by ``Meter.bytes``; it must be what the report
    shows for the same node (folded, view, metadata and conv nodes all included)."""
    from fusectl.modelio import load_model
    from fusectl.prepare import prepare

    light = Path(os.path.dirname(onnx.__file__)) / "backend" / "test" / "data" / "light"
    model = load_model(light / f"light_{name}.onnx")
    prepare(model, fold=False)  # keep the ConstantOfShape weights: folded nodes to cost
    meter = traffic.Meter(conv_algo=conv_algo)
    kinds = set()
    for node in model.graph:
        full = meter.node(node)
        kinds.add((full.is_kernel, full.bytes_total > 0))
        assert meter.bytes(node) == full.bytes_total, node.name
    assert kinds >= {(True, False), (True, True)}  # views and real kernels met


def test_meter_bytes_of_folded_view_and_metadata_nodes() -> None:
    model = ir.from_proto(onnx.parser.parse_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[1, 3, 8, 8] x) => (float[1, 192] y, int64[4] s)
          <float[3, 3, 1, 1] w = {1, 0, 0, 0, 1, 0, 0, 0, 1}, int64[2] target = {1, 192}> {
            two = Constant<value = float[1] {2.0}>()
            four = Add(two, two)
            c = Conv(x, w)
            m = Mul(c, four)
            s = Shape(m)
            y = Reshape(m, target)
        }
    """))
    ShapeInferencePass()(model)
    meter = traffic.Meter()
    for node in model.graph:
        assert meter.bytes(node) == meter.node(node).bytes_total, node.op_type
    costs = {node.op_type: meter.bytes(node) for node in model.graph}
    assert costs["Add"] == costs["Reshape"] == 0 and costs["Shape"] == 4 * 8
    assert costs["Conv"] == 4 * (3 * 64 + 9 + 3 * 64)


def test_a_meter_forgets_a_value_typed_later() -> None:
    """The rewrite loop types a reader after an application: what the meter worked out for
    its untyped output (unknown, 0 bytes) must not outlive the new shape."""
    model = ir.from_proto(onnx.parser.parse_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4,8] x) => (float[4,8] z) { y = Relu(x)  z = Sigmoid(y) }
    """))
    relu = next(n for n in model.graph if n.op_type == "Relu")
    y = relu.outputs[0]
    y.shape = None
    meter = traffic.Meter()
    untyped = meter.bytes(relu)
    y.type, y.shape = ir.TensorType(ir.DataType.FLOAT), ir.Shape([4, 8])
    assert meter.bytes(relu) == untyped  # cached
    meter.forget([y])
    assert meter.bytes(relu) == untyped + 4 * 8 * 4  # the write of y is counted now
