"""Property-based fuzzing: random small valid graphs keep their outputs through ``optimize``.

The generator builds graphs from the ops the rules touch (Conv, BatchNormalization, Add, Sub,
Mul, Div, MatMul, Gemm, Transpose, Reshape, Flatten, Pad, MaxPool/AveragePool/GlobalAveragePool,
Relu/Sigmoid/Clip/LeakyRelu) with random attributes, padding, groups, broadcasting constants
and shared consumers (any earlier value may be read again, and may also be a graph output).
Pads, dilations, asymmetric padding, constants on either side, Transpose pairs and
sibling 1x1 Convs are generated on purpose. Each model is optimized for both targets and
validated on onnxruntime by fusectl.

CI runs a modest, derandomized number of examples. By hand:
``FUSECTL_FUZZ_EXAMPLES=3000 FUSECTL_FUZZ_COLLECT=/tmp/fuzz python -m pytest tests/test_fuzz.py``
(COLLECT saves every failing model there and keeps going instead of stopping at the first).
Failures that are rule bugs are kept under ``tests/data/fuzz/`` with a regression test below.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
import pytest
from hypothesis import HealthCheck, Phase, find, given, settings
from hypothesis import strategies as st
from onnx import TensorProto
from onnx import numpy_helper as nh

import fusectl
from fusectl.validate import ValidationOptions

EXAMPLES = int(os.environ.get("FUSECTL_FUZZ_EXAMPLES", "40"))
COLLECT = os.environ.get("FUSECTL_FUZZ_COLLECT")
FUZZ_DATA = Path(__file__).parent / "data" / "fuzz"
TARGETS = ("onnx", "onnxruntime")


# ------------------------------------------------------------------------------ generator


@dataclass
class Builder:
    """A graph under construction: values with their shapes, nodes, constants."""

    draw: st.DrawFn
    rng: np.random.Generator
    values: list[tuple[str, list[int]]] = field(default_factory=list)
    nodes: list[onnx.NodeProto] = field(default_factory=list)
    inits: list[TensorProto] = field(default_factory=list)
    extra_outputs: list[str] = field(default_factory=list)
    counter: int = 0

    def name(self, base: str) -> str:
        self.counter += 1
        return f"{base}{self.counter}"

    def const(self, array: np.ndarray, base: str = "c") -> str:
        name = self.name(base)
        self.inits.append(nh.from_array(array, name))
        return name

    def floats(self, shape: list[int], lo: float, hi: float) -> np.ndarray:
        return self.rng.uniform(lo, hi, shape).astype(np.float32)

    def add(self, op: str, inputs: list[str], shape: list[int], **attrs) -> str:
        out = self.name(op.lower())
        self.nodes.append(oh.make_node(op, inputs, [out], name=out, **attrs))
        self.values.append((out, shape))
        return out

    def choose(self, options: list):
        """One of ``options``, near uniformly (hypothesis favours small integers, so a wide
        draw modulo the count), shrinking towards the first."""
        return options[self.draw(st.integers(0, 2**16)) % len(options)]

    def pick(self, ranks: tuple[int, ...]) -> tuple[str, list[int]]:
        """Mostly the newest value of one of ``ranks`` (chains are what rules match), else
        any earlier one, which gives that value a second consumer."""
        choices = [v for v in self.values if len(v[1]) in ranks]
        if self.choose(range(10)) < 7:
            return choices[-1]
        return choices[-1 - self.choose(range(len(choices)))]


def _window(b: Builder, size: int) -> tuple[int, int, int, int, int]:
    """(kernel, stride, pad before, pad after, dilation) along one axis that fits ``size``."""
    k = b.choose([1, 2, 3])
    stride, dilation = b.choose([1, 1, 2]), b.choose([1, 1, 2]) if k > 1 else 1
    lo, hi = b.choose([0, 0, 1]), b.choose([0, 0, 1])
    if size + lo + hi < dilation * (k - 1) + 1:
        return 1, stride, 0, 0, 1
    return k, stride, lo, hi, dilation


def _out(size: int, k: int, stride: int, lo: int, hi: int, dilation: int = 1) -> int:
    return (size + lo + hi - dilation * (k - 1) - 1) // stride + 1


def _conv(b: Builder, x: str, shape: list[int]) -> None:
    n, c, h, w = shape
    (kh, sh, th, bh, dh), (kw, sw, tw, bw, dw) = _window(b, h), _window(b, w)
    group = b.choose([1, 1, c])
    co = group * b.choose([1, 2]) if group > 1 else b.choose([c, 4, 8])
    fan_in = c // group * kh * kw
    weight = b.floats([co, c // group, kh, kw], -1, 1) / np.float32(math.sqrt(fan_in))
    inputs = [x, b.const(weight, "W")]
    if b.choose([False, True]):
        inputs.append(b.const(b.floats([co], -0.5, 0.5), "B"))
    b.add("Conv", inputs, [n, co, _out(h, kh, sh, th, bh, dh), _out(w, kw, sw, tw, bw, dw)],
          kernel_shape=[kh, kw], strides=[sh, sw], pads=[th, tw, bh, bw], dilations=[dh, dw],
          group=group)


def _sibling_convs(b: Builder, x: str, shape: list[int]) -> None:
    """Two 1x1 Convs (maybe with Relu) reading the same value, then summed or both kept."""
    n, c, h, w = shape
    co = b.choose([c, 2, 8])
    outs = []
    for _ in range(2):
        weight = b.const(b.floats([co, c, 1, 1], -1, 1) / np.float32(math.sqrt(c)), "W")
        out = b.add("Conv", [x, weight], [n, co, h, w])
        if b.choose([False, True]):
            out = b.add("Relu", [out], [n, co, h, w])
        outs.append(out)
    if b.choose([False, True]):
        b.add("Add", outs, [n, co, h, w])


def _pad(b: Builder, x: str, shape: list[int]) -> None:
    """A zero Pad of the spatial axes (what exporters write before a Conv or a pool)."""
    n, c, h, w = shape
    pads = [0, 0, b.choose([0, 1]), b.choose([0, 1, 2]), 0, 0, b.choose([0, 1]), 1]
    b.add("Pad", [x, b.const(np.array(pads, np.int64), "pads")],
          [n, c, h + pads[2] + pads[6], w + pads[3] + pads[7]])


def _batch_norm(b: Builder, x: str, shape: list[int]) -> None:
    c = shape[1]
    stats = [b.const(b.floats([c], 0.5, 1.5), "s"), b.const(b.floats([c], -0.5, 0.5), "b"),
             b.const(b.floats([c], -0.5, 0.5), "m"), b.const(b.floats([c], 0.5, 2.0), "v")]
    b.add("BatchNormalization", [x, *stats], shape,
          epsilon=b.choose([1e-5, 1e-3]))


def _binary(b: Builder, x: str, shape: list[int]) -> None:
    op = b.choose(["Add", "Mul", "Add", "Mul", "Sub", "Div"])
    kind = b.choose(["scalar", "channel", "trailing", "full", "value", "one"])
    rank = len(shape)
    if kind == "value":  # two activations of the same shape
        other = [v for v in b.values if v[1] == shape]
        operand = b.choose(other)[0]
        if op == "Div":
            op = "Mul"
    else:
        const_shape = {
            "scalar": [],
            "one": [1],
            "channel": [shape[1]] + [1] * (rank - 2) if rank >= 2 else [shape[-1]],
            "channel-rank": [1, shape[1]] + [1] * (rank - 2),
            "trailing": [shape[-1]],
            "rows": [shape[-2], 1],
            "full": shape[1:],
        }[b.choose(["channel", "channel-rank", "rows"]) if kind == "full" and
          b.choose([False, True]) else kind]
        operand = b.const(b.floats(const_shape, 0.5, 1.5) * np.float32(
            b.choose([1, -1])), "k")
    # the constant on the left too: c - x is not x - c
    inputs = [operand, x] if b.choose([False, True]) and op != "Div" else [x, operand]
    b.add(op, inputs, shape)


def _matmul(b: Builder, x: str, shape: list[int]) -> None:
    if len(shape) == 2 and b.choose([False, False, True]):  # the weight on the left
        m = b.choose([2, 3, 4, 8])
        weight = b.const(b.floats([m, shape[0]], -1, 1) / np.float32(math.sqrt(shape[0])), "W")
        b.add("MatMul", [weight, x], [m, shape[1]])
        return
    k, m = shape[-1], b.choose([2, 3, 4, 8])
    weight = b.const(b.floats([k, m], -1, 1) / np.float32(math.sqrt(k)), "W")
    out = b.add("MatMul", [x, weight], shape[:-1] + [m])
    if b.choose([False, True]):  # the bias Add exporters write after a MatMul
        b.add("Add", [out, b.const(b.floats([m], -0.5, 0.5), "bias")], shape[:-1] + [m])


def _gemm(b: Builder, x: str, shape: list[int]) -> None:
    n, k = shape
    m = b.choose([2, 3, 4, 8])
    trans_b = b.choose([0, 1])
    w = b.floats([m, k] if trans_b else [k, m], -1, 1) / np.float32(math.sqrt(k))
    inputs = [x, b.const(w, "W")]
    if b.choose([False, True]):
        inputs.append(b.const(b.floats(b.choose([[m], [1, m]]), -0.5, 0.5), "C"))
    b.add("Gemm", inputs, [n, m], transB=trans_b, alpha=b.choose([1.0, 0.5]),
          beta=b.choose([1.0, 2.0]))


def _transpose(b: Builder, x: str, shape: list[int]) -> None:
    perm = b.draw(st.permutations(list(range(len(shape)))))
    out = b.add("Transpose", [x], [shape[p] for p in perm], perm=list(perm))
    if b.choose([False, True]):  # a second Transpose: the inverse, or any other
        inverse = list(np.argsort(perm))
        second = inverse if b.choose([False, True]) else list(
            b.draw(st.permutations(list(range(len(shape))))))
        now = [shape[p] for p in perm]
        b.add("Transpose", [out], [now[p] for p in second], perm=[int(p) for p in second])


def _reshape(b: Builder, x: str, shape: list[int]) -> None:
    if len(shape) == 4:
        target = b.choose([[shape[0], shape[1], shape[2] * shape[3]],
                           [shape[0], math.prod(shape[1:])]])
    elif len(shape) == 3:
        target = [shape[0], shape[1] * shape[2]]
    else:
        target = [shape[0], shape[1], 1, 1]
    spec = list(target)
    if b.choose([False, True]):  # exporters write 0 (copy) and -1 (infer)
        spec[0] = 0
    b.add("Reshape", [x, b.const(np.array(spec, np.int64), "shape")], target)


def _flatten(b: Builder, x: str, shape: list[int]) -> None:
    b.add("Flatten", [x], [shape[0], math.prod(shape[1:])], axis=1)


def _pool(b: Builder, x: str, shape: list[int]) -> None:
    n, c, h, w = shape
    op = b.choose(["MaxPool", "AveragePool", "GlobalAveragePool"])
    if op == "GlobalAveragePool":
        b.add(op, [x], [n, c, 1, 1])
        return
    k = b.choose([1, 2, 3])
    stride = b.choose([1, 2, k, k])
    pad = b.choose([0, 0, 1]) if k > 1 else 0
    if h + 2 * pad < k or w + 2 * pad < k:
        k, stride, pad = 1, 1, 0
    attrs = {"kernel_shape": [k, k], "strides": [stride, stride], "pads": [pad] * 4}
    if op == "AveragePool":
        attrs["count_include_pad"] = b.choose([0, 1])
    b.add(op, [x], [n, c, _out(h, k, stride, pad, pad), _out(w, k, stride, pad, pad)], **attrs)


def _activation(b: Builder, x: str, shape: list[int]) -> None:
    op = b.choose(["Relu", "Sigmoid", "Clip", "LeakyRelu"])
    if op == "Clip":
        lo = b.choose([0.0, -1.0])
        b.add(op, [x, b.const(np.array(lo, np.float32), "lo"),
                   b.const(np.array(lo + b.choose([1.0, 6.0]), np.float32),
                           "hi")], shape)
    elif op == "LeakyRelu":
        b.add(op, [x], shape, alpha=b.choose([0.01, 0.2]))
    else:
        b.add(op, [x], shape)


STEPS = [  # (ranks the step reads, step); repeated entries are drawn more often
    ((4,), _conv), ((4,), _conv), ((4,), _conv), ((4,), _batch_norm), ((4,), _batch_norm),
    ((2, 3, 4), _binary), ((2, 3, 4), _binary), ((2, 3, 4), _binary), ((2, 3, 4), _matmul),
    ((2,), _gemm), ((2, 3, 4), _transpose), ((2, 3, 4), _reshape), ((3, 4), _flatten),
    ((4,), _pool), ((4,), _pool), ((2, 3, 4), _activation), ((2, 3, 4), _activation),
    ((2, 3, 4), _activation), ((4,), _sibling_convs), ((4,), _pad),
]


@st.composite
def graphs(draw: st.DrawFn) -> onnx.ModelProto:
    b = Builder(draw, np.random.default_rng(draw(st.integers(0, 2**32 - 1))))
    shape = [b.choose([1, 1, 2]), b.choose([1, 2, 3, 4, 8]), b.choose(range(1, 8)),
             b.choose(range(1, 8))]
    b.values.append(("x", shape))
    for _ in range(b.choose(range(1, 9))):
        present = {len(s) for _, s in b.values}
        usable = [(ranks, step) for ranks, step in STEPS if present & set(ranks)]
        ranks, step = b.choose(usable)
        step(b, *b.pick(ranks))
        if b.choose(range(10)) == 0:  # an intermediate that is also a graph output
            b.extra_outputs.append(b.values[-1][0])
    consumed = {i for n in b.nodes for i in n.input}
    outputs = [(v, s) for v, s in b.values[1:] if v not in consumed or v in b.extra_outputs]
    if not outputs:
        outputs = [b.values[-1]]
    graph = oh.make_graph(
        b.nodes, "fuzz", [oh.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [oh.make_tensor_value_info(v, TensorProto.FLOAT, s) for v, s in outputs], b.inits)
    opset = b.choose([13, 17])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", opset)], ir_version=8)
    onnx.checker.check_model(model, full_check=True)  # the generator's own shapes are right
    return model


# ------------------------------------------------------------------------------ checking

_RULES: dict[str, list] = {}


def rules_for(target: str) -> list:
    if target not in _RULES:
        _RULES[target] = fusectl.load_rule_set(target=target)
    return _RULES[target]


def check_model(model: onnx.ModelProto, target: str, rules: list | None = None) -> str | None:
    """Optimize and validate ``model``; the problem as text, or None when outputs match."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fuzz.onnx"
        path.write_bytes(model.SerializeToString())
        result = fusectl.optimize(path, rules=rules_for(target) if rules is None else rules,
                                  target=target, validation=ValidationOptions(seed=0))
    if result.passed:
        return None
    bad = [o for o in result.validation.outputs if not o.passed]
    return (f"outputs differ ({', '.join(o.name for o in bad)}) after "
            f"{result.rewrite.counts()}")


