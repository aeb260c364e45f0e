"""fusectl.deadcode.remove_unused does exactly what onnx-ir's RemoveUnusedNodesPass does.

Each case runs both on two copies of one model and compares every graph (node order, op
types, input and output names, attributes), the initializers, functions and the serialized
model; the hand-built cases also check what was removed against counts worked out by hand.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import onnx.parser
import onnx_ir as ir
import onnxruntime as ort
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto
from onnx import helper as oh
from onnx_ir.passes.common import RemoveUnusedNodesPass

from fusectl.deadcode import remove_dead_producers, remove_unused

LIGHT = Path(os.path.dirname(onnx.__file__)) / "backend" / "test" / "data" / "light"
F = TensorProto.FLOAT


def _graph_view(graph: ir.Graph | ir.Function) -> list[tuple[object, ...]]:
    """Everything the pass may change in one graph, subgraphs included, in node order."""
    view: list[tuple[object, ...]] = []
    for node in graph:
        attrs = []
        for name, attr in sorted(node.attributes.items()):
            if attr.type == ir.AttributeType.GRAPH:
                attrs.append((name, _graph_view(attr.as_graph())))
            elif attr.type == ir.AttributeType.GRAPHS:
                attrs.append((name, [_graph_view(g) for g in attr.as_graphs()]))
            else:
                attrs.append((name, repr(attr.value)))
        view.append((node.name, node.domain, node.op_type,
                     [None if v is None else v.name for v in node.inputs],
                     [v.name for v in node.outputs], attrs))
    return view


def _model_view(model: ir.Model) -> dict[str, object]:
    return {
        "graph": _graph_view(model.graph),
        "initializers": list(model.graph.initializers),
        "inputs": [v.name for v in model.graph.inputs],
        "outputs": [v.name for v in model.graph.outputs],
        "functions": {key: _graph_view(f) for key, f in model.functions.items()},
    }


def _both(proto: onnx.ModelProto) -> tuple[ir.Model, int]:
    """Run onnx-ir's pass and ours on two copies of ``proto``; assert the results agree and
    return ours with its count."""
    theirs = ir.serde.deserialize_model(proto)
    ours = ir.serde.deserialize_model(proto)
    modified = RemoveUnusedNodesPass()(theirs).modified
    count = remove_unused(ours)
    assert _model_view(ours) == _model_view(theirs)
    assert (ir.to_proto(ours).SerializeToString(deterministic=True)
            == ir.to_proto(theirs).SerializeToString(deterministic=True))
    assert (count > 0) == modified
    return ours, count


def _ops(graph: ir.Graph | ir.Function) -> list[str]:
    return [node.op_type for node in graph]


def _model(nodes: list[onnx.NodeProto], inputs: list[str], outputs: list[str], *,
           initializers: list[onnx.TensorProto] = (), opset: int = 17,
           functions: list[onnx.FunctionProto] = ()) -> onnx.ModelProto:
    graph = oh.make_graph(nodes, "g", [oh.make_tensor_value_info(n, F, [2]) for n in inputs],
                          [oh.make_tensor_value_info(n, F, None) for n in outputs],
                          list(initializers))
    opsets = [oh.make_opsetid("", opset)]
    if functions:
        opsets.append(oh.make_opsetid("local", 1))
    return oh.make_model(graph, opset_imports=opsets, ir_version=10, functions=list(functions))


def _const(name: str, value: float = 1.0) -> onnx.TensorProto:
    return oh.make_tensor(name, F, [2], [value, value])


# --------------------------------------------------------------------------- hand-built


def test_dead_chain_goes_at_once_and_the_live_path_stays() -> None:
    proto = _model([
        oh.make_node("Relu", ["x"], ["a"], name="live1"),
        oh.make_node("Neg", ["a"], ["y"], name="live2"),
        oh.make_node("Exp", ["x"], ["d1"], name="dead1"),
        oh.make_node("Log", ["d1"], ["d2"], name="dead2"),
        oh.make_node("Add", ["d2", "a"], ["d3"], name="dead3"),
    ], ["x"], ["y"])
    model, count = _both(proto)
    assert count == 3
    assert [n.name for n in model.graph] == ["live1", "live2"]
    assert len(model.graph.node("live1").outputs[0].uses()) == 1  # dead3's use is gone


def test_graph_output_produced_by_a_node_is_kept_without_readers() -> None:
    proto = _model([
        oh.make_node("Relu", ["x"], ["y"]),
        oh.make_node("Neg", ["y"], ["z"]),  # an output read by nobody
        oh.make_node("Exp", ["y"], ["unused"]),
    ], ["x"], ["y", "z"])
    model, count = _both(proto)
    assert count == 1
    assert _ops(model.graph) == ["Relu", "Neg"]


def test_initializers_dropped_only_when_unread_and_not_in_the_signature() -> None:
    proto = _model([oh.make_node("Add", ["x", "w_read"], ["y"])], ["x", "w_input"],
                   ["y", "w_output"],
                   initializers=[_const("w_read"), _const("w_input"), _const("w_output"),
                                 _const("w_unread")])
    model, count = _both(proto)
    assert count == 1
    assert sorted(model.graph.initializers) == ["w_input", "w_output", "w_read"]


def test_trailing_omitted_inputs_are_trimmed_middle_ones_kept() -> None:
    proto = _model([
        oh.make_node("Clip", ["x", "", ""], ["a"], name="both_omitted"),
        oh.make_node("Clip", ["a", "", "hi"], ["y"], name="min_omitted"),
    ], ["x"], ["y"], initializers=[oh.make_tensor("hi", F, [], [6.0])])
    model, count = _both(proto)
    assert count == 0
    assert len(model.graph.node("both_omitted").inputs) == 1
    assert [v and v.name for v in model.graph.node("min_omitted").inputs] == ["a", None, "hi"]


@pytest.mark.parametrize(("mask_read", "outputs"), [(False, 1), (True, 2)])
def test_dropout_mask_dropped_only_when_unread(mask_read: bool, outputs: int) -> None:
    nodes = [oh.make_node("Dropout", ["x"], ["y", "mask"])]
    if mask_read:
        nodes.append(oh.make_node("Not", ["mask"], ["keep"]))
    proto = _model(nodes, ["x"], ["y", *(["keep"] if mask_read else [])])
    model, _ = _both(proto)
    assert len(model.graph[0].outputs) == outputs


def _batch_norm(opset: int, outputs: list[str], **attrs: int) -> onnx.ModelProto:
    stats = [_const(n) for n in ("s", "b", "m", "v")]
    node = oh.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], outputs, **attrs)
    return _model([node], ["x"], ["y"], initializers=stats, opset=opset)


def test_batch_norm_in_inference_mode_loses_its_statistics_outputs_and_mode() -> None:
    model, count = _both(_batch_norm(15, ["y", "mean", "var"], training_mode=0))
    assert count == 0
    node = model.graph[0]
    assert [v.name for v in node.outputs] == ["y"]
    assert "training_mode" not in node.attributes


def test_batch_norm_in_training_mode_keeps_everything() -> None:
    model, _ = _both(_batch_norm(15, ["y", "mean", "var"], training_mode=1))
    node = model.graph[0]
    assert [v.name for v in node.outputs] == ["y", "mean", "var"]
    assert node.attributes["training_mode"].as_int() == 1


def test_batch_norm_before_opset_14_keeps_its_outputs() -> None:
    """Opset 9: the number of outputs is the training switch."""
    model, _ = _both(_batch_norm(9, ["y", "mean", "var", "saved_mean", "saved_var"]))
    assert len(model.graph[0].outputs) == 5


def test_unused_middle_optional_output_is_unnamed_not_dropped() -> None:
    """LSTM: Y (unused) and Y_h (read); Y is renamed "" but stays as a placeholder."""
    w = oh.make_tensor("W", F, [1, 4, 2], [0.1] * 8)
    r = oh.make_tensor("R", F, [1, 4, 1], [0.1] * 4)
    proto = _model([oh.make_node("LSTM", ["x", "W", "R"], ["all", "last"], hidden_size=1)],
                   ["x"], ["last"], initializers=[w, r])
    model, _ = _both(proto)
    assert [v.name for v in model.graph[0].outputs] == ["", "last"]


def test_attention_keeps_its_unread_present_outputs() -> None:
    """Unlike onnx-ir's pass: onnxruntime refuses an Attention with past key and value that
    writes present_key but not present_value, so Attention's outputs are never trimmed."""
    proto = onnx.parser.parse_model("""
        <ir_version: 10, opset_import: ["" : 23]>
        g (float[1,2,3,4] q, float[1,2,3,4] k, float[1,2,3,4] v, float[1,2,2,4] pk,
           float[1,2,2,4] pv) => (float[1,2,3,4] y, float[1,2,5,4] prk)
        { y, prk, prv = Attention(q, k, v, , pk, pv) }""")
    model = ir.serde.deserialize_model(proto)
    remove_unused(model)
    assert [v.name for v in model.graph[0].outputs] == ["y", "prk", "prv"]
    session = ort.InferenceSession(ir.to_proto(model).SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    feeds = {i.name: np.ones(i.shape, np.float32) for i in session.get_inputs()}
    assert session.run(None, feeds)[1].shape == (1, 2, 5, 4)


def _branch(name: str, nodes: list[onnx.NodeProto], output: str) -> onnx.GraphProto:
    return oh.make_graph(nodes, name, [], [oh.make_tensor_value_info(output, F, None)])


def test_if_branches_lose_their_dead_nodes_and_keep_outer_producers_alive() -> None:
    then = _branch("then", [oh.make_node("Neg", ["outer"], ["t"]),
                            oh.make_node("Exp", ["outer"], ["t_dead"])], "t")
    other = _branch("else", [oh.make_node("Relu", ["x"], ["e"]),
                             oh.make_node("Log", ["e"], ["e_dead1"]),
                             oh.make_node("Exp", ["e_dead1"], ["e_dead2"])], "e")
    proto = _model([
        oh.make_node("Abs", ["x"], ["outer"]),  # read only inside the then branch
        oh.make_node("ReduceSum", ["x"], ["s"], keepdims=0),
        oh.make_node("Cast", ["s"], ["cond"], to=TensorProto.BOOL),
        oh.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=other),
    ], ["x"], ["y"])
    model, count = _both(proto)
    assert count == 3
    assert _ops(model.graph) == ["Abs", "ReduceSum", "Cast", "If"]
    branches = model.graph[3].attributes
    assert _ops(branches["then_branch"].as_graph()) == ["Neg"]
    assert _ops(branches["else_branch"].as_graph()) == ["Relu"]


