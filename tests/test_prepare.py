"""Preparation folds what exporters leave for run time: constant multi-output nodes, shape
chains that become static only once the value before them is typed, copies of outputs."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import numpy_helper

import fusectl
import fusectl.prepare as preparation
from fusectl.cli import main
from fusectl.prepare import prepare


def _model(text: str, **arrays: np.ndarray) -> onnx.ModelProto:
    model = onnx.parser.parse_model(text)
    model.graph.initializer.extend(numpy_helper.from_array(a, n) for n, a in arrays.items())
    onnx.checker.check_model(model, full_check=True)
    return model


def _run(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


PACKED = """
<ir_version: 9, opset_import: ["" : 18]>
g (float[2,5,16] x) => (float[2,5,16] q, float[2,5,16] k)
{
  wq, wk = Split<num_outputs=2>(w)
  bq, bk = Split<num_outputs=2>(b)
  tq = Transpose(wq)  tk = Transpose(wk)
  mq = MatMul(x, tq)  mk = MatMul(x, tk)
  q = Add(mq, bq)  k = Add(mk, bk)
}
"""


def test_constant_split_is_folded_and_the_projections_fuse() -> None:
    """The dynamo export of nn.MultiheadAttention splits its packed weight at run time."""
    rng = np.random.default_rng(0)
    proto = _model(PACKED, w=rng.normal(size=(32, 16)).astype(np.float32),
                   b=rng.normal(size=32).astype(np.float32))
    model = ir.serde.deserialize_model(proto)
    prepare(model)
    assert "Split" not in {n.op_type for n in model.graph}
    result = fusectl.optimize(ir.serde.deserialize_model(proto))
    assert result.passed, result.validation
    # x is 3-D: one Reshape to 2-D for both projections, two Gemms, two Reshapes back
    assert dict(result.ops_after) == {"Reshape": 3, "Gemm": 2}


def test_quiet_run_prints_no_folder_warning(tmp_path, capsys) -> None:
    rng = np.random.default_rng(0)
    path = tmp_path / "packed.onnx"
    onnx.save(_model(PACKED, w=rng.normal(size=(32, 16)).astype(np.float32),
                     b=rng.normal(size=32).astype(np.float32)), path)
    assert main(["optimize", str(path), "-o", str(tmp_path / "o.onnx"), "-q"]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out == ""


def test_shape_chain_folds_once_the_value_before_it_is_typed() -> None:
    """Reshape(x, shape of x) then Reshape(r, shape of r): Shape(r) is static only after r
    is typed again; one fold leaves six nodes, folding again leaves the one Reshape."""
    proto = _model("""
        <ir_version: 9, opset_import: ["" : 17]>
        g (float[16,4,8] x) => (float[16,32] y)
        {
          s = Shape(x)  d0 = Gather<axis=0>(s, zero)  u0 = Unsqueeze(d0, axes)
          shape1 = Concat<axis=0>(u0, minus_one)  r = Reshape(x, shape1)
          t = Shape(r)  d1 = Gather<axis=0>(t, one)  u1 = Unsqueeze(d1, axes)
          shape2 = Concat<axis=0>(minus_one, u1)  y = Reshape(r, shape2)
        }
    """, zero=np.array(0, np.int64), one=np.array(1, np.int64), axes=np.array([0], np.int64),
        minus_one=np.array([-1], np.int64))
    result = fusectl.optimize(ir.serde.deserialize_model(proto))
    assert result.passed, result.validation
    assert dict(result.ops_after) == {"Reshape": 1}
    out = ir.serde.serialize_model(result.model)
    assert [o.name for o in out.graph.output] == ["y"]
    x = np.arange(16 * 4 * 8, dtype=np.float32).reshape(16, 4, 8)
    np.testing.assert_array_equal(_run(out, {"x": x})[0], x.reshape(16, 32))


def test_graph_output_copy_is_written_by_its_producer() -> None:
    """(The ONNX domain is imported as "ai.onnx": onnxscript's folder skips those nodes.)"""
    proto = _model("""
        <ir_version: 9, opset_import: ["ai.onnx" : 17]>
        g (float[2,3] x) => (float[2,3] z, float[2,3] w)
        { r = Relu(x)  z = Identity(r)  n = Neg(x)  w = Identity(n)  v = Abs(n) }
    """)
    model = ir.serde.deserialize_model(proto)
    prepare(model)
    ops = [n.op_type for n in model.graph]
    assert ops.count("Identity") == 0  # Abs(n) is dead: n's only reader is w's Identity
    assert [o.name for o in model.graph.outputs] == ["z", "w"]
    assert model.graph.outputs[0].producer().op_type == "Relu"


def test_graph_output_copy_stays_when_the_value_has_other_readers() -> None:
    proto = _model("""
        <ir_version: 9, opset_import: ["ai.onnx" : 17]>
        g (float[2,3] x) => (float[2,3] z, float[2,3] w)
        { r = Relu(x)  z = Identity(r)  w = Neg(r) }
    """)
    model = ir.serde.deserialize_model(proto)
    prepare(model, fold=True)
    assert model.graph.outputs[0].producer().op_type == "Identity"


TOKEN_TYPES = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[2,4,3] x) => (float[2,4,3] y)
{
  t = GatherElements<axis=1>(buf, idx)
  te = Expand(t, shp)
  emb = Gather(table, te)
  y = Add(x, emb)
}
"""


def test_constant_gather_elements_chain_folds_to_one_add() -> None:
    """ALBERT/ELECTRA slice their token_type_ids buffer with GatherElements: onnxscript's
    folder cannot evaluate it (nor can onnx's reference with 64 values or more on the
    axis), so the Expand and the embedding Gather after it stayed too."""
    buf = (np.arange(128) % 2).astype(np.int64).reshape(1, 128)  # 0 1 0 1 ...
    proto = _model(TOKEN_TYPES, buf=buf, idx=np.array([[0, 3, 126, -1]], np.int64),
                   shp=np.array([2, 4], np.int64),
                   table=np.array([[1, 2, 3], [10, 20, 30]], np.float32))
    model = ir.serde.deserialize_model(proto)
    prepare(model)
    assert [n.op_type for n in model.graph] == ["Add"]
    # buf[0, [0, 3, 126, 127]] = [0, 1, 0, 1]: table rows 0, 1, 0, 1 in both batch rows
    out = ir.serde.serialize_model(model)
    emb = _run(out, {"x": np.zeros((2, 4, 3), np.float32)})[0]
    rows = [[1, 2, 3], [10, 20, 30], [1, 2, 3], [10, 20, 30]]
    np.testing.assert_array_equal(emb, np.array([rows, rows], np.float32))


def test_gather_elements_out_of_range_is_left_to_the_runtime() -> None:
    """Index 128 on an axis of 128: onnxruntime raises; folding must not hide that."""
    proto = _model(TOKEN_TYPES, buf=np.zeros((1, 128), np.int64),
                   idx=np.array([[0, 1, 2, 128]], np.int64), shp=np.array([2, 4], np.int64),
                   table=np.ones((2, 3), np.float32))
    model = ir.serde.deserialize_model(proto)
    prepare(model)
    assert [n.op_type for n in model.graph] == ["GatherElements", "Expand", "Gather", "Add"]


def test_gather_elements_reads_the_leading_window_of_the_other_axes() -> None:
    """As onnxruntime does: indices [2,2] on data [3,4] along axis 1 read rows 0 and 1;
    -1 is the last column. data = 0..11 row by row: row 0 holds 0..3, row 1 holds 4..7."""
    proto = _model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2,2] x) => (float[2,2] y)
        { t = GatherElements<axis=1>(data, idx)  y = Add(x, t) }
    """, data=np.arange(12, dtype=np.float32).reshape(3, 4),
        idx=np.array([[3, -1], [0, 1]], np.int64))
    model = ir.serde.deserialize_model(proto)
    prepare(model)
    assert [n.op_type for n in model.graph] == ["Add"]
    out = _run(ir.serde.serialize_model(model), {"x": np.zeros((2, 2), np.float32)})[0]
    np.testing.assert_array_equal(out, np.array([[3, 3], [4, 5]], np.float32))


