"""Tests for fusectl.shapereads: reads of named dims move to the graph input naming them, so
the value they were read from keeps only its real readers; what they compute is unchanged."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnx.parser
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import numpy_helper
from values import parse_with_weights

import fusectl
from fusectl import shapereads
from fusectl.deadcode import remove_unused
from fusectl.modelio import from_proto


def _model(body: str) -> onnx.ModelProto:
    text = f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[B,S,64] x, float[T,64] t) => (float[B,S,64] y, int64[N] n)
        <int64 i0 = {{0}}, int64 i1 = {{1}}, int64 i2 = {{2}}, int64[1] a0 = {{0}},
         int64[1] m1 = {{-1}}, int64[2] i01 = {{0, 1}}, int64[4] hd4 = {{0, 0, 4, 16}}>
        {{
          h = Relu(x)  y = Identity(h)  r = Reshape(h, hd4)
          {body}
        }}
    """
    return onnx.parser.parse_model(text)


READS = {
    # T5's key length: a scalar read of a transposed value's dim
    "scalar-gather": ("k = Transpose<perm=[0,2,1,3]>(r)  ks = Shape(k)  s = Gather<axis=0>(ks, i2)"
                      "  n = Unsqueeze(s, a0)"),
    # two dims at once, in another order
    "vector-gather": "ks = Shape(r)  n = Gather<axis=0>(ks, i10)",
    # dynamo's slice of the shape, every dim named by x
    "whole-shape": "ks = Shape<start=0, end=2>(r)  n = Identity(ks)",
}


def _run(model: onnx.ModelProto, batch: int, length: int) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    feeds = {"x": rng.normal(size=(batch, length, 64)).astype(np.float32),
             "t": rng.normal(size=(3, 64)).astype(np.float32)}
    return session.run(None, feeds)


@pytest.mark.parametrize("case", sorted(READS))
def test_named_dims_are_read_from_the_input_and_compute_the_same(case: str) -> None:
    proto = _model(READS[case])
    proto.graph.initializer.append(numpy_helper.from_array(np.array([1, 0], np.int64), "i10"))
    model = from_proto(proto)
    assert shapereads.read_dims_from_inputs(model) == 1
    remove_unused(model)
    shapes = [n for n in model.graph if n.op_type == "Shape"]
    assert [s.inputs[0].name for s in shapes] == ["x"]  # no read of r (or k) is left
    assert Counter(n.op_type for n in model.graph)["Transpose"] == 0
    after = ir.serde.serialize_model(model)
    for batch, length in ((1, 3), (2, 7)):
        for want, got in zip(_run(proto, batch, length), _run(after, batch, length), strict=True):
            np.testing.assert_array_equal(want, got)


@pytest.mark.parametrize("body", [
    "ks = Shape(r)  n = Gather<axis=0>(ks, i2)",  # a static dim (4): folding's business
    "u = Concat<axis=0>(h, h)  ks = Shape(u)  n = Gather<axis=0>(ks, i01)",  # 2*B is no input's
    "ks = Shape(x)  n = Gather<axis=0>(ks, i01)",  # read from the input already
    "n = Shape(r)",  # a static dim among the named ones
])
def test_reads_no_input_names_stay(body: str) -> None:
    model = from_proto(_model(body))
    before = [(n.op_type, [v.name for v in n.inputs]) for n in model.graph]
    assert shapereads.read_dims_from_inputs(model) == 0
    assert [(n.op_type, [v.name for v in n.inputs]) for n in model.graph] == before


def test_a_static_dim_read_beside_a_named_one_stays() -> None:
    """Of two reads of one Shape, the named dim moves to the input; the static one (4 heads)
    stays where it was, so the Shape of r is still read."""
    model = from_proto(_model("ks = Shape(r)  d = Gather<axis=0>(ks, i1)"
                              "  e = Gather<axis=0>(ks, i2)  d1 = Unsqueeze(d, a0)"
                              "  e1 = Unsqueeze(e, a0)  n = Concat<axis=0>(d1, e1)"))
    assert shapereads.read_dims_from_inputs(model) == 1
    reads = {n.outputs[0].name: n.inputs[0].producer().inputs[0].name
             for n in model.graph if n.op_type == "Gather"}
    assert reads == {"d": "x", "e": "r"}


