"""Tests for fusectl.symdims: the length of Range(0, n, 1) over a named dim gets that name,
and onnx's inference carries it on; every other Range is left to onnx."""

from __future__ import annotations

import onnx
import onnx.parser
import onnx_ir as ir
import pytest

from fusectl import symdims
from fusectl.modelio import from_proto


def _model(start: int = 0, delta: int = 1, source: str = "x") -> ir.Model:
    text = f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[batch,seq] x, float[batch,unk__9] u, float[1,64] p) => (float[batch,16] y)
        <int64 one = {{1}}, int64 start = {{{start}}}, int64 delta = {{{delta}}},
         int64[1] ax = {{0}}>
        {{
          sh = Shape({source})  n = Gather<axis=0>(sh, one)  r = Range(start, n, delta)
          ru = Unsqueeze(r, ax)  rf = Cast<to=1>(ru)  s = Add(x, rf)
          y = ReduceSum<keepdims=0>(s, ax)
        }}
    """
    return from_proto(onnx.parser.parse_model(text))


def _dims(model: ir.Model, name: str) -> list[int | str | None]:
    value = next(out for node in model.graph for out in node.outputs if out.name == name)
    assert value.shape is not None
    return [d if isinstance(d, int) else d.value for d in value.shape]


def test_range_over_a_named_dim_is_named_and_the_name_flows_on() -> None:
    model = _model()
    assert _dims(model, "r")[0] != "seq"  # what onnx's inference gives: a fresh symbol
    assert symdims.name_lost_dims(model)
    assert _dims(model, "r") == ["seq"]
    assert _dims(model, "s") == ["batch", "seq"]  # no fresh symbol for the broadcast sum
    assert not symdims.name_lost_dims(model)  # named already: nothing to do


@pytest.mark.parametrize(("start", "delta", "source"), [
    (1, 1, "x"),  # length seq - 1
    (0, 2, "x"),  # length ceil(seq / 2)
    (0, 1, "u"),  # a symbol onnx minted is no name
    (0, 1, "p"),  # a static dim: onnx's own inference computes it
])
def test_other_ranges_are_left_alone(start: int, delta: int, source: str) -> None:
    model = _model(start, delta, source)
    before = _dims(model, "r")
    assert not symdims.name_lost_dims(model)
    assert _dims(model, "r") == before


def test_shapes_are_kept_when_onnx_inference_fails(monkeypatch) -> None:
    model = _model()
    before = {out.name: out.shape for node in model.graph for out in node.outputs}
    monkeypatch.setattr(symdims, "infer_model_shapes", lambda model: False)
    assert not symdims.name_lost_dims(model)
    after = {out.name: out.shape for node in model.graph for out in node.outputs}
    assert after == before