def test_loop_body_and_subgraphs_of_dead_nodes() -> None:
    body = oh.make_graph(
        [oh.make_node("Identity", ["cond_in"], ["cond_out"]),
         oh.make_node("Add", ["acc_in", "x"], ["acc_out"]),
         oh.make_node("Mul", ["acc_in", "acc_in"], ["square_dead"])],
        "body",
        [oh.make_tensor_value_info("i", TensorProto.INT64, []),
         oh.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         oh.make_tensor_value_info("acc_in", F, [2])],
        [oh.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         oh.make_tensor_value_info("acc_out", F, [2])])
    dead_body = oh.make_graph(
        [oh.make_node("Identity", ["c"], ["c2"]), oh.make_node("Neg", ["a"], ["gone"]),
         oh.make_node("Identity", ["a"], ["a2"])], "dead_body",
        [oh.make_tensor_value_info("j", TensorProto.INT64, []),
         oh.make_tensor_value_info("c", TensorProto.BOOL, []),
         oh.make_tensor_value_info("a", F, [2])],
        [oh.make_tensor_value_info("c2", TensorProto.BOOL, []),
         oh.make_tensor_value_info("a2", F, [2])])
    n = oh.make_tensor("n", TensorProto.INT64, [], [3])
    proto = _model([
        oh.make_node("Loop", ["n", "", "x"], ["y"], body=body),
        oh.make_node("Loop", ["n", "", "x"], ["z"], body=dead_body),  # dead: not descended
    ], ["x"], ["y"], initializers=[n])
    model, count = _both(proto)
    assert count == 2  # the dead Loop and the body's Mul
    assert _ops(model.graph) == ["Loop"]
    assert _ops(model.graph[0].attributes["body"].as_graph()) == ["Identity", "Add"]