def test_constant_node_is_computed_only_when_its_size_fits(monkeypatch) -> None:
    """The size bound holds before computing, so a node the folder left for its size is not
    computed again: the GatherElements output [1,4] holds 4 elements."""
    arrays = {"buf": np.zeros((1, 128), np.int64), "idx": np.array([[0, 1, 2, 3]], np.int64),
              "shp": np.array([2, 4], np.int64), "table": np.ones((2, 3), np.float32)}
    monkeypatch.setattr(preparation, "FOLD_OUTPUT_LIMIT", 3)
    model = ir.serde.deserialize_model(_model(TOKEN_TYPES, **arrays))
    prepare(model)
    assert "GatherElements" in {n.op_type for n in model.graph}
    monkeypatch.setattr(preparation, "FOLD_OUTPUT_LIMIT", 4)
    model = ir.serde.deserialize_model(_model(TOKEN_TYPES, **arrays))
    prepare(model)
    assert "GatherElements" not in {n.op_type for n in model.graph}


def test_quantized_weights_and_random_draws_stay() -> None:
    """A DequantizeLinear of an int8 weight is the QDQ format, not a constant to compute;
    Bernoulli of constant probabilities is a new draw on every run (onnxscript's own list of
    random ops misses it). Opset 21: onnx's reference has DequantizeLinear from 19 on."""
    proto = _model("""
        <ir_version: 10, opset_import: ["" : 21]>
        g (float[2,3] x) => (float[2,3] y)
        { w = DequantizeLinear(wq, s)  b = Bernoulli(p)  m = Mul(x, w)  y = Add(m, b) }
    """, wq=np.array([[1, -2, 3], [4, 5, -6]], np.int8), s=np.array(0.5, np.float32),
        p=np.full((2, 3), 0.5, np.float32))
    model = ir.serde.deserialize_model(proto)
    prepare(model)
    assert [n.op_type for n in model.graph] == ["DequantizeLinear", "Bernoulli", "Mul", "Add"]


