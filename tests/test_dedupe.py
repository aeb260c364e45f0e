"""merge_equal_initializers: equal weights become one initializer (so that CSE can merge the
computations reading them), and nothing that merely looks equal is merged."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto
from onnx import helper as oh
from onnx import numpy_helper as nh
from onnx_ir.passes.common import CommonSubexpressionEliminationPass, RemoveUnusedNodesPass

from fusectl import dedupe
from fusectl.dedupe import merge_equal_initializers
from fusectl.prepare import detach_legacy_initializer_inputs, reattach_legacy_initializer_inputs


def _model(nodes: list[onnx.NodeProto], inputs: dict[str, list[int]], outputs: list[str],
           inits: dict[str, np.ndarray], *, ir_version: int = 8,
           listed: tuple[str, ...] = (), out_shape: list[int] | None = None,
           ) -> onnx.ModelProto:
    """float inputs ``inputs`` (plus the initializers named in ``listed``), float outputs."""
    values = [oh.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs.items()]
    values += [oh.make_tensor_value_info(n, oh.np_dtype_to_tensor_dtype(inits[n].dtype),
                                         list(inits[n].shape)) for n in listed]
    graph = oh.make_graph(nodes, "g", values,
                          [oh.make_tensor_value_info(n, TensorProto.FLOAT, out_shape)
                           for n in outputs],
                          [nh.from_array(a, n) for n, a in inits.items()])
    opset = 9 if ir_version < 4 else 17
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", opset)],
                         ir_version=ir_version)


def _run(proto: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    session = ort.InferenceSession(proto.SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _weight_names(model: ir.Model) -> list[str | None]:
    return [node.inputs[1].name for node in model.graph]


def _two_matmuls(w1: np.ndarray, w2: np.ndarray, **kwargs: object) -> onnx.ModelProto:
    nodes = [oh.make_node("MatMul", ["xa", "W1"], ["ya"]),
             oh.make_node("MatMul", ["xb", "W2"], ["yb"])]
    return _model(nodes, {"xa": [2, 2], "xb": [2, 2]}, ["ya", "yb"], {"W1": w1, "W2": w2},
                  **kwargs)


# ------------------------------------------------------------------------------ fires


def test_equal_weights_are_merged_and_consumers_rewired() -> None:
    w = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
    proto = _two_matmuls(w, w.copy())
    model = ir.serde.deserialize_model(proto)
    assert merge_equal_initializers(model.graph) == 1
    assert list(model.graph.initializers) == ["W1"]
    assert _weight_names(model) == ["W1", "W1"]
    xa = np.array([[1.0, 0.0], [0.0, 1.0]], np.float32)
    xb = np.array([[1.0, 1.0], [2.0, 0.0]], np.float32)
    ya, yb = _run(ir.to_proto(model), {"xa": xa, "xb": xb})
    np.testing.assert_array_equal(ya, [[1, 2], [3, 4]])  # identity @ W
    np.testing.assert_array_equal(yb, [[4, 6], [2, 4]])  # [1+3, 2+4], [2*1, 2*2]


def test_three_equal_weights_all_point_at_the_first() -> None:
    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    nodes = [oh.make_node("MatMul", ["x", n], [f"y{n}"]) for n in ("A", "B", "C", "D")]
    inits = {"A": w, "B": w + 1, "C": w.copy(), "D": w.copy()}
    model = ir.serde.deserialize_model(
        _model(nodes, {"x": [1, 2]}, ["yA", "yB", "yC", "yD"], inits))
    assert merge_equal_initializers(model.graph) == 2
    assert _weight_names(model) == ["A", "B", "A", "A"]


def test_merged_weights_let_cse_merge_the_branches() -> None:
    """inception_v1's case: two Conv+Relu branches read one input with equal weights."""
    w = np.full((2, 1, 1, 1), 0.5, np.float32)
    nodes = [oh.make_node("Conv", ["x", "Wa"], ["ca"]), oh.make_node("Relu", ["ca"], ["ra"]),
             oh.make_node("Conv", ["x", "Wb"], ["cb"]), oh.make_node("Relu", ["cb"], ["rb"]),
             oh.make_node("Add", ["ra", "rb"], ["y"])]
    proto = _model(nodes, {"x": [1, 1, 2, 2]}, ["y"], {"Wa": w, "Wb": w.copy()})
    model = ir.serde.deserialize_model(proto)
    merge_equal_initializers(model.graph)
    CommonSubexpressionEliminationPass()(model)
    RemoveUnusedNodesPass()(model)
    assert [node.op_type for node in model.graph] == ["Conv", "Relu", "Add"]
    x = np.array([[[[1.0, -2.0], [4.0, 0.0]]]], np.float32)
    (y,) = _run(ir.to_proto(model), {"x": x})
    # each of the 2 channels: relu(0.5 * x), twice
    expected = np.array([[1.0, 0.0], [4.0, 0.0]], np.float32)
    np.testing.assert_array_equal(y, np.stack([expected, expected])[None])
    np.testing.assert_array_equal(y, _run(proto, {"x": x})[0])


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.int64, np.bool_])
def test_dtypes_numpy_has_no_buffer_for_are_merged_too(dtype: type) -> None:
    w = np.array([[1, 0], [0, 1]]).astype(dtype)
    nodes = [oh.make_node("Identity", [n], [f"y{n}"]) for n in ("A", "B")]
    model = ir.serde.deserialize_model(_model(nodes, {}, ["yA", "yB"], {"A": w, "B": w.copy()}))
    assert merge_equal_initializers(model.graph) == 1
    assert [node.inputs[0].name for node in model.graph] == ["A", "A"]


