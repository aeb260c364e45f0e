"""Foreign models: the onnx wheel's backend test data through ``fusectl.api.optimize``.

Every model (light, pytorch-converted, pytorch-operator, simple; with FUSECTL_FULL_SWEEP=1
all of them plus the generated node tests, on both targets) must optimize without a crash,
keep its graph input/output signature, and compute the outputs shipped beside it
(``output_*.pb``) on onnxruntime. Models onnxruntime itself cannot run are skipped with the
reason. Without the variable a representative subset runs (a few seconds).

Also hand-built models the rules must not break: control flow bodies, local functions, QDQ
quantization, initializers that are graph inputs, and weights shared by two Convs.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx.helper as oh
import onnx.parser
import onnxruntime as ort
import pytest
from onnx import TensorProto
from onnx import numpy_helper as nh

import fusectl
from fusectl.modelio import save_model
from fusectl.validate import ValidationOptions

DATA = Path(os.path.dirname(onnx.__file__)) / "backend" / "test" / "data"
FULL = os.environ.get("FUSECTL_FULL_SWEEP") == "1"
#: The CI subset: convolutions (grouped, depthwise, dilated, 1-D/3-D, transposed), pooling,
#: linear layers, layout ops, a light CNN with legacy (IR 3) initializer inputs, a sequence
#: model, and one model onnxruntime cannot run (structure checks only).
SUBSET = {
    "light/light_squeezenet", "pytorch-converted/test_Conv2d_depthwise_padded",
    "pytorch-converted/test_Conv2d_groups", "pytorch-converted/test_Conv1d_dilated",
    "pytorch-converted/test_Conv3d_stride_padding", "pytorch-converted/test_ConvTranspose2d",
    "pytorch-converted/test_Linear_no_bias", "pytorch-converted/test_MaxPool2d",
    "pytorch-converted/test_Embedding", "pytorch-converted/test_LogSoftmax",
    "pytorch-operator/test_operator_conv", "pytorch-operator/test_operator_permute2",
    "pytorch-operator/test_operator_view", "pytorch-operator/test_operator_reduced_mean",
    "simple/test_expand_shape_model1", "simple/test_sequence_model1",
    "pytorch-converted/test_BatchNorm2d_eval",  # opset 6: structure only (no onnxruntime)
}
TARGETS = ("onnx", "onnxruntime") if FULL else ("onnx",)


@dataclass
class Case:
    """One model with its input and expected output sets."""

    name: str
    model: onnx.ModelProto
    data_sets: list[tuple[list[Any], list[Any]]]
    rtol: float = 1e-3
    atol: float = 1e-7
    notes: list[str] = field(default_factory=list)


def _read_value(path: str, type_proto: onnx.TypeProto) -> Any:
    data = Path(path).read_bytes()
    if type_proto.HasField("sequence_type"):
        seq = onnx.SequenceProto()
        seq.ParseFromString(data)
        return nh.to_list(seq)
    if type_proto.HasField("optional_type"):
        opt = onnx.OptionalProto()
        opt.ParseFromString(data)
        return nh.to_optional(opt)
    tensor = TensorProto()
    tensor.ParseFromString(data)
    return nh.to_array(tensor)


def _runtime_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    inits = {t.name for t in model.graph.initializer}
    return [i for i in model.graph.input if i.name not in inits]


def _folder_case(kind: str, folder: Path) -> Case:
    model = onnx.load(folder / "model.onnx")
    tol = json.loads((folder / "data.json").read_text()) if (folder / "data.json").exists() else {}
    sets = []
    for ds in sorted(glob.glob(str(folder / "test_data_set_*"))):
        ins = [_read_value(f"{ds}/input_{i}.pb", v.type)
               for i, v in enumerate(model.graph.input)
               if os.path.exists(f"{ds}/input_{i}.pb")]
        outs = [_read_value(f"{ds}/output_{i}.pb", v.type)
                for i, v in enumerate(model.graph.output)
                if os.path.exists(f"{ds}/output_{i}.pb")]
        sets.append((ins, outs))
    return Case(f"{kind}/{folder.name}", model, sets, tol.get("rtol", 1e-3),
                tol.get("atol", 1e-7))


def _light_case(path: Path) -> Case:
    """Light models ship only outputs; their input is what onnx's runner generates:
    arange(n)/n in the input's shape (unknown dims 1). Tolerances from real/*/data.json."""
    model = onnx.load(path)
    inputs = []
    for value in _runtime_inputs(model):
        dims = [d.dim_value if d.HasField("dim_value") else 1
                for d in value.type.tensor_type.shape.dim]
        n = int(np.prod(dims))
        inputs.append((np.arange(n).reshape(dims) / n).astype(np.float32))
    stem = path.name[: -len(".onnx")]
    outputs = [_read_value(str(path.with_name(f"{stem}_output_{i}.pb")), v.type)
               for i, v in enumerate(model.graph.output)]
    real = DATA / "real" / f"test_{stem.removeprefix('light_')}" / "data.json"
    tol = json.loads(real.read_text()) if real.exists() else {}
    return Case(f"light/{stem}", model, [(inputs, outputs)], tol.get("rtol", 1e-3),
                tol.get("atol", 1e-7))