def _save_failure(model: onnx.ModelProto, target: str, problem: str) -> None:
    folder = Path(COLLECT)
    folder.mkdir(parents=True, exist_ok=True)
    stem = f"{target}-{len(list(folder.glob('*.onnx'))):04d}"
    (folder / f"{stem}.onnx").write_bytes(model.SerializeToString())
    (folder / f"{stem}.json").write_text(json.dumps({"target": target, "problem": problem}))


@settings(max_examples=EXAMPLES, deadline=None, derandomize=COLLECT is None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(model=graphs())
def test_random_graphs_keep_their_outputs(model: onnx.ModelProto) -> None:
    for target in TARGETS:
        try:
            problem = check_model(model, target)
        except Exception as exc:  # noqa: BLE001 - a crash is a finding too
            problem = f"crash: {type(exc).__name__}: {exc}"
        if problem and COLLECT:
            _save_failure(model, target, problem)
        elif problem:
            pytest.fail(f"[{target}] {problem}")


def test_the_fuzzer_catches_a_wrong_rule() -> None:
    """The harness can fail: a Conv+BN fold that forgets the mean is found within a few
    dozen generated graphs."""
    wrong = fusectl.load_rule_set([Path(__file__).parent / "data" / "wrong_bn_fold.yaml"],
                                  builtin=False)
    found = find(graphs(), lambda model: check_model(model, "onnx", wrong) is not None,
                 settings=settings(max_examples=200, derandomize=True, database=None,
                                   deadline=None, phases=[Phase.generate],
                                   suppress_health_check=[HealthCheck.too_slow]))
    ops = [n.op_type for n in found.graph.node]
    assert "Conv" in ops and "BatchNormalization" in ops


@pytest.mark.parametrize("op", ["Conv", "BatchNormalization", "Add", "Mul", "Sub", "Div",
                                "MatMul", "Gemm", "Pad", "Transpose", "Reshape", "Flatten",
                                "MaxPool", "AveragePool", "GlobalAveragePool", "Relu",
                                "Sigmoid", "Clip", "LeakyRelu"])
def test_generator_covers_every_step(op: str) -> None:
    """The generator can reach every op family (else the fuzzing is weaker than it says).
    A search per op, not a fixed sample: hypothesis mixes constants of the loaded modules
    into its choices, so a fixed sample's contents depend on what else the run imported."""
    found = find(graphs(), lambda model: any(n.op_type == op for n in model.graph.node),
                 settings=settings(max_examples=2000, derandomize=True, database=None,
                                   deadline=None, phases=[Phase.generate],
                                   suppress_health_check=list(HealthCheck)))
    assert op in {n.op_type for n in found.graph.node}