T5_KEYS = """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[batch_size,sequence_length,64] x) => (float[batch_size,sequence_length,64] y)
    <float[64,64] wq, float[64,64] wk, float[64,64] wv, float[64,64] wo,
     int64 i0 = {0}, int64 i1 = {1}, int64 i2 = {2}, int64[3] a012 = {0, 1, 2},
     int64[4] h4 = {0, 0, 4, 16}, int64[3] h3 = {0, 0, 64}, float small = {0.01}>
    {
      q = MatMul(x, wq)  k = MatMul(x, wk)  v = MatMul(x, wv)
      q4 = Reshape(q, h4)  qt = Transpose<perm=[0,2,1,3]>(q4)
      k4 = Reshape(k, h4)  kt = Transpose<perm=[0,2,3,1]>(k4)  ks = Transpose<perm=[0,2,1,3]>(k4)
      v4 = Reshape(v, h4)  vt = Transpose<perm=[0,2,1,3]>(v4)
      kshape = Shape(ks)  klen = Gather<axis=0>(kshape, i2)  pos = Range(i0, klen, i1)
      pf = Cast<to=1>(pos)  pb = Mul(pf, small)  bias = Unsqueeze(pb, a012)
      a = MatMul(qt, kt)  am = Add(a, bias)  p = Softmax<axis=-1>(am)
      o = MatMul(p, vt)  ot = Transpose<perm=[0,2,1,3]>(o)  z = Reshape(ot, h3)
      y = MatMul(z, wo)
    }
"""


def test_a_key_length_read_no_longer_keeps_the_attention_from_fusing(tmp_path) -> None:
    """T5 reads the key length from the keys' [B,H,L,D] Transpose for its position bias: a
    second reader of the keys' Reshape, which the attention pattern must own. Read from the
    input instead, the Transpose is dead and the block becomes one MultiHeadAttention."""
    model = parse_with_weights(T5_KEYS)
    path = tmp_path / "t5.onnx"
    onnx.save(model, path)
    result = fusectl.optimize(str(path), target="onnxruntime")
    assert result.validation is not None and result.validation.passed
    ops = Counter(n.op_type for n in result.model.graph)
    assert ops["MultiHeadAttention"] == 1 and ops["Softmax"] == 0


# ------------------------------------------------------------------- Slice(Shape(x)) reads