def _node_cases() -> Iterator[Case]:
    """onnx's node tests, generated in memory (the wheel does not ship their files)."""
    from onnx.backend.test.loader import load_model_tests

    for test in load_model_tests(kind="node"):
        if test.model is None or not test.data_sets:
            continue
        sets = [([nh.to_array(x) if isinstance(x, TensorProto) else x for x in ins],
                 [nh.to_array(x) if isinstance(x, TensorProto) else x for x in outs])
                for ins, outs in test.data_sets]
        yield Case(f"node/{test.name}", test.model, sets, test.rtol, test.atol)


def _case_ids() -> list[str]:
    ids = [f"light/{p.name[:-5]}" for p in sorted((DATA / "light").glob("*.onnx"))]
    for kind in ("pytorch-converted", "pytorch-operator", "simple"):
        ids += [f"{kind}/{p.name}" for p in sorted((DATA / kind).iterdir())
                if (p / "model.onnx").exists()]
    return ids if FULL else [i for i in ids if i in SUBSET]


def load_case(case_id: str) -> Case:
    kind, name = case_id.split("/", 1)
    if kind == "light":
        return _light_case(DATA / "light" / f"{name}.onnx")
    return _folder_case(kind, DATA / kind / name)


# ------------------------------------------------------------------------------- running


