"""New initializers keep the model's dtype: float64 models stay float64, fp16 stays fp16."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from fusectl.compile import compile_rules
from fusectl.prepare import prepare
from fusectl.rewrite import apply_rules
from fusectl.rulefile import load_rules
from fusectl.validate import ValidationOptions, validate


@pytest.mark.parametrize(("onnx_type", "np_type"), [("double", np.float64),
                                                     ("float16", np.float16)])
def test_folded_constants_keep_the_model_dtype(onnx_type: str, np_type: type) -> None:
    text = f"""<ir_version: 8, opset_import: ["" : 17]>
        g ({onnx_type}[2,4] x) => ({onnx_type}[2,4] z)
        {{ y = Mul(x, a)  z = Mul(y, b) }}"""
    proto = onnx.parser.parse_model(text)
    for name, value in (("a", 1.5), ("b", [0.5, 2.0, 3.0, -1.0])):
        proto.graph.initializer.append(
            onnx.numpy_helper.from_array(np.asarray(value, dtype=np_type), name))
    model = ir.serde.deserialize_model(proto)
    prepare(model)
    rules = [r for r in compile_rules(load_rules(["rules/45-elementwise.yaml"]))
             if r.id == "mul-chain-fold"]
    assert len(apply_rules(model, rules).applications) == 1
    dtypes = {init.dtype for init in model.graph.initializers.values()}
    assert dtypes == {ir.DataType.from_numpy(np.dtype(np_type))}
    assert validate(ir.serde.deserialize_model(proto), model, ValidationOptions()).passed