def _sliced(bounds: str, dims: str = "B,S,4,16") -> onnx.ModelProto:
    return onnx.parser.parse_model(f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[{dims}] x) => (float[B,S,4,16] y)
        <int64[1] lo = {{-1}}, int64[1] hi = {{9223372036854775807}},
         int64[1] a0 = {{0}}, int64[1] s2 = {{2}}, int64[1] m2 = {{-2}}, int64[1] m1 = {{-1}},
         int64[1] one = {{1}}>
        {{
          sh = Shape(x)  d = Slice({bounds})  f = Cast<to=1>(d)  r = Sqrt(f)  y = Div(x, r)
        }}
    """)


@pytest.mark.parametrize("bounds", ["sh, lo, hi", "sh, lo, hi, a0", "sh, lo, hi, m1, one"])
def test_a_slice_of_a_shape_reading_static_dims_folds(bounds: str) -> None:
    """dynamo's ``q.shape[-1:]`` for the attention scale: a constant once the head size is
    static, however dynamic the other dims are, so sqrt(head_size) folds with it."""
    proto = _sliced(bounds)
    model = from_proto(_sliced(bounds))
    fusectl.prepare.prepare(model)
    ops = Counter(n.op_type for n in model.graph)
    assert ops == {"Div": 1}, ops
    after = ir.serde.serialize_model(model)
    for batch, length in ((1, 3), (2, 5)):
        x = np.random.default_rng(0).normal(size=(batch, length, 4, 16)).astype(np.float32)
        want = ort.InferenceSession(proto.SerializeToString(),
                                    providers=["CPUExecutionProvider"]).run(None, {"x": x})
        got = ort.InferenceSession(after.SerializeToString(),
                                   providers=["CPUExecutionProvider"]).run(None, {"x": x})
        np.testing.assert_allclose(got[0], want[0], rtol=1e-6)


@pytest.mark.parametrize(("bounds", "dims"), [
    ("sh, lo, hi", "B,S,4,D"),  # the dim read is dynamic
    ("sh, a0, hi, a0, s2", "B,S,4,2"),  # step 2 reads [B, 4]: not a run of dims
    ("sh, lo, hi, s2", "B,S,4,16"),  # axis 2 of a 1-D shape: onnxruntime would refuse
])
def test_a_slice_of_a_shape_that_is_not_a_static_read_stays(bounds: str, dims: str) -> None:
    model = from_proto(_sliced(bounds, dims))
    fusectl.prepare.prepare(model)
    assert Counter(n.op_type for n in model.graph)["Slice"] == 1


def test_a_block_with_anonymous_dims_fuses_and_is_saved_anonymous(tmp_path) -> None:
    """The T5-style block with ``[?, ?, 64]`` inputs (onnxscript's BART encoder test model
    declares ``[1, ?]`` input ids): anonymous dims are named while optimizing, so the
    attention fuses, and the saved model declares them anonymous again."""
    model = parse_with_weights(T5_KEYS.replace("batch_size,sequence_length", "?,?"))
    path, out = tmp_path / "anonymous.onnx", tmp_path / "anonymous.opt.onnx"
    onnx.save(model, path)
    result = fusectl.optimize(str(path), target="onnxruntime")
    ir.save(result.model, out)
    assert result.validation is not None and result.validation.passed
    assert Counter(n.op_type for n in result.model.graph)["MultiHeadAttention"] == 1
    saved = onnx.load(out)
    assert [d.WhichOneof("value") for d in saved.graph.input[0].type.tensor_type.shape.dim] \
        == [None, None, "dim_value"]
    assert b"anon__" not in saved.SerializeToString()


@pytest.mark.parametrize(("text", "dims"), [
    ('<ir_version: 4, opset_import: ["" : 9]>', "d = Slice<starts=[-1], ends=[1000]>(sh)"),
    ('<ir_version: 8, opset_import: ["" : 17]>', "d = Slice(sh, m1, big, , one)"),
    ('<ir_version: 8, opset_import: ["" : 17]>', "d = Slice(sh, m1, big, , two)"),
])
def test_slice_reads_in_the_attribute_form_and_with_steps_but_no_axes(text, dims) -> None:
    model = from_proto(onnx.parser.parse_model(f"""{text}
        g (float[B,S,4,16] x) => (int64[1] d)
        <int64[1] m1 = {{-1}}, int64[1] big = {{1000}}, int64[1] one = {{1}},
         int64[1] two = {{2}}>
        {{ sh = Shape(x)  {dims} }}"""))
    read = shapereads.shape_read(next(n for n in model.graph if n.op_type == "Slice"))
    if "two" in dims:
        assert read is None  # step 2: not a plain read
    else:
        assert read is not None and read[0].name == "x" and read[1] == [16]


def test_a_graph_outputs_declared_dims_are_not_read() -> None:
    """y is declared [B, S] but is x transposed, [S, B] at run time: a read of its dims is
    not moved to the input (nor evaluated by name), so z keeps its run-time shape."""
    proto = onnx.parser.parse_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[B, S] x) => (float[B, S] y, float[B, S] z)
        <int64[1] i0 = {0}, int64[1] m1 = {-1}>
        {
          y = Transpose<perm=[1,0]>(x)  sh = Shape(y)  n = Gather<axis=0>(sh, i0)
          t = Concat<axis=0>(n, m1)  r = Reshape(x, t)  z = Identity(r)
        }""")
    result = fusectl.optimize(from_proto(proto), dims={"B": 2, "S": 3})
    assert result.validation is not None and result.validation.passed


# ------------------------------------------------------- reads written by the rewrite loop

# The first rule writes a read of p's dims beside the match (as GroupQueryAttention's rule
# reads the key's run-time length); the second can remove p's producer only once that read
# is of the graph input.
READ_WRITING_RULES = """
version: 1
rules:
  - id: writes-a-read
    summary: Sigmoid(Relu(p)) expanded to p's own shape (the same values).
    match:
      - y = Sigmoid(Relu(p))
    where:
      - expr: reader_op(y) != "Expand"
        message: once
    replace:
      - y = Expand(Sigmoid(Relu(p)), Shape(p))
  - id: double-relu
    summary: Relu(Relu(q)) is Relu(q).
    match:
      - w = Relu(Relu(q))
    replace:
      - w = Relu(q)
"""


def test_a_read_a_rewrite_writes_moves_to_the_input_so_later_fusions_go_on(tmp_path) -> None:
    rules = tmp_path / "reads.yaml"
    rules.write_text(READ_WRITING_RULES)
    proto = onnx.parser.parse_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[B,S] x) => (float[B,S] y)
        { r1 = Relu(x)  r2 = Relu(r1)  y = Sigmoid(r2) }""")
    path = tmp_path / "m.onnx"
    onnx.save(proto, path)
    result = fusectl.optimize(str(path), rules=fusectl.load_rule_set([rules], builtin=False))
    assert result.validation is not None and result.validation.passed
    ops = Counter(n.op_type for n in result.model.graph)
    assert ops["Relu"] == 1 and ops["Expand"] == 1
    (shape,) = [n for n in result.model.graph if n.op_type == "Shape"]
    assert shape.inputs[0].name == "x"