def test_function_bodies_lose_their_dead_nodes() -> None:
    function = oh.make_function(
        "local", "Twice", ["a"], ["b"],
        [oh.make_node("Add", ["a", "a"], ["b"]), oh.make_node("Neg", ["a"], ["nobody"]),
         oh.make_node("Dropout", ["a"], ["dropped", "mask"])],
        [oh.make_opsetid("", 17)])
    proto = _model([oh.make_node("Twice", ["x"], ["y"], domain="local")], ["x"], ["y"],
                   functions=[function])
    model, count = _both(proto)
    assert count == 2
    assert _ops(next(iter(model.functions.values()))) == ["Add"]


def test_unknown_ops_keep_their_outputs() -> None:
    proto = _model([oh.make_node("Custom", ["x"], ["y", "unused"], domain="vendor")],
                   ["x"], ["y"])
    proto.opset_import.append(oh.make_opsetid("vendor", 1))
    model, count = _both(proto)
    assert count == 0
    assert [v.name for v in model.graph[0].outputs] == ["y", "unused"]


# --------------------------------------------------------------------------- real models


@pytest.mark.parametrize("name", ["squeezenet", "shufflenet", "inception_v1"])
def test_light_models_cut_in_the_middle(name: str) -> None:
    """The onnx wheel's light models, with the output moved to a value half way: the whole
    second half is dead, and the node count left is the first half's."""
    proto = onnx.load(LIGHT / f"light_{name}.onnx")
    middle = len(proto.graph.node) // 2
    node = proto.graph.node[middle]
    del proto.graph.output[:]
    proto.graph.output.append(oh.make_empty_tensor_value_info(node.output[0]))
    model, count = _both(proto)
    assert len(model.graph) <= middle + 1  # everything after the new output is dead
    assert count >= len(proto.graph.node) - middle - 1
    assert model.graph[len(model.graph) - 1].outputs[0].name == node.output[0]


