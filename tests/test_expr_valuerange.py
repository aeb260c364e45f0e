"""valuerange: bounds proven from the graph, and the NaN guard they let attention drop."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.parser
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from fusectl import api
from fusectl.modelio import from_proto
from fusectl.valuerange import is_finite_mask, is_finite_scores, value_bounds


def _values(text: str) -> dict:
    model = from_proto(onnx.shape_inference.infer_shapes(onnx.parser.parse_model(text)))
    values = {v.name: v for n in model.graph for v in n.outputs}
    values.update({v.name: v for v in model.graph.inputs})
    return values


HEAD = '<ir_version: 8, opset_import: ["" : 17]>\n'


def test_where_of_constants_is_bounded_by_them() -> None:
    v = _values(HEAD + """g (bool[2,4] keep) => (float[2,1,4] m)
        <float zero = {0.0}, float low = {-3.0e38}, int64[3] sh = {2, 1, 4}>
        { w = Where(keep, zero, low)  m = Reshape(w, sh) }""")
    low = float(np.float32(-3.0e38))
    assert value_bounds(v["w"]) == (low, 0.0)
    assert value_bounds(v["m"]) == (low, 0.0)
    assert is_finite_mask(v["m"])


def test_arithmetic_on_a_cast_bool_mask() -> None:
    # (1 - cast(keep)) * -10000: keep is bool, so the mask is in [-10000, 0]
    v = _values(HEAD + """g (bool[2,4] keep) => (float[2,4] m)
        <float one = {1.0}, float big = {-10000.0}>
        { f = Cast<to=1>(keep)  d = Sub(one, f)  m = Mul(d, big) }""")
    assert value_bounds(v["f"]) == (0.0, 1.0)
    assert value_bounds(v["d"]) == (0.0, 1.0)
    assert value_bounds(v["m"]) == (-10000.0, 0.0)


def test_cast_int64_mask_times_lowest_overflows() -> None:
    # an int64 mask may hold 2: (1 - 2) * -3e38 = 3e38, and 3 gives inf: not provable
    v = _values(HEAD + """g (int64[2,4] keep) => (float[2,4] m)
        <float one = {1.0}, float low = {-3.0e38}>
        { f = Cast<to=1>(keep)  d = Sub(one, f)  m = Mul(d, low) }""")
    assert value_bounds(v["f"]) == (-9.223372036854776e18, 9.223372036854776e18)
    assert not is_finite_mask(v["m"])


def test_unknown_sources_are_not_bounded() -> None:
    v = _values(HEAD + """g (float[2,4] x) => (float[2,4] y, float[2,4] e)
        <float inf = {-inf}, bool[2,4] keep>
        { y = Relu(x)  e = Where(keep, x, inf) }""")
    assert value_bounds(v["x"]) is None  # a float graph input may hold -inf
    assert value_bounds(v["y"]) is None  # Relu is not modelled
    assert not is_finite_mask(v["e"])


@pytest.mark.parametrize("low, finite", [(-65504.0, False), (-10000.0, True)])
def test_float16_mask_needs_headroom(low: float, finite: bool) -> None:
    # finfo(float16).min + a score of -17 overflows to -inf; -10000 leaves room
    node = helper.make_node("Where", ["keep", "zero", "low"], ["m"])
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("keep", TensorProto.BOOL, [2, 4])],
        [helper.make_tensor_value_info("m", TensorProto.FLOAT16, [2, 4])],
        [numpy_helper.from_array(np.array(0.0, np.float16), "zero"),
         numpy_helper.from_array(np.array(low, np.float16), "low")])
    model = from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    (where,) = list(model.graph)
    assert value_bounds(where.outputs[0]) == (low, 0.0)
    assert is_finite_mask(where.outputs[0]) is finite


def test_the_walk_is_bounded() -> None:
    chain = " ".join(f"x{i + 1} = Identity(x{i})" for i in range(100))
    v = _values(HEAD + f"""g (bool[4] keep) => (float[4] x100)
        <float zero = {{0.0}}, float one = {{1.0}}>
        {{ x0 = Where(keep, zero, one) {chain} }}""")
    assert value_bounds(v["x10"]) == (0.0, 1.0)
    assert value_bounds(v["x100"]) is None  # more producers than MAX_NODES


ATTENTION = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[1,3,8] Q, float[1,3,8] K, float[1,3,8] V, float[1,1,3,3] mask) => (float[1,3,8] z)
<int64[4] sh = {1, 3, 2, 4}, int64[3] so = {1, 3, 8}, float c = {0.5}, float g = {0.0}>
{
  q4 = Reshape(Q, sh)  qt = Transpose<perm=[0,2,1,3]>(q4)
  k4 = Reshape(K, sh)  kt = Transpose<perm=[0,2,3,1]>(k4)
  v4 = Reshape(V, sh)  vt = Transpose<perm=[0,2,1,3]>(v4)
  qk = MatMul(qt, kt)  s = Mul(qk, c)  a = Add(s, mask)  p0 = Softmax<axis=-1>(a)
  nan = IsNaN(p0)  p = Where(nan, g, p0)  o = MatMul(p, vt)
  ot = Transpose<perm=[0,2,1,3]>(o)  z = Reshape(ot, so)
}
"""