def _ops(model: ir.Model) -> dict[str, int]:
    ops: dict[str, int] = {}
    for node in model.graph:
        ops[node.op_type] = ops.get(node.op_type, 0) + 1
    return ops


STATIC_DIM_READ = """
<ir_version: 9, opset_import: ["" : 12]>
g (float[N,3,5] x) => (float[N,2,5] z)
{
  s = Shape(x)  d = Gather<axis=0>(s, index)  u = Unsqueeze<axes=[0]>(d)
  t = Concat<axis=0>(two, u)  c = ConstantOfShape<value=float[1] {0.5}>(t)
  z = MatMul(c, x)
}
"""


@pytest.mark.parametrize(("index", "folds"), [
    (np.array(1, np.int64), True),  # x.size(1): a static dim of a dynamic-batch tensor
    (np.array(-2, np.int64), True),  # the same dim counted from the end
    (np.array([1], np.int64), True),  # 1-D indices
    (np.array(0, np.int64), False),  # the dynamic batch itself
    (np.array(3, np.int64), False),  # out of range: left for the runtime to refuse
])
def test_static_dim_of_a_partly_dynamic_shape_folds(index: np.ndarray, folds: bool) -> None:
    """Gather(Shape(x), i) where x's dim i is static is a constant even when x's other dims
    are not; what reads it (Unsqueeze, Concat, ConstantOfShape) folds with it."""
    text = STATIC_DIM_READ if index.ndim == 0 else STATIC_DIM_READ.replace(
        "u = Unsqueeze<axes=[0]>(d)", "u = Identity(d)")
    model = onnx.parser.parse_model(text)
    model.graph.initializer.extend([numpy_helper.from_array(index, "index"),
                                    numpy_helper.from_array(np.array([2], np.int64), "two")])
    working = ir.serde.deserialize_model(model)
    prepare(working)
    if folds:
        assert _ops(working) == {"MatMul": 1}
        x = np.random.default_rng(0).normal(size=(4, 3, 5)).astype(np.float32)
        np.testing.assert_allclose(_run(ir.serde.serialize_model(working), {"x": x})[0],
                                   _run(model, {"x": x})[0], rtol=1e-6)
    else:
        assert "Gather" in _ops(working) and "ConstantOfShape" in _ops(working)


def test_shape_start_attribute_and_graph_outputs() -> None:
    """Shape-15's ``start`` shifts the index; a graph output's dims are only declared (an
    exporter may declare them wrongly), so reading them is left to the run time."""
    model = onnx.parser.parse_model("""
        <ir_version: 9, opset_import: ["" : 18]>
        g (float[N,3,5] x) => (float[N,3,5] y, int64 a, int64 b)
        { s = Shape<start=1>(x)  a = Gather<axis=0>(s, zero)
          y = Relu(x)  t = Shape(y)  b = Gather<axis=0>(t, one) }
    """)
    model.graph.initializer.extend([numpy_helper.from_array(np.array(0, np.int64), "zero"),
                                    numpy_helper.from_array(np.array(1, np.int64), "one")])
    working = ir.serde.deserialize_model(model)
    prepare(working)
    a = working.graph.outputs[1]
    assert a.const_value is not None and int(a.const_value.numpy()) == 3
    assert working.graph.outputs[2].producer().op_type == "Gather"