@pytest.mark.parametrize("name", ["resnet50", "densenet121"])
def test_light_models_as_they_are(name: str) -> None:
    _both(onnx.load(LIGHT / f"light_{name}.onnx"))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, in onnx's case generators
def test_onnx_node_test_models() -> None:
    """Every model of onnx's node tests (generated in memory: Dropout and BatchNormalization
    with and without their optional outputs, LSTM/GRU/RNN, If/Loop/Scan bodies, ...): the
    same result, and the cases with something to remove are among them."""
    from onnx.backend.test.loader import load_model_tests

    modified = with_subgraphs = 0
    for test in load_model_tests(kind="node"):
        if test.model is None:
            continue
        _, count = _both(test.model)
        modified += count > 0
        with_subgraphs += any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
                              for node in test.model.graph.node for a in node.attribute)
    assert modified > 50 and with_subgraphs > 20


# --------------------------------------------------------------------------- property


UNARY = ("Relu", "Neg", "Exp")


@st.composite
def random_models(draw: st.DrawFn) -> onnx.ModelProto:
    """A small DAG over Relu/Neg/Exp/Add/Dropout/Clip/BatchNormalization/If with random
    readers, random graph outputs and initializers of which some are read, some not and
    some are graph inputs."""
    values = ["x"]
    initializers = [_const(f"w{i}", float(i)) for i in range(draw(st.integers(0, 3)))]
    listed = [t.name for t in initializers if draw(st.booleans())]
    values += [t.name for t in initializers]
    nodes = []
    for i in range(draw(st.integers(1, 12))):
        pick = st.sampled_from(values)
        kind = draw(st.sampled_from(("unary", "Add", "Dropout", "Clip", "BN", "If")))
        out = f"v{i}"
        if kind == "unary":
            nodes.append(oh.make_node(draw(st.sampled_from(UNARY)), [draw(pick)], [out]))
        elif kind == "Add":
            nodes.append(oh.make_node("Add", [draw(pick), draw(pick)], [out]))
        elif kind == "Dropout":
            nodes.append(oh.make_node("Dropout", [draw(pick)], [out, f"m{i}"]))
        elif kind == "Clip":
            bounds = draw(st.sampled_from(([], [""], ["", ""], ["", "x"])))
            nodes.append(oh.make_node("Clip", [draw(pick), *bounds], [out]))
        elif kind == "BN":
            mode = draw(st.sampled_from((None, 0, 1)))
            extra = {} if mode is None else {"training_mode": mode}
            stats = [_const(f"bn{i}_{k}") for k in "sbmv"]
            initializers += stats
            nodes.append(oh.make_node("BatchNormalization",
                                      [draw(pick), *(t.name for t in stats)],
                                      [out, f"mean{i}", f"var{i}"], **extra))
        else:
            inner, other = draw(pick), draw(pick)
            then = _branch(f"then{i}", [oh.make_node("Neg", [inner], [f"t{i}"]),
                                        oh.make_node("Exp", [other], [f"td{i}"])], f"t{i}")
            els = _branch(f"else{i}", [oh.make_node("Relu", [other], [f"e{i}"])], f"e{i}")
            nodes += [oh.make_node("Cast", [draw(pick)], [f"c{i}"], to=TensorProto.BOOL),
                      oh.make_node("ReduceMin", [f"c{i}"], [f"cc{i}"], keepdims=0),
                      oh.make_node("If", [f"cc{i}"], [out], then_branch=then,
                                   else_branch=els)]
        values.append(out)
        values += [o for o in nodes[-1].output if o != out]
    outputs = draw(st.lists(st.sampled_from(values[1:]), min_size=1, max_size=3, unique=True))
    graph = oh.make_graph(nodes, "random",
                          [oh.make_tensor_value_info(n, F, [2]) for n in ["x", *listed]],
                          [oh.make_empty_tensor_value_info(n) for n in outputs], initializers)
    opset = draw(st.sampled_from((13, 15, 17)))
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", opset)], ir_version=8)


