"""A language-model head tied to the token embedding: one weight read by a Gather (the
embedding) and, transposed, by the head's MatMul. Folding the Transpose would store the
weight twice, and a real head is far above the folder's size limit, so the Transpose runs
on every call unless the head reads the weight transposed (Gemm's transB)."""

from __future__ import annotations

from collections import Counter

import onnx
import pytest
from values import parse_with_weights

import fusectl
from fusectl import prepare
from fusectl.validate import ValidationOptions

TIED_HEAD = """
    <ir_version: 8, opset_import: ["" : 18]>
    g (int64[{batch},{seq}] ids) => (float[{batch},{seq},96] logits)
    <float[96,32] embed, float[32] gamma>
    {{
      e = Gather(embed, ids)  h = Mul(e, gamma)  r = Relu(h)
      w = Transpose<perm=[1,0]>(embed)  logits = MatMul(r, w)
    }}
"""


@pytest.fixture
def small_fold_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The folder's limit below this head's weight, as it is below a real one's."""
    monkeypatch.setattr(prepare, "FOLD_INPUT_LIMIT", 1024)


@pytest.mark.parametrize(("batch", "seq"), [("2", "5"), ("batch", "seq")])
def test_a_tied_head_reads_the_weight_transposed(tmp_path, small_fold_limit, batch, seq) -> None:
    path = tmp_path / "tied.onnx"
    onnx.save(parse_with_weights(TIED_HEAD.format(batch=batch, seq=seq)), path)
    ids = ValidationOptions(input_ranges={"ids": (0, 95)})
    result = fusectl.optimize(str(path), validation=ids)
    assert result.validation is not None and result.validation.passed
    ops = Counter(n.op_type for n in result.model.graph)
    assert ops["Transpose"] == 0 and ops["MatMul"] == 0 and ops["Gemm"] == 1
    # two symbolic dims: the shape to restore is read at run time
    assert ops["Shape"] == (1 if batch == "batch" else 0)
    # still one copy of the weight
    sizes = [v.const_value.size for v in result.model.graph.initializers.values()]
    assert sizes.count(96 * 32) == 1