def test_dim_made_static_by_the_rewrite_folds_in_tidy() -> None:
    """ddddocr's CRNN: a Reshape to a run-time target is typed only once a rule gives it a
    constant target; the LSTM state sized by the Reshape output's dim then folds too."""
    model = onnx.parser.parse_model("""
        <ir_version: 7, opset_import: ["" : 12]>
        g (float[N,4,8] x) => (float[N,1,32] z)
        {
          s = Shape(x)  d0 = Gather<axis=0>(s, zero)  u0 = Unsqueeze<axes=[0]>(d0)
          t = Concat<axis=0>(u0, one, width)  r = Reshape(x, t)
          q = Shape(r)  e = Gather<axis=0>(q, index1)  ue = Unsqueeze<axes=[0]>(e)
          ks = Concat<axis=0>(ue, width)  k = ConstantOfShape<value=float[1] {0.25}>(ks)
          z = Add(r, k)
        }
    """)
    model.graph.initializer.extend(numpy_helper.from_array(a, n) for n, a in (
        ("zero", np.array(0, np.int64)), ("index1", np.array(1, np.int64)),
        ("one", np.array([1], np.int64)), ("width", np.array([32], np.int64))))
    result = fusectl.optimize(ir.serde.deserialize_model(model))
    assert result.passed, result.validation
    assert dict(result.ops_after) == {"Reshape": 1, "Add": 1}


def test_shape_of_a_graph_output_declared_static_is_not_folded() -> None:
    """y is [N,6] at run time whatever its declaration [2,6] says (onnxruntime does not check
    it): onnxscript's folder read the declaration and made Reshape(x, [2,6]), which fails for
    any N but 2."""
    model = onnx.parser.parse_model("""
        <ir_version: 8, opset_import: ["" : 13]>
        g (float[N,6] x) => (float[2,6] y, float[?] z)
        { y = Relu(x)  t = Shape(y)  z = Reshape(x, t) }
    """)
    working = ir.serde.deserialize_model(model)
    prepare(working)  # Reshape(x, Shape(y)) is x itself: y = Relu(x) whatever it declares
    options = ort.SessionOptions()  # onnxruntime's own folding trusts the declaration too
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3  # its warning that the declared shape does not merge
    session = ort.InferenceSession(ir.serde.serialize_model(working).SerializeToString(),
                                   options, providers=["CPUExecutionProvider"])
    assert session.run(None, {"x": np.ones((3, 6), np.float32)})[1].shape == (3, 6)


@pytest.mark.parametrize("declared", ["2,6", "N,6", "3,6"])
def test_shape_of_a_graph_output_folds_from_what_its_producer_gives(declared: str) -> None:
    """Relu of a [2,6] input is [2,6] whatever the output declares: Shape(y) folds to that
    (a declared [3,6] would have made Reshape(x, [3,6]) of 12 elements), and the declaration
    is back on the output afterwards."""
    model = onnx.parser.parse_model(f"""
        <ir_version: 8, opset_import: ["" : 13]>
        g (float[2,6] x) => (float[{declared}] y, float[?] z)
        {{ y = Relu(x)  t = Shape(y)  z = Reshape(x, t) }}
    """)
    working = ir.serde.deserialize_model(model)
    preparation._fold(working)
    assert "Shape" not in _ops(working)
    dims = [d if isinstance(d, int) else d.value for d in working.graph.outputs[0].shape]
    assert dims == [int(d) if d.isdigit() else d for d in declared.split(",")]
    x = np.ones((2, 6), np.float32)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    session = ort.InferenceSession(ir.serde.serialize_model(working).SerializeToString(),
                                   options, providers=["CPUExecutionProvider"])
    assert session.run(None, {"x": x})[1].shape == (2, 6)


def test_size_of_a_graph_output_declared_static_is_not_folded() -> None:
    """Size(y) read from y's declaration [2,6] made Reshape(x, [12]), wrong for any N but 2."""
    model = onnx.parser.parse_model("""
        <ir_version: 8, opset_import: ["" : 13]>
        g (float[N,6] x) => (float[2,6] y, float[?] z)
        <int64[1] zero = {0}>
        { y = Relu(x)  n = Size(y)  t = Unsqueeze(n, zero)  z = Reshape(x, t) }
    """)
    working = ir.serde.deserialize_model(model)
    prepare(working)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    session = ort.InferenceSession(ir.serde.serialize_model(working).SerializeToString(),
                                   options, providers=["CPUExecutionProvider"])
    assert session.run(None, {"x": np.ones((3, 6), np.float32)})[1].shape == (18,)