def test_equal_strings_are_merged_and_different_ones_are_not() -> None:
    graph = ir.Graph([], [], nodes=[], name="g")
    for name, strings in (("A", [b"ab", b"c"]), ("B", [b"ab", b"c"]), ("C", [b"a", b"bc"])):
        tensor = ir.StringTensor(np.array(strings, dtype=object), name=name)
        graph.initializers.add(ir.Value(name=name, const_value=tensor))
    for name in "ABC":
        graph.append(ir.node("Identity", [graph.initializers[name]]))
    assert merge_equal_initializers(graph) == 1  # "ab"+"c" is not "a"+"bc"
    assert [node.inputs[0].name for node in graph] == ["A", "A", "C"]


def test_one_tensor_stored_three_ways_is_merged_and_its_look_alikes_are_not() -> None:
    """Raw bytes in the file, typed float_data in the file, an in-memory array (what the
    folder makes): one tensor, one initializer. The same bytes as another shape or dtype
    stay apart."""
    w = np.array([[1.5, -2.0], [0.25, 3.0]], np.float32)
    stored = [nh.from_array(w, "raw"),
              oh.make_tensor("typed", TensorProto.FLOAT, [2, 2], w.reshape(-1).tolist()),
              nh.from_array(w.reshape(4), "flat"),
              nh.from_array(w.view(np.int32), "ints")]
    assert stored[0].HasField("raw_data") and not stored[1].HasField("raw_data")
    names = ["raw", "typed", "flat", "ints", "memory"]
    graph = oh.make_graph([oh.make_node("Identity", [n], [f"y{n}"]) for n in names[:4]], "g",
                          [], [oh.make_empty_tensor_value_info(f"y{n}") for n in names[:4]],
                          stored)
    model = ir.serde.deserialize_model(oh.make_model(graph))
    memory = ir.Value(name="memory", const_value=ir.Tensor(w.copy(), name="memory"))
    model.graph.initializers.add(memory)
    model.graph.append(ir.node("Identity", [memory]))
    assert merge_equal_initializers(model.graph) == 2
    assert [node.inputs[0].name for node in model.graph] == ["raw", "raw", "flat", "ints", "raw"]
    assert list(model.graph.initializers) == ["raw", "flat", "ints"]