@pytest.mark.parametrize("masked_row", [None, 1])
def test_guarded_attention_keeps_zero_rows_for_fully_masked_queries(
        masked_row: int | None) -> None:
    """The guard moves after MultiHeadAttention: a query whose keys are all -inf still
    gives 0 (the original's answer), not NaN."""
    original = onnx.parser.parse_model(ATTENTION)
    result = api.optimize(from_proto(original), target="onnxruntime", check=False)
    optimized = ir.serde.serialize_model(result.model)
    ops = [n.op_type for n in optimized.graph.node]
    assert ops.count("MultiHeadAttention") == 1 and ops.count("IsNaN") == 1
    rng = np.random.default_rng(0)
    feeds = {n: rng.standard_normal((1, 3, 8)).astype(np.float32) for n in "QKV"}
    mask = np.zeros((1, 1, 3, 3), np.float32)
    if masked_row is not None:
        mask[0, 0, masked_row, :] = -np.inf
    feeds["mask"] = mask
    expected, = ort.InferenceSession(original.SerializeToString()).run(None, feeds)
    got, = ort.InferenceSession(optimized.SerializeToString()).run(None, feeds)
    assert not np.isnan(got).any()
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    if masked_row is not None:
        assert (expected[0, masked_row] == 0).all()


def test_infinity_minus_infinity_is_unknown() -> None:
    # [-inf, 0] + [0, inf] holds -inf + inf = NaN somewhere: no bounds, whatever follows
    v = _values(HEAD + """g (bool[4] c) => (float[4] w)
        <float zero = {0.0}, float ninf = {-inf}, float pinf = {inf}>
        { a = Where(c, ninf, zero)  b = Where(c, zero, pinf)  s = Add(a, b)
          w = Where(c, s, zero) }""")
    assert value_bounds(v["a"]) == (-np.inf, 0.0)
    assert value_bounds(v["s"]) is None
    assert value_bounds(v["w"]) is None


def test_is_finite_scores_accepts_a_scaled_product_plus_a_finite_mask() -> None:
    v = _values(HEAD + """g (float[2,5,8] q, float[2,8,5] k, bool[2,5,5] keep, float[2,5,5] m)
        => (float[2,5,5] a, float[2,5,5] b, float[2,5,5] d, float[2,5,5] e)
        <float c = {0.35}, float z = {0.0}, float low = {-1.0e9}, float ninf = {-inf}>
        { s = MatMul(q, k)  sc = Div(s, c)  fm = Where(keep, z, low)  a = Add(fm, sc)
          b = Add(sc, m)  im = Where(keep, z, ninf)  d = Add(sc, im)  e = Div(c, s) }""")
    assert is_finite_scores(v["sc"])  # a product divided by a positive constant
    assert is_finite_scores(v["a"])  # plus a mask bounded by [-1e9, 0]
    assert not is_finite_scores(v["b"])  # a float graph input may hold -inf
    assert not is_finite_scores(v["d"])  # the mask holds -inf
    assert not is_finite_scores(v["e"])  # a constant divided by the product: not a product


def test_library_drops_the_guard_of_a_finite_mask_before_fusing() -> None:
    """softmax-nan-guard (35-attention) removes the guard of an HF-style finite mask, so
    ort-multihead-attention (70-onnxruntime) leaves no IsNaN behind."""
    text = ATTENTION.replace("float[1,1,3,3] mask) => (float[1,3,8] z)",
                             "bool[1,1,3,3] keep) => (float[1,3,8] z)")
    text = text.replace("float g = {0.0}>",
                        "float g = {0.0}, float zero = {0.0}, float low = {-3.0e38}>")
    text = text.replace("qk = MatMul(qt, kt)", "mask = Where(keep, zero, low)  qk = MatMul(qt, kt)")
    result = api.optimize(from_proto(onnx.parser.parse_model(text)), target="onnxruntime")
    assert result.validation is not None and result.validation.passed
    assert result.rewrite.counts().get("softmax-nan-guard") == 1
    ops = result.ops_after
    assert ops["com.microsoft.MultiHeadAttention"] == 1 and ops["IsNaN"] == 0


def test_is_finite_value_t5_clamp_bounds() -> None:
    # T5's fp16 clamp: c = isinf(x).any() ? finfo.max - 1000 : finfo.max, bounds -c and c
    from fusectl.expr import FUNCTIONS

    v = _values(HEAD + """g (bool any, float x) => (float16 hi, float16 lo, float y)
        <float big = {64504.0}, float max = {65504.0}, float inf = {inf}>
        { w = Where(any, big, max)  n = Neg(w)  lo = Cast<to=10>(n)  hi = Cast<to=10>(w)
          y = Where(any, inf, max) }""")
    finite = FUNCTIONS["is_finite_value"]
    assert finite(v["hi"]) and finite(v["lo"])
    assert not finite(v["x"])  # a float graph input may hold NaN
    assert not finite(v["y"])  # an inf constant