WEIGHT_NORM = """
<ir_version: 9, opset_import: ["" : 18]>
g ({t}[1, 128, 40] x) => ({t}[1, 128, 40] y)
<int64[2] axes = {{0, 1}}>
{{
  n = ReduceL2<keepdims=1>(v, axes)  d = Div(v, n)  w = Mul(d, gain)
  y = Conv<pads=[8, 7], group=4>(x, w)
}}
"""


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_a_half_precision_sum_over_weights_folds_in_float32(dtype):
    """torch's weight norm of wav2vec2's positional convolution (dim=2) in float16: onnx's
    reference implementation sums the squares in float16 (the norm 5% off over these 4096
    weights a tap), which changed the outputs beyond float16's tolerance; computed in float32
    and rounded once, as onnxruntime computes it, the fold is within an ulp."""
    rng = np.random.default_rng(0)
    v = (rng.standard_normal((128, 32, 16)) * 0.05).astype(dtype)
    gain = np.full((1, 1, 16), 2.0, dtype)
    text = WEIGHT_NORM.format(t="float16" if dtype == np.float16 else "float")
    proto = _model(text, v=v, gain=gain)
    model = ir.serde.deserialize_model(proto)
    prepare(model)
    assert not any(n.op_type == "ReduceL2" for n in model.graph)
    result = fusectl.optimize(ir.serde.deserialize_model(proto))
    assert result.validation.passed
    norm = np.sqrt((v.astype(np.float64) ** 2).sum(axis=(0, 1), keepdims=True))
    folded = next(t.const_value.numpy() for t in model.graph.initializers.values()
                  if t.const_value is not None and t.shape == (128, 32, 16))
    expected = v / norm * gain
    if dtype == np.float16:  # within 2 ulps of the exact weights, in float16
        spacing = np.spacing(np.abs(expected).astype(dtype)).astype(np.float64)
        assert np.all(np.abs(folded.astype(np.float64) - expected) <= 2 * spacing)
    else:
        np.testing.assert_allclose(folded, expected, rtol=1e-5)


def test_a_half_precision_sum_of_constants_rounds_once():
    """Sum(40000, 40000, -40000) in float16: 40000 as onnxruntime computes it, not the
    overflow of a float16 partial sum."""
    text = """
    <ir_version: 9, opset_import: ["" : 18]>
    g (float16[2] x) => (float16[2] y)
    { s = Sum(a, b, c)  y = Add(s, x) }
    """
    big = np.full(2, 40000, np.float16)
    model = ir.serde.deserialize_model(_model(text, a=big, b=big, c=-big))
    prepare(model)
    (constant,) = [t.const_value.numpy() for t in model.graph.initializers.values()
                   if t.const_value is not None]
    assert constant.tolist() == [40000, 40000]


def test_lrn_is_left_to_onnxruntime():
    """onnx's reference LRN (1.23) normalizes only as many channels as the batch has: a
    constant LRN stays for onnxruntime to compute."""
    text = """
    <ir_version: 9, opset_import: ["" : 18]>
    g (float[1, 4, 2, 2] x) => (float[1, 4, 2, 2] y)
    { n = LRN<size=3>(c)  y = Add(n, x) }
    """
    c = np.full((1, 4, 2, 2), 300.0, np.float32)
    model = ir.serde.deserialize_model(_model(text, c=c))
    prepare(model)
    assert any(n.op_type == "LRN" for n in model.graph)


def test_weights_in_constant_nodes_are_left_out_of_shape_inference(monkeypatch) -> None:
    """onnxscript-built models hold their weights in Constant nodes; inference serializes the
    model each time and leaves out only big initializers, so big Constants are lifted first
    (a 670 MB SmolLM spent 6 of its 10 s inferring shapes through them)."""
    weight = np.random.default_rng(0).normal(size=(128, 256)).astype(np.float32)
    proto = onnx.parser.parse_model("""
    <ir_version: 9, opset_import: ["" : 18]>
    g (float[N,128] x) => (float[N,256] y)
    { w = Constant<value=float[1] {0.0}>()  m = MatMul(x, w)  y = Relu(m) }
    """)
    proto.graph.node[0].attribute[0].t.CopyFrom(numpy_helper.from_array(weight))
    sizes: list[int] = []
    real = fusectl.shapes.infer_proto_shapes

    def spy(model_proto):
        sizes.append(model_proto.ByteSize())
        return real(model_proto)

    monkeypatch.setattr(fusectl.shapes, "infer_proto_shapes", spy)
    model = ir.serde.deserialize_model(proto)
    prepare(model)
    assert sizes, "the untyped MatMul must be inferred"
    assert max(sizes) < weight.nbytes // 10
    assert [n.op_type for n in model.graph] == ["MatMul", "Relu"]
    lifted = model.graph.initializers[model.graph.node(0).inputs[1].name].const_value.numpy()
    np.testing.assert_array_equal(lifted, weight)
    assert model.graph.node(0).outputs[0].shape == ir.Shape(["N", 256])