# --------------------------------------------------------------------------- must not


def _merged(w1: np.ndarray, w2: np.ndarray) -> int:
    nodes = [oh.make_node("Identity", [n], [f"y{n}"]) for n in ("A", "B")]
    model = ir.serde.deserialize_model(_model(nodes, {}, ["yA", "yB"], {"A": w1, "B": w2}))
    return merge_equal_initializers(model.graph)


def test_a_difference_between_the_sampled_ends_is_found() -> None:
    """Equal first and last SAMPLE_BYTES: only the full comparison tells them apart."""
    size = 4 * dedupe.SAMPLE_BYTES  # float32: twice the bytes both samples cover
    w = np.zeros(size, np.float32)
    other = w.copy()
    other[size // 2] = 1.0
    assert _merged(w, other) == 0
    assert _merged(w, w.copy()) == 1


@pytest.mark.parametrize(("w1", "w2"), [
    (np.zeros((2, 3), np.float32), np.zeros((2, 3), np.int32)),  # same bytes, other dtype
    (np.zeros((2, 3), np.float32), np.zeros((3, 2), np.float32)),  # same bytes, other shape
    (np.zeros(4, np.float32), np.array([0.0, 0.0, 0.0, -0.0], np.float32)),  # 0 == -0 in numpy
    (np.ones(4, np.float16), np.array([1, 1, 1, 1.001], np.float16)),
], ids=["dtype", "shape", "signed-zero", "last-element"])
def test_tensors_that_only_look_equal_are_kept(w1: np.ndarray, w2: np.ndarray) -> None:
    assert _merged(w1, w2) == 0


def test_equal_nan_bits_are_equal() -> None:
    w = np.array([np.nan, 1.0], np.float32)
    assert _merged(w, w.copy()) == 1


def test_graph_inputs_and_outputs_keep_their_identity() -> None:
    """IR >= 4: a listed initializer is a default the caller may override, so it is not the
    same as its equal twin; an initializer that is a graph output keeps its name."""
    w = np.eye(2, dtype=np.float32)
    proto = _two_matmuls(w, w.copy(), listed=("W2",))
    model = ir.serde.deserialize_model(proto)
    assert merge_equal_initializers(model.graph) == 0
    assert _weight_names(model) == ["W1", "W2"]

    nodes = [oh.make_node("MatMul", ["x", "W1"], ["y"])]
    proto = _model(nodes, {"x": [2, 2]}, ["y", "W2"], {"W1": w, "W2": w.copy()})
    model = ir.serde.deserialize_model(proto)
    assert merge_equal_initializers(model.graph) == 0
    assert set(model.graph.initializers) == {"W1", "W2"}


def test_tensors_above_max_bytes_are_not_compared() -> None:
    w = np.ones((16, 16), np.float32)  # 1 KiB
    proto = _two_matmuls(w, w.copy())
    assert merge_equal_initializers(ir.serde.deserialize_model(proto).graph,
                                    max_bytes=1023) == 0
    assert merge_equal_initializers(ir.serde.deserialize_model(proto).graph,
                                    max_bytes=1024) == 1


def test_only_tensors_equal_in_layout_and_samples_are_hashed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Same-shaped trained weights (every transformer layer) differ in their first bytes and
    are never read in full; only the two real twins are hashed."""
    hashed: list[int] = []
    real_sha256 = dedupe.hashlib.sha256

    def counting(data: object) -> object:
        hashed.append(len(memoryview(data).cast("B")))  # type: ignore[arg-type]
        return real_sha256(data)  # type: ignore[arg-type]

    monkeypatch.setattr(dedupe.hashlib, "sha256", counting)
    rng = np.random.default_rng(0)
    layers = {f"L{i}": rng.standard_normal((64, 64)).astype(np.float32) for i in range(6)}
    layers["T0"] = np.full((32, 64), 3.0, np.float32)
    layers["T1"] = np.full((32, 64), 3.0, np.float32)
    layers["odd"] = np.full((64, 32), 3.0, np.float32)  # same bytes as T0, other shape
    nodes = [oh.make_node("Identity", [n], [f"y{n}"]) for n in layers]
    model = ir.serde.deserialize_model(_model(nodes, {}, [f"y{n}" for n in layers], layers))
    assert merge_equal_initializers(model.graph) == 1
    assert hashed == [32 * 64 * 4, 32 * 64 * 4]
    assert "T1" not in model.graph.initializers


# ---------------------------------------------------------------------- IR version < 4


def test_ir3_model_lists_the_remaining_initializers_as_inputs_after_saving(tmp_path) -> None:
    """IR 3 lists every initializer as an input. Merging works on the detached model; the
    dropped one must leave the inputs too, or onnxruntime asks for it as a required input."""
    w = np.array([[2.0, 0.0], [0.0, 3.0]], np.float32)
    proto = _two_matmuls(w, w.copy(), ir_version=3, listed=("W1", "W2"), out_shape=[2, 2])
    model = ir.serde.deserialize_model(proto)
    assert merge_equal_initializers(model.graph) == 0  # still listed: overridable
    assert detach_legacy_initializer_inputs(model) == 2
    assert merge_equal_initializers(model.graph) == 1
    reattach_legacy_initializer_inputs(model)
    path = tmp_path / "legacy.onnx"
    ir.save(model, path)
    saved = onnx.load(path)
    onnx.checker.check_model(saved, full_check=True)
    assert [i.name for i in saved.graph.input] == ["xa", "xb", "W1"]
    assert [t.name for t in saved.graph.initializer] == ["W1"]
    x = np.ones((2, 2), np.float32)
    ya, yb = _run(saved, {"xa": x, "xb": 2 * x})
    np.testing.assert_array_equal(ya, [[2, 3], [2, 3]])
    np.testing.assert_array_equal(yb, [[4, 6], [4, 6]])


def test_external_data_weights_are_merged(tmp_path) -> None:
    """Weights in an external data file (memory-mapped, read only where compared)."""
    w = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)
    nodes = [oh.make_node("Add", ["A", "B"], ["s"]), oh.make_node("Add", ["s", "C"], ["y"])]
    proto = _model(nodes, {}, ["y"], {"A": w, "B": w.copy(), "C": w + 1})
    onnx.save(proto, tmp_path / "m.onnx", save_as_external_data=True,
              all_tensors_to_one_file=True, location="m.data", size_threshold=0)
    model = ir.load(tmp_path / "m.onnx")
    assert isinstance(model.graph.initializers["B"].const_value, ir.ExternalTensor)
    assert merge_equal_initializers(model.graph) == 1
    assert [node.inputs[1].name for node in model.graph] == ["A", "C"]
    assert [node.inputs[0].name for node in model.graph][0] == "A"


# ----------------------------------------------------------------------- merge_twins


def _twin_model(text: str) -> ir.Model:
    return ir.serde.deserialize_model(onnx.parser.parse_model(text))


def _node(model: ir.Model, name: str) -> ir.Node:
    return next(n for n in model.graph if n.outputs[0].name == name)


TWINS = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[4,8] x) => (float[4,1,2] oa, float[4,1,2] ob, float[4,1,2] oc, float[4,1,2] od,
                     float[4,1,3] oe)
<int64[1] one = {1}, int64[1] s0 = {0}, int64[1] e2 = {2}, int64[1] s0b = {0},
 int64[1] e2b = {2}, int64[1] e3 = {3}, int64[1] am1 = {-1}>
{
  u = Unsqueeze(x, one)
  p = Slice(u, s0, e2, am1)     q = Slice(u, s0b, e2b, am1)   r = Slice(u, s0, e3, am1)
  a = Neg(p)  b = Neg(q)  c = LeakyRelu<alpha=0.5>(p)  d = LeakyRelu<alpha=0.25>(p)  e = Neg(r)
  oa = Sigmoid(a)  ob = Sigmoid(b)  oc = Sigmoid(c)  od = Sigmoid(d)  oe = Sigmoid(e)
}
"""


def test_twin_with_equal_constants_is_merged_and_its_readers_rewired() -> None:
    model = _twin_model(TWINS)
    p, q = _node(model, "p"), _node(model, "q")
    changed = dedupe.merge_twins(model.graph, [q])
    assert q.graph is None and p.graph is model.graph
    assert _node(model, "b").inputs[0] is p.outputs[0]
    assert p.outputs[0] in changed  # its readers changed: the loop re-tries rules there
    assert len(_node(model, "u").outputs[0].uses()) == 2  # p and r


def test_nodes_that_differ_are_not_twins() -> None:
    model = _twin_model(TWINS)
    r = _node(model, "r")  # other end (an equal first input is not enough)
    d = _node(model, "d")  # other alpha
    e = _node(model, "e")  # reads r
    assert dedupe.merge_twins(model.graph, [r, d, e]) == []
    assert all(n.graph is model.graph for n in (r, d, e))


def test_graph_outputs_and_random_ops_keep_their_nodes() -> None:
    model = _twin_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[4] x) => (float[4] a, float[4] b, float[4] c)
    { a = Neg(x)  b = Neg(x)  r1 = RandomUniformLike(x)  r2 = RandomUniformLike(x)
      c = Add(r1, r2) }
    """)
    b, r2 = _node(model, "b"), _node(model, "r2")
    assert dedupe.merge_twins(model.graph, [b, r2]) == []
    assert b.graph is model.graph and r2.graph is model.graph


TWIN_RULES = """
version: 1
rules:
  - id: abs-as-root-of-square
    summary: The absolute value of a negation is the root of the square.
    match:
      - n = Neg(x)
      - z = Abs(n)
    replace:
      - t = Mul(x, x)
      - z = Sqrt(t)
    tests:
      - name: fires
        model: |
          <ir_version: 8, opset_import: ["" : 17]>
          g (float[4] x) => (float[4] z)
          { n = Neg(x)  z = Abs(n) }
        expect: {fires: 1}
      - name: not-neg
        model: |
          <ir_version: 8, opset_import: ["" : 17]>
          g (float[4] x) => (float[4] z)
          { n = Exp(x)  z = Abs(n) }
        expect: {fires: 0}
