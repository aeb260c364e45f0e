"""Preparation folds what exporters leave for run time: constant multi-output nodes, shape
chains that become static only once the value before them is typed, copies of outputs."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnx import numpy_helper

import fusectl
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
