"""Models onnxruntime runs but onnx's checker refuses (fusectl.repair): nodes out of
topological order and com.microsoft ops without that domain's import (onnxruntime's own
fusion tests write both) are repaired with a note, optimized and validated; every other
checker complaint stays bad input (one line, exit 2, nothing written)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnx.parser
import pytest
from onnx import helper as oh

import fusectl
from fusectl.cli import main
from fusectl.errors import BadInputError
from fusectl.repair import sort_nodes

UNSORTED = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[2,8] x) => (float[2,8] z)
<float[1] one = {1.0}>
{
  z = Relu(s)
  s = Add(t, one)
  t = Neg(x)
}
"""


def _write(tmp_path: Path, proto: onnx.ModelProto, name: str = "m.onnx") -> Path:
    path = tmp_path / name
    path.write_bytes(proto.SerializeToString())
    return path


def _unsorted() -> onnx.ModelProto:
    # the parser keeps the text's order; onnx's checker would refuse it
    return onnx.parser.parse_model(UNSORTED)


def _unsorted_float16() -> onnx.ModelProto:
    """Out of order and in float16: validation clones the reference for its range sample."""
    return onnx.parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float16[2,8] x) => (float16[2,8] z)
    { z = Relu(s)  s = Add(t, x)  t = Neg(x) }
    """)


def _contrib_without_import() -> onnx.ModelProto:
    """com.microsoft.FastGelu on a MatMul, the domain never imported (as onnxruntime's
    gemmfastgelu test model has it)."""
    w = onnx.numpy_helper.from_array(
        np.random.default_rng(0).normal(0, 0.5, (8, 8)).astype(np.float32), "w")
    nodes = [oh.make_node("MatMul", ["x", "w"], ["m"]),
             oh.make_node("FastGelu", ["m"], ["g"], domain="com.microsoft"),
             oh.make_node("Relu", ["g"], ["z"])]
    graph = oh.make_graph(nodes, "g",
                          [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 8])],
                          [oh.make_tensor_value_info("z", onnx.TensorProto.FLOAT, [2, 8])],
                          [w])
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize("build, note", [
    (_unsorted, "not in topological order"),
    (_unsorted_float16, "not in topological order"),
    (_contrib_without_import, "without importing that domain"),
])
def test_forgiven_faults_are_repaired_noted_and_validated(tmp_path: Path, capsys, build, note
                                                          ) -> None:
    proto = build()
    with pytest.raises(onnx.checker.ValidationError):
        onnx.checker.check_model(proto)
    path = _write(tmp_path, proto)
    before = path.read_bytes()
    out = tmp_path / "out.onnx"
    code = main(["optimize", str(path), "-o", str(out), "--json", str(tmp_path / "r.json")])
    printed = "".join(capsys.readouterr())
    assert code == 0, printed
    assert "note: " in printed and note in printed
    report = json.loads((tmp_path / "r.json").read_text())
    assert len(report["input_repairs"]) == 1 and note in report["input_repairs"][0]
    assert report["validation"]["passed"] is True
    onnx.checker.check_model(onnx.load(out))  # the output is valid as written
    assert path.read_bytes() == before  # the input is untouched


def test_both_faults_in_one_model_are_both_repaired(tmp_path: Path) -> None:
    proto = _contrib_without_import()
    nodes = list(proto.graph.node)
    del proto.graph.node[:]
    proto.graph.node.extend(reversed(nodes))
    result = fusectl.optimize(str(_write(tmp_path, proto)))
    assert len(result.input_repairs) == 2
    assert result.passed


def test_a_sorted_model_has_no_repairs(tmp_path: Path) -> None:
    proto = _unsorted()
    assert sort_nodes(proto.graph)
    assert fusectl.optimize(str(_write(tmp_path, proto))).input_repairs == ()


@pytest.mark.parametrize("text, says", [
    # a cycle cannot be sorted
    ("""<ir_version: 8, opset_import: ["" : 17]>
     g (float[2] x) => (float[2] z) { a = Add(x, b)  b = Neg(a)  z = Relu(b) }""",
     "topologically sorted"),
    # a value nothing defines is not an ordering problem
    ("""<ir_version: 8, opset_import: ["" : 17]>
     g (float[2] x) => (float[2] z) { z = Relu(nowhere) }""",
     "topologically sorted"),
    # the default domain's version would be a guess (onnxruntime takes its newest)
    ("""<ir_version: 8, opset_import: ["com.microsoft" : 1]>
     g (float[2] x) => (float[2] z) { z = Relu(x) }""",
     "No opset import for domain ''"),
])
def test_other_checker_faults_stay_bad_input(tmp_path: Path, capsys, text: str, says: str
                                             ) -> None:
    path = _write(tmp_path, onnx.parser.parse_model(text))
    with pytest.raises(BadInputError, match=says):
        fusectl.optimize(str(path))
    out = tmp_path / "out.onnx"
    code = main(["optimize", str(path), "-o", str(out)])
    out_text, err_text = capsys.readouterr()
    assert code == 2 and out_text == ""
    assert len(err_text.strip().splitlines()) == 1 and says in err_text
    assert not out.exists()


def test_sort_moves_as_little_as_it_can_and_sees_subgraph_reads() -> None:
    """An If whose branch reads a value produced after it moves behind that producer; the
    other nodes keep their order."""
    then = oh.make_graph([oh.make_node("Identity", ["late"], ["t"])], "then", [],
                         [oh.make_tensor_value_info("t", onnx.TensorProto.FLOAT, [2])])
    other = oh.make_graph([oh.make_node("Identity", ["x"], ["e"])], "else", [],
                          [oh.make_tensor_value_info("e", onnx.TensorProto.FLOAT, [2])])
    nodes = [
        oh.make_node("Neg", ["x"], ["a"], name="first"),
        oh.make_node("Sigmoid", ["a"], ["sa"], name="second"),
        oh.make_node("If", ["c"], ["y"], name="if", then_branch=then, else_branch=other),
        oh.make_node("Relu", ["x"], ["b"], name="independent"),
        oh.make_node("Exp", ["a"], ["late"], name="producer"),
    ]
    graph = oh.make_graph(nodes, "g",
                          [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2]),
                           oh.make_tensor_value_info("c", onnx.TensorProto.BOOL, [])],
                          [oh.make_tensor_value_info(n, onnx.TensorProto.FLOAT, [2])
                           for n in ("y", "b", "sa")])
    expected = ["first", "second", "independent", "producer", "if"]
    assert sort_nodes(graph)
    assert [n.name for n in graph.node] == expected
    assert sort_nodes(graph)  # sorted already: unchanged
    assert [n.name for n in graph.node] == expected


def test_the_float64_reference_runs_an_input_out_of_order(tmp_path: Path) -> None:
    """The float64 tie-breaker loads the input itself (onnx's evaluator runs graph order)."""
    from fusectl.float64 import Float64Run

    path = _write(tmp_path, _unsorted())
    x = np.linspace(-2, 2, 16, dtype=np.float32).reshape(2, 8)
    outputs = Float64Run(str(path)).run({"x": x})
    assert np.allclose(outputs["z"], np.maximum(1.0 - x, 0.0))


def test_an_if_whose_branches_return_too_few_values_is_bad_input(tmp_path: Path, capsys
                                                                 ) -> None:
    """onnx's checker lets it through, onnxruntime refuses it, and onnxscript's folder
    raised on it (an internal error): one line, exit 2 (onnxoptimizer's lift_lex_if test)."""
    empty = oh.make_graph([oh.make_node("Identity", ["x"], ["t"])], "branch", [], [])
    nodes = [oh.make_node("Constant", [], ["c"], value=oh.make_tensor("c", onnx.TensorProto.BOOL,
                                                                      [], [True])),
             oh.make_node("If", ["c"], ["a", "b"], then_branch=empty, else_branch=empty)]
    graph = oh.make_graph(nodes, "g",
                          [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])],
                          [oh.make_tensor_value_info("a", onnx.TensorProto.FLOAT, [2])])
    path = _write(tmp_path, oh.make_model(graph, opset_imports=[oh.make_opsetid("", 13)],
                                          ir_version=8))
    code = main(["optimize", str(path), "-o", str(tmp_path / "out.onnx"), "--no-validate"])
    err = capsys.readouterr().err
    assert code == 2 and "has 2 outputs but its branch 'branch' returns 0" in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "out.onnx").exists()