"""


def test_intermediate_twins_of_two_applications_merge_in_the_rewrite_loop() -> None:
    """Both applications write the intermediate Mul(r, r): merged at once into one node
    (the final CSE would come too late for rules needing one reader of r), and the second
    application lists only what it left in the graph. Outputs are never merged: they carry
    the names of the values they replace."""
    from fusectl.compile import compile_rules
    from fusectl.rewrite import apply_rules
    from fusectl.rulefile import load_rule_text

    model = _twin_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[4] x) => (float[4] a, float[4] b)
    { r = Relu(x)  n1 = Neg(r)  n2 = Neg(r)  a1 = Abs(n1)  b1 = Abs(n2)
      a = Sigmoid(a1)  b = Tanh(b1) }
    """)
    result = apply_rules(model, compile_rules(load_rule_text(TWIN_RULES)))
    first, second = result.applications
    assert sorted(n.op_type for n in model.graph) == ["Mul", "Relu", "Sigmoid", "Sqrt",
                                                      "Sqrt", "Tanh"]
    assert first.created_ops == ("Mul", "Sqrt") and second.created_ops == ("Sqrt",)
    assert len(_node(model, "r").outputs[0].uses()) == 2  # the one Mul reads it twice
    assert {_node(model, name).op_type for name in ("a1", "b1")} == {"Sqrt"}  # boundaries
