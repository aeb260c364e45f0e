"""Proposed expression function for fusectl/expr.py (not applied: expr.py is not mine).

``runtime_shape_target(s, x)``: the constant Reshape target equal to a run-time target ``s``
computed from ``Shape(x)`` (Shape/Gather/Slice/Cast/Unsqueeze/Squeeze/Concat/Mul/Add/Sub/Div and
constants), at any opset (onnx only types such Reshapes from opset 14, and not at all when
strict inference fails). Entries: a static int; 0 where the entry is x's own dim at the same
position (a copy, allowzero 0); -1 for at most one other entry. Usage in 05-cleanup.yaml:

    match: [z = Reshape<allowzero=az>(x, s)]
    where: [not is_const(s) and producer_op(s) != "" and (az is None or az == 0)]
    let:   {target: runtime_shape_target(s, x)}
    replace: [z = Reshape<**z>(x, target)]

Run this file to check it on the shape_gather_static_dim repro (monkeypatched, opset 13).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from fusectl import expr
from fusectl.expr import NoMatch, _const_tensor, _shape_of_known_rank, is_value

MAX_SHAPE_NODES = 64


def _dims_of(value: Any, x: Any, budget: list[int]) -> list[Any]:
    """Entries of a 1-D (or scalar, as one entry) int tensor: ints, or ('dim', i) for dim i of
    x, or None when unknown."""
    budget[0] -= 1
    if budget[0] < 0:
        raise NoMatch("shape subgraph too large")
    tensor = _const_tensor(value) if is_value(value) else None
    if tensor is not None:
        return [int(v) for v in np.ravel(tensor.numpy())]
    node = value.producer() if is_value(value) else None
    if node is None or node.domain not in ("", "ai.onnx"):
        raise NoMatch("the shape is not computed from constants and Shape")
    op, ins = node.op_type, node.inputs
    attr = {k: a.value for k, a in node.attributes.items()}
    if op == "Shape":
        src = ins[0]
        dims = _shape_of_known_rank(src)
        start, end = attr.get("start", 0), attr.get("end", len(dims))
        entries = [d if isinstance(d, int) else (("dim", i) if src is x else None)
                   for i, d in enumerate(dims)]
        return entries[slice(start, end)]
    if op in ("Cast", "Identity"):
        return _dims_of(ins[0], x, budget)
    if op in ("Unsqueeze", "Squeeze"):
        return _dims_of(ins[0], x, budget)
    if op == "Concat":
        return [e for i in ins for e in _dims_of(i, x, budget)]
    if op == "Gather" and attr.get("axis", 0) == 0:
        data, idx = _dims_of(ins[0], x, budget), expr.to_array(ins[1])
        return [data[int(i)] for i in np.ravel(idx)]
    if op == "Slice" and len(ins) >= 3 and all(expr.is_constant(i) for i in ins[1:] if i):
        data = _dims_of(ins[0], x, budget)
        b, e = int(np.ravel(expr.to_array(ins[1]))[0]), int(np.ravel(expr.to_array(ins[2]))[0])
        step = int(np.ravel(expr.to_array(ins[4]))[0]) if len(ins) > 4 and ins[4] else 1
        return data[slice(b, e, step)]
    if op in ("Mul", "Add", "Sub", "Div") and len(ins) == 2:
        a, b = _dims_of(ins[0], x, budget), _dims_of(ins[1], x, budget)
        if len(a) != 1 or len(b) != 1 or not all(isinstance(v, int) for v in a + b):
            return [None] * max(len(a), len(b))
        fn = {"Mul": int.__mul__, "Add": int.__add__, "Sub": int.__sub__,
              "Div": int.__floordiv__}[op]
        return [fn(a[0], b[0])]
    raise NoMatch(f"{op} in the shape subgraph")


def runtime_shape_target(shape: Any, data: Any) -> np.ndarray:
    """A constant Reshape target equal to the run-time target ``shape`` of ``Reshape(data,
    shape)``: static entries as ints, data's own dim at its own position as 0 (copy), one
    unknown entry as -1. No match for a literal 0 or -1, or a second unknown entry."""
    entries = _dims_of(shape, data, [MAX_SHAPE_NODES])
    target = []
    for i, entry in enumerate(entries):
        if isinstance(entry, int):
            if entry <= 0:
                raise NoMatch("a 0 or -1 entry in the run-time target")
            target.append(entry)
        elif entry == ("dim", i):
            target.append(0)
        else:
            target.append(-1)
    if target.count(-1) > 1:
        raise NoMatch("more than one entry is unknown")
    return np.asarray(target, dtype=np.int64)


if __name__ == "__main__":
    import onnx_ir as ir

    from fusectl.modelio import load_model
    from fusectl.prepare import prepare

    model = load_model("/tmp/sweep/cv/repro/shape_gather_static_dim.onnx")
    prepare(model)
    node = next(n for n in model.graph if n.op_type == "Reshape")
    print("target:", runtime_shape_target(node.inputs[1], node.inputs[0]))  # [0 3 20]
    assert isinstance(model, ir.Model)