def _session(path: Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _run(session: ort.InferenceSession, model: onnx.ModelProto, inputs: list[Any]) -> list[Any]:
    names = [v.name for v in _runtime_inputs(model)]
    return session.run(None, dict(zip(names, inputs, strict=False)))


def _close(actual: Any, expected: Any, rtol: float, atol: float) -> bool:
    if isinstance(expected, list):
        return isinstance(actual, list) and len(actual) == len(expected) and all(
            _close(a, e, rtol, atol) for a, e in zip(actual, expected, strict=True))
    if expected is None:
        return actual is None
    actual, expected = np.asarray(actual), np.asarray(expected)
    if actual.shape != expected.shape:
        return False
    if expected.dtype.kind in "OUSb" or expected.dtype.kind in "iu":
        return bool(np.array_equal(actual, expected))
    return bool(np.allclose(actual.astype(np.float64), expected.astype(np.float64), rtol=rtol,
                            atol=atol, equal_nan=True))


def _signature(model: onnx.ModelProto) -> tuple:
    inputs = [(v.name, v.type.SerializeToString()) for v in _runtime_inputs(model)]
    outputs = [(v.name, v.type.SerializeToString()) for v in model.graph.output]
    return inputs, outputs


_RULES: dict[str, list] = {}


def rules_for(target: str) -> list:
    """The built-in library compiled once per target (loading it is most of a small run)."""
    if target not in _RULES:
        _RULES[target] = fusectl.load_rule_set(target=target)
    return _RULES[target]


def sweep_one(case: Case, folder: Path, target: str = "onnx") -> str:
    """Optimize ``case`` and check it; returns how the outputs were judged. When onnxruntime
    cannot run the original model, only the structure is checked and the test skips."""
    original = folder / "original.onnx"
    original.write_bytes(case.model.SerializeToString())
    try:
        reference = _session(original)
        ref_outputs = [_run(reference, case.model, ins) for ins, _ in case.data_sets]
        not_runnable = None
    except Exception as exc:  # noqa: BLE001 - onnxruntime's own limits, not ours
        not_runnable = str(exc).splitlines()[0][:200]
    reference = None
    result = fusectl.optimize(original, rules=rules_for(target), target=target, check=False)
    optimized = folder / "optimized.onnx"
    save_model(result.model, optimized)
    saved = onnx.load(optimized)
    assert _signature(saved) == _signature(case.model), "graph input/output signature changed"
    onnx.checker.check_model(saved)
    if not_runnable:
        pytest.skip(f"structure checked; onnxruntime cannot run the original: {not_runnable}")
    session = _session(optimized)
    judged = "shipped"
    for (ins, shipped), ref in zip(case.data_sets, ref_outputs, strict=True):
        actual = _run(session, saved, ins)
        for i, expected in enumerate(shipped):
            if _close(ref[i], expected, case.rtol, case.atol):
                assert _close(actual[i], expected, case.rtol, case.atol), \
                    f"output {i} differs from the shipped output_{i}.pb"
            else:  # onnxruntime itself differs from the shipped data: hold to the original
                judged = "original"
                assert _close(actual[i], ref[i], max(case.rtol, 1e-4), max(case.atol, 1e-5)), \
                    f"output {i} differs from the original model's on onnxruntime"
    return judged


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("case_id", _case_ids())
def test_foreign_model(tmp_path: Path, case_id: str, target: str) -> None:
    sweep_one(load_case(case_id), tmp_path, target)


@pytest.mark.skipif(not FULL, reason="FUSECTL_FULL_SWEEP=1 runs onnx's generated node tests")
def test_node_tests_sweep(tmp_path: Path) -> None:
    """All node tests in one test (about 1,500 models): counts are printed."""
    counts: dict[str, int] = {"shipped": 0, "original": 0, "skipped": 0}
    failures: list[str] = []
    for case in _node_cases():
        folder = tmp_path / case.name.replace("/", "_")
        folder.mkdir()
        for target in TARGETS:
            try:
                counts[sweep_one(case, folder, target)] += 1
            except pytest.skip.Exception:
                counts["skipped"] += 1
                break
            except Exception as exc:  # noqa: BLE001 - collected, reported together
                failures.append(f"{case.name} [{target}]: {type(exc).__name__}: "
                                f"{str(exc).splitlines()[0][:300] if str(exc) else ''}")
    print(f"node tests: {counts}, failures {len(failures)}")
    assert not failures, "\n".join(failures)


# ------------------------------------------------------------------- hand-built models

RNG = np.random.default_rng(6)


def _f32(*shape: int, lo: float = -1.0, hi: float = 1.0) -> np.ndarray:
    return RNG.uniform(lo, hi, shape).astype(np.float32)


def _bn_inits(prefix: str, channels: int) -> list[TensorProto]:
    return [nh.from_array(_f32(channels, lo=0.5, hi=1.5), f"{prefix}_s"),
            nh.from_array(_f32(channels), f"{prefix}_b"),
            nh.from_array(_f32(channels), f"{prefix}_m"),
            nh.from_array(_f32(channels, lo=0.5, hi=2.0), f"{prefix}_v")]


def _conv_bn(x: str, w: str, prefix: str, out: str) -> list[onnx.NodeProto]:
    return [oh.make_node("Conv", [x, w], [f"{prefix}_c"], pads=[1, 1, 1, 1]),
            oh.make_node("BatchNormalization", [f"{prefix}_c", f"{prefix}_s", f"{prefix}_b",
                                                f"{prefix}_m", f"{prefix}_v"], [out])]


def _model(nodes, inputs, outputs, inits, opset: int = 17, ir_version: int = 8,
           functions=()) -> onnx.ModelProto:
    graph = oh.make_graph(nodes, "g", inputs, outputs, inits)
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", opset),
                                                *[oh.make_opsetid(f.domain, 1) for f in functions]],
                          ir_version=ir_version, functions=list(functions))
    onnx.checker.check_model(model, full_check=True)
    return model


def _tensor(name: str, shape: list[int] | None, dtype: int = TensorProto.FLOAT):
    return oh.make_tensor_value_info(name, dtype, shape)


@dataclass
class Optimized:
    model: onnx.ModelProto
    result: Any