@settings(max_examples=150, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(random_models())
def test_random_dags_match_onnx_ir(proto: onnx.ModelProto) -> None:
    _both(proto)


def test_remove_dead_producers_takes_only_what_the_lost_reader_left_dead() -> None:
    """The shape arithmetic of a replaced Reshape goes; a producer another node still
    reads, and one whose output is a graph output, stay."""
    import onnx.parser

    model = ir.serde.deserialize_model(onnx.parser.parse_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N,4] x) => (float[N,4] y, int64[2] kept)
        <int64[1] m1 = {-1}>
        {
          s = Shape(x)  n = Shape<start=0, end=1>(x)  t = Concat<axis=0>(n, m1)
          kept = Identity(s)  both = Concat<axis=0>(s, m1)  a = Relu(x)
          r = Reshape(a, t)  y = Neg(a)
        }
    """))
    graph = model.graph
    reshape = next(n for n in graph if n.op_type == "Reshape")
    read = [v for v in reshape.inputs if v is not None]
    graph.remove(reshape, safe=False)
    for value in read:  # detach as an application's removal does
        for use in list(value.uses()):
            if use.node is reshape:
                reshape.replace_input_with(use.idx, None)
    lost = remove_dead_producers(graph, read)
    ops = [n.op_type for n in graph]
    assert ops.count("Concat") == 1 and ops.count("Shape") == 1  # t and n gone, `both` dead
    assert "Relu" in ops and "Identity" in ops  # a is read by Neg; kept is a graph output
    assert {v.name for v in lost} >= {"n", "m1"}