def optimize_and_compare(model: onnx.ModelProto, folder: Path, feeds: list[dict[str, Any]],
                         target: str = "onnx") -> Optimized:
    """Optimize (with fusectl's own validation), save, check, and compare the two models on
    onnxruntime for every feed set (fusectl's fp32 tolerance)."""
    original = folder / f"original-{target}.onnx"
    original.write_bytes(model.SerializeToString())
    result = fusectl.optimize(original, rules=rules_for(target), target=target,
                              validation=ValidationOptions(inputs=feeds[0]))
    assert result.passed, result.validation
    optimized = folder / f"optimized-{target}.onnx"
    save_model(result.model, optimized)
    saved = onnx.load(optimized)
    onnx.checker.check_model(saved, full_check=True)
    assert _signature(saved) == _signature(model)
    before, after = _session(original), _session(optimized)
    for feed in feeds:
        for want, got in zip(before.run(None, feed), after.run(None, feed), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    return Optimized(saved, result)


def _ops(graph: onnx.GraphProto) -> list[str]:
    return [n.op_type for n in graph.node]


def _branch(name: str, prefix: str, w: str) -> onnx.GraphProto:
    """A subgraph: Conv(x, W from the outer scope) -> BN -> out (no inputs of its own)."""
    return oh.make_graph(_conv_bn("x", w, prefix, f"{prefix}_out"), name, [],
                         [_tensor(f"{prefix}_out", [1, 4, 6, 6])], _bn_inits(prefix, 4))


@pytest.mark.parametrize("target", ["onnx", "onnxruntime"])
def test_if_branches_are_rewritten_or_intact_never_broken(tmp_path: Path, target: str) -> None:
    node = oh.make_node("If", ["cond"], ["y"], then_branch=_branch("then", "t", "W1"),
                        else_branch=_branch("else", "e", "W2"))
    model = _model([node], [_tensor("cond", [], TensorProto.BOOL), _tensor("x", [1, 3, 6, 6])],
                   [_tensor("y", [1, 4, 6, 6])],
                   [nh.from_array(_f32(4, 3, 3, 3), "W1"), nh.from_array(_f32(4, 3, 3, 3), "W2")])
    x = _f32(1, 3, 6, 6)
    done = optimize_and_compare(model, tmp_path, [{"cond": np.array(c), "x": x}
                                                  for c in (True, False)], target)
    (if_node,) = done.model.graph.node
    for attr in if_node.attribute:
        assert "BatchNormalization" not in _ops(attr.g), "Conv+BN inside a branch is folded"


def test_loop_body_with_conv_bn(tmp_path: Path) -> None:
    body = oh.make_graph(
        [oh.make_node("Identity", ["c_in"], ["c_out"]),
         *_conv_bn("x_in", "W", "l", "l_bn"), oh.make_node("Relu", ["l_bn"], ["x_out"])],
        "body", [_tensor("i", [], TensorProto.INT64), _tensor("c_in", [], TensorProto.BOOL),
                 _tensor("x_in", [1, 4, 5, 5])],
        [_tensor("c_out", [], TensorProto.BOOL), _tensor("x_out", [1, 4, 5, 5])],
        _bn_inits("l", 4))
    loop = oh.make_node("Loop", ["n", "", "x"], ["y"], body=body)
    model = _model([loop], [_tensor("n", [], TensorProto.INT64), _tensor("x", [1, 4, 5, 5])],
                   [_tensor("y", [1, 4, 5, 5])], [nh.from_array(_f32(4, 4, 3, 3) / 3, "W")])
    feeds = [{"n": np.array(k, np.int64), "x": _f32(1, 4, 5, 5)} for k in (0, 1, 3)]
    done = optimize_and_compare(model, tmp_path, feeds)
    (loop_node,) = done.model.graph.node
    assert "BatchNormalization" not in _ops(loop_node.attribute[0].g)


def test_scan_body_with_matmul_add(tmp_path: Path) -> None:
    body = oh.make_graph(
        [oh.make_node("MatMul", ["x_t", "W"], ["m"]), oh.make_node("Add", ["m", "b"], ["a"]),
         oh.make_node("Add", ["s_in", "a"], ["s_out"]), oh.make_node("Relu", ["a"], ["y_t"])],
        "body", [_tensor("s_in", [2, 4]), _tensor("x_t", [2, 3])],
        [_tensor("s_out", [2, 4]), _tensor("y_t", [2, 4])],
        [nh.from_array(_f32(4), "b")])
    scan = oh.make_node("Scan", ["s0", "xs"], ["s", "ys"], body=body, num_scan_inputs=1)
    model = _model([scan], [_tensor("s0", [2, 4]), _tensor("xs", [5, 2, 3])],
                   [_tensor("s", [2, 4]), _tensor("ys", [5, 2, 4])],
                   [nh.from_array(_f32(3, 4), "W")])
    optimize_and_compare(model, tmp_path, [{"s0": _f32(2, 4), "xs": _f32(5, 2, 3)}])


def test_local_function_calls_are_kept_working(tmp_path: Path) -> None:
    """A local function holding a Conv+BN (weights passed in): calls keep working whether or
    not the function body is rewritten."""
    fn = oh.make_function(
        "local", "ConvBN", ["x", "W", "s", "b", "m", "v"], ["y"],
        [oh.make_node("Conv", ["x", "W"], ["c"], pads=[1, 1, 1, 1]),
         oh.make_node("BatchNormalization", ["c", "s", "b", "m", "v"], ["y"])],
        [oh.make_opsetid("", 17)])
    nodes = [oh.make_node("ConvBN", ["x", "W", "p_s", "p_b", "p_m", "p_v"], ["h"],
                          domain="local"),
             oh.make_node("ConvBN", ["h", "W2", "p_s", "p_b", "p_m", "p_v"], ["y"],
                          domain="local")]
    model = _model(nodes, [_tensor("x", [1, 4, 6, 6])], [_tensor("y", [1, 4, 6, 6])],
                   [nh.from_array(_f32(4, 4, 3, 3), "W"), nh.from_array(_f32(4, 4, 3, 3), "W2"),
                    *_bn_inits("p", 4)], functions=[fn])
    done = optimize_and_compare(model, tmp_path, [{"x": _f32(1, 4, 6, 6)}])
    assert [f.name for f in done.model.functions] == ["ConvBN"]


def _qdq_conv_bn() -> onnx.ModelProto:
    """x -> Q -> DQ -> Conv(W = DQ(int8 weights)) -> BN: a QDQ model as quantizers write it."""
    w_q = RNG.integers(-100, 100, (4, 3, 3, 3)).astype(np.int8)
    nodes = [
        oh.make_node("QuantizeLinear", ["x", "x_scale", "x_zp"], ["x_q"]),
        oh.make_node("DequantizeLinear", ["x_q", "x_scale", "x_zp"], ["x_dq"]),
        oh.make_node("DequantizeLinear", ["w_q", "w_scale", "w_zp"], ["w_dq"]),
        *_conv_bn("x_dq", "w_dq", "q", "y"),
    ]
    inits = [nh.from_array(w_q, "w_q"), nh.from_array(np.float32(0.01), "w_scale"),
             nh.from_array(np.int8(0), "w_zp"), nh.from_array(np.float32(0.02), "x_scale"),
             nh.from_array(np.uint8(128), "x_zp"), *_bn_inits("q", 4)]
    return _model(nodes, [_tensor("x", [1, 3, 6, 6])], [_tensor("y", [1, 4, 6, 6])], inits)


@pytest.mark.parametrize("target", ["onnx", "onnxruntime"])
def test_qdq_pairs_are_not_broken(tmp_path: Path, target: str) -> None:
    """Folding BN into the Conv must not fold the dequantized weight into a float constant:
    the quantized weight and both Q/DQ pairs must survive for a quantizing runtime."""
    done = optimize_and_compare(_qdq_conv_bn(), tmp_path, [{"x": _f32(1, 3, 6, 6)}], target)
    ops = _ops(done.model.graph)
    assert ops.count("DequantizeLinear") == 2 and ops.count("QuantizeLinear") == 1, ops
    (w_dq,) = [n for n in done.model.graph.node
               if n.op_type == "DequantizeLinear" and n.input[0] == "w_q"]
    conv = next(n for n in done.model.graph.node if n.op_type in ("Conv", "FusedConv"))
    assert conv.input[1] == w_dq.output[0], "the Conv must still read the dequantized weight"


def test_initializer_that_is_a_graph_input_is_not_a_constant(tmp_path: Path) -> None:
    """IR >= 4: an initializer listed as a graph input is a default the caller may override;
    folding it would bake the default in."""
    nodes = _conv_bn("x", "W", "g", "y")
    w = _f32(4, 3, 3, 3)
    model = _model(nodes, [_tensor("x", [1, 3, 6, 6]), _tensor("W", [4, 3, 3, 3])],
                   [_tensor("y", [1, 4, 6, 6])], [nh.from_array(w, "W"), *_bn_inits("g", 4)])
    x = _f32(1, 3, 6, 6)
    done = optimize_and_compare(model, tmp_path, [{"x": x}, {"x": x, "W": -w}, {"x": x, "W": w}])
    assert "BatchNormalization" in _ops(done.model.graph)
    assert "W" in [i.name for i in done.model.graph.input]


def test_legacy_initializer_inputs_are_constants(tmp_path: Path) -> None:
    """IR 3 lists every initializer as an input; onnxruntime treats them as constants and so
    does fusectl: the fold happens and the (new) initializers are listed again."""
    nodes = _conv_bn("x", "W", "g", "y")
    inits = [nh.from_array(_f32(4, 3, 3, 3), "W"), *_bn_inits("g", 4)]
    inputs = [_tensor("x", [1, 3, 6, 6]),
              *[_tensor(t.name, list(t.dims)) for t in inits]]
    model = _model(nodes, inputs, [_tensor("y", [1, 4, 6, 6])], inits, opset=9, ir_version=3)
    original = tmp_path / "legacy.onnx"
    original.write_bytes(model.SerializeToString())
    result = fusectl.optimize(original, rules=rules_for("onnx"))
    assert result.passed and "BatchNormalization" not in result.ops_after
    save_model(result.model, tmp_path / "out.onnx")
    saved = onnx.load(tmp_path / "out.onnx")
    assert {t.name for t in saved.graph.initializer} <= {i.name for i in saved.graph.input}


@pytest.mark.parametrize("second", ["bn", "plain"])
def test_shared_weight_with_two_consumers(tmp_path: Path, second: str) -> None:
    """One W, two Convs (on different inputs, so they are not one computation). Folding BN
    into the first must give it FRESH weights: the second Conv (folded with other statistics,
    or plain) still computes with the original W."""
    w = _f32(4, 3, 3, 3)
    nodes = _conv_bn("xa", "W", "a", "ya")
    inits = [nh.from_array(w, "W"), *_bn_inits("a", 4)]
    if second == "bn":
        nodes += _conv_bn("xb", "W", "b", "yb")
        inits += _bn_inits("b", 4)
    else:
        nodes.append(oh.make_node("Conv", ["xb", "W"], ["yb"], pads=[1, 1, 1, 1]))
    model = _model(nodes, [_tensor("xa", [1, 3, 6, 6]), _tensor("xb", [1, 3, 6, 6])],
                   [_tensor("ya", [1, 4, 6, 6]), _tensor("yb", [1, 4, 6, 6])], inits)
    done = optimize_and_compare(model, tmp_path, [{"xa": _f32(1, 3, 6, 6),
                                                   "xb": _f32(1, 3, 6, 6)}])
    assert "BatchNormalization" not in _ops(done.model.graph)
    assert done.result.rewrite.counts().get("conv-bn-fold") == (2 if second == "bn" else 1)
    if second == "plain":
        plain = [n for n in done.model.graph.node if n.output[0] == "yb"]
        assert plain and plain[0].op_type == "Conv"
        weights = {t.name: nh.to_array(t) for t in done.model.graph.initializer}
        np.testing.assert_array_equal(weights[plain[0].input[1]], w)


# ---------------------------------------------------- regressions found by the full sweep


@pytest.mark.parametrize("name", ["test_sequence_model5", "test_sequence_model8"])
def test_sequence_folding_respects_the_model_opset(tmp_path: Path, name: str) -> None:
    """onnxscript's folder turns sequence ops into opset-13 Unsqueeze/Split whatever the
    model's opset; below 13 such models are not folded."""
    result = fusectl.optimize(DATA / "simple" / name / "model.onnx", rules=[], check=False)
    save_model(result.model, tmp_path / "o.onnx")
    onnx.checker.check_model(onnx.load(tmp_path / "o.onnx"))


def test_split_to_sequence_with_a_runtime_split(tmp_path: Path) -> None:
    """onnxscript's folder raises on this node; preparation keeps the model as it was."""
    model = onnx.parser.parse_model("""
        <ir_version: 10, opset_import: ["" : 21]>
        g (float[3,6] data, int64 split) => (seq(float[]) seq) {
            seq = SplitToSequence <axis: int = 1> (data, split)
        }""")
    (tmp_path / "m.onnx").write_bytes(model.SerializeToString())
    result = fusectl.optimize(tmp_path / "m.onnx", rules=[], check=False)
    assert len(result.model.graph) == 1
