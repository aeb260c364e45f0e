"""Regenerate the sample ONNX models used by fusectl's tests, docs and benchmarks.

Run ``python samples/build_samples.py`` to rewrite every ``*.onnx`` file next to this
script. Output is deterministic: each model uses its own fixed numpy seed and no
timestamps or host-specific data are embedded, so reruns produce identical bytes.
"""

from __future__ import annotations

import math
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

PRODUCER_NAME = "fusectl-samples"
PRODUCER_VERSION = "1"
IR_VERSION = 10
BATCH_DIM = "N"


class GraphBuilder:
    """Collects nodes and initializers for one graph, with a seeded weight generator."""

    def __init__(self, seed: int) -> None:
        """Create an empty builder whose random weights come from ``seed``."""
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._names: set[str] = set()

    def _claim(self, name: str) -> str:
        """Register a node or tensor name, refusing duplicates."""
        if name in self._names:
            raise ValueError(f"duplicate name {name!r}")
        self._names.add(name)
        return name

    def const(self, name: str, value: np.ndarray) -> str:
        """Add an initializer holding ``value`` and return its name."""
        self.initializers.append(numpy_helper.from_array(value, self._claim(name)))
        return name

    def scalar(self, name: str, value: float) -> str:
        """Add a float32 scalar (rank-0) initializer."""
        return self.const(name, np.array(value, dtype=np.float32))

    def axes(self, name: str, values: list[int]) -> str:
        """Add an int64 1-D initializer, e.g. ``axes`` for opset-18+ reductions."""
        return self.const(name, np.array(values, dtype=np.int64))

    def normal(self, name: str, shape: tuple[int, ...], scale: float = 0.1) -> str:
        """Add a float32 initializer drawn from N(0, scale^2)."""
        value = (self.rng.standard_normal(shape) * scale).astype(np.float32)
        return self.const(name, value)

    def uniform(self, name: str, shape: tuple[int, ...], low: float, high: float) -> str:
        """Add a float32 initializer drawn from U(low, high)."""
        return self.const(name, self.rng.uniform(low, high, shape).astype(np.float32))

    def node(self, op: str, name: str, inputs: list[str], **attrs: object) -> str:
        """Append a single-output node; its output tensor is named after the node."""
        out = self._claim(name)
        self.nodes.append(helper.make_node(op, inputs, [out], name=name, **attrs))
        return out

    def batchnorm(self, name: str, x: str, channels: int) -> str:
        """Append BatchNormalization with random (sane) scale/bias/mean/variance."""
        scale = self.uniform(f"{name}.scale", (channels,), 0.5, 1.5)
        bias = self.normal(f"{name}.bias", (channels,))
        mean = self.normal(f"{name}.mean", (channels,))
        var = self.uniform(f"{name}.var", (channels,), 0.5, 2.0)
        return self.node("BatchNormalization", name, [x, scale, bias, mean, var], epsilon=1e-5)

    def linear(self, name: str, x: str, fan_in: int, fan_out: int) -> str:
        """Append MatMul + Add (bias), the way exporters emit nn.Linear on N-D inputs."""
        w = self.normal(f"{name}.weight", (fan_in, fan_out))
        b = self.normal(f"{name}.bias", (fan_out,))
        mm = self.node("MatMul", f"{name}_matmul", [x, w])
        return self.node("Add", f"{name}_add", [mm, b])

    def layernorm(self, name: str, x: str, width: int) -> str:
        """Append a LayerNorm over the last axis, decomposed like the PyTorch exporter."""
        axes = self.axes(f"{name}.axes", [-1])
        mean = self.node("ReduceMean", f"{name}_mean", [x, axes], keepdims=1)
        centered = self.node("Sub", f"{name}_sub", [x, mean])
        sq = self.node("Pow", f"{name}_pow", [centered, self.scalar(f"{name}.two", 2.0)])
        var = self.node("ReduceMean", f"{name}_var", [sq, axes], keepdims=1)
        var_eps = self.node("Add", f"{name}_add_eps", [var, self.scalar(f"{name}.eps", 1e-5)])
        std = self.node("Sqrt", f"{name}_sqrt", [var_eps])
        normed = self.node("Div", f"{name}_div", [centered, std])
        gamma = self.uniform(f"{name}.gamma", (width,), 0.5, 1.5)
        scaled = self.node("Mul", f"{name}_mul_gamma", [normed, gamma])
        return self.node("Add", f"{name}_add_beta", [scaled, self.normal(f"{name}.beta", (width,))])

    def output(self, name: str, tensor: str) -> str:
        """Expose ``tensor`` as graph output ``name`` by renaming the last node's output."""
        last = self.nodes[-1]
        if list(last.output) != [tensor]:
            raise ValueError(f"{tensor!r} must be produced by the last node to be renamed")
        self._claim(name)
        last.output[0] = name
        return name


def float_input(name: str, *dims: int | str) -> onnx.ValueInfoProto:
    """Make a float32 graph input/output value info."""
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, list(dims))


def finish(
    b: GraphBuilder,
    sample: str,
    doc: str,
    opset: int,
    inputs: list[onnx.ValueInfoProto],
    outputs: list[onnx.ValueInfoProto],
) -> onnx.ModelProto:
    """Wrap the builder's nodes into a checked ModelProto with fusectl sample metadata."""
    graph = helper.make_graph(b.nodes, f"{sample}_graph", inputs, outputs, b.initializers)
    model = helper.make_model(
        graph,
        producer_name=PRODUCER_NAME,
        producer_version=PRODUCER_VERSION,
        doc_string=doc,
        opset_imports=[helper.make_opsetid("", opset)],
        ir_version=IR_VERSION,
    )
    helper.set_model_props(model, {"sample": sample})
    onnx.checker.check_model(model, full_check=True)
    return model


def build_cnn() -> onnx.ModelProto:
    """Small CNN exercising Conv+BN, Conv+Mul+Add (affine), Conv+BN+Relu and Gemm."""
    b = GraphBuilder(seed=1001)
    x = "image"
    x = b.node(
        "Conv",
        "conv1",
        [x, b.normal("conv1.weight", (16, 3, 3, 3)), b.normal("conv1.bias", (16,))],
        pads=[1, 1, 1, 1],
    )
    x = b.batchnorm("bn1", x, 16)
    x = b.node("Relu", "relu1", [x])
    x = b.node("MaxPool", "pool1", [x], kernel_shape=[2, 2], strides=[2, 2])
    x = b.node(
        "Conv",
        "conv2",
        [x, b.normal("conv2.weight", (32, 16, 3, 3)), b.normal("conv2.bias", (32,))],
        pads=[1, 1, 1, 1],
    )
    x = b.node("Mul", "scale2", [x, b.uniform("scale2.value", (32, 1, 1), 0.5, 1.5)])
    x = b.node("Add", "shift2", [x, b.normal("shift2.value", (32, 1, 1))])
    x = b.node("Relu", "relu2", [x])
    x = b.node("Conv", "conv3", [x, b.normal("conv3.weight", (32, 32, 3, 3))], pads=[1, 1, 1, 1])
    x = b.batchnorm("bn3", x, 32)
    x = b.node("Relu", "relu3", [x])
    x = b.node("GlobalAveragePool", "gap", [x])
    x = b.node("Flatten", "flatten", [x], axis=1)
    x = b.node(
        "Gemm", "fc", [x, b.normal("fc.weight", (10, 32)), b.normal("fc.bias", (10,))], transB=1
    )
    b.output("logits", x)
    return finish(
        b,
        "cnn",
        "fusectl sample: 3-conv CNN (Conv/BatchNorm/Relu/MaxPool, Conv+per-channel Mul/Add, "
        "bias-free Conv+BatchNorm, GlobalAveragePool/Flatten/Gemm classifier).",
        17,
        [float_input("image", BATCH_DIM, 3, 32, 32)],
        [float_input("logits", BATCH_DIM, 10)],
    )


def build_mlp() -> onnx.ModelProto:
    """3-layer MLP written as MatMul+Add, plus a cancelling Transpose pair branch."""
    b = GraphBuilder(seed=2002)
    h = b.linear("fc1", "x", 64, 128)
    h = b.node("Relu", "relu1", [h])
    h = b.linear("fc2", h, 128, 128)
    h = b.node("Relu", "relu2", [h])
    h = b.linear("fc3", h, 128, 10)
    b.output("y", h)
    t = b.node("Transpose", "transpose_a", ["x"], perm=[1, 0])
    t = b.node("Transpose", "transpose_b", [t], perm=[1, 0])
    t = b.node("Relu", "relu_z", [t])
    b.output("z", t)
    return finish(
        b,
        "mlp",
        "fusectl sample: 3-layer MLP as MatMul+Add+Relu, plus a second output through a "
        "Transpose(perm=[1,0]) pair that cancels out.",
        17,
        [float_input("x", BATCH_DIM, 64)],
        [float_input("y", BATCH_DIM, 10), float_input("z", BATCH_DIM, 64)],
    )


def build_transformer_block() -> onnx.ModelProto:
    """Pre-LN single-head transformer block decomposed the way PyTorch exporters emit it."""
    seq, width, ffn = 16, 64, 256
    b = GraphBuilder(seed=3003)
    x = "hidden"
    h = b.layernorm("ln1", x, width)
    q = b.linear("q_proj", h, width, width)
    k = b.linear("k_proj", h, width, width)
    v = b.linear("v_proj", h, width, width)
    kt = b.node("Transpose", "k_transpose", [k], perm=[0, 2, 1])
    scores = b.node("MatMul", "qk_matmul", [q, kt])
    scores = b.node("Div", "qk_scale", [scores, b.scalar("attn.scale", math.sqrt(width))])
    probs = b.node("Softmax", "attn_softmax", [scores], axis=-1)
    ctx = b.node("MatMul", "attn_v_matmul", [probs, v])
    attn = b.linear("o_proj", ctx, width, width)
    x = b.node("Add", "residual1", [x, attn])
    h = b.layernorm("ln2", x, width)
    h = b.linear("fc1", h, width, ffn)
    g = b.node("Div", "gelu_div", [h, b.scalar("gelu.sqrt2", 1.4142135)])
    g = b.node("Erf", "gelu_erf", [g])
    g = b.node("Add", "gelu_add_one", [g, b.scalar("gelu.one", 1.0)])
    g = b.node("Mul", "gelu_mul_x", [h, g])
    g = b.node("Mul", "gelu_mul_half", [g, b.scalar("gelu.half", 0.5)])
    h = b.linear("fc2", g, ffn, width)
    b.node("Add", "residual2", [x, h])
    b.output("out", "residual2")
    return finish(
        b,
        "transformer_block",
        "fusectl sample: pre-LayerNorm single-head transformer block with LayerNorm, "
        "attention and erf-GELU decomposed into primitive ops (as torch exporters emit).",
        20,
        [float_input("hidden", BATCH_DIM, seq, width)],
        [float_input("out", BATCH_DIM, seq, width)],
    )


SAMPLES: dict[str, Callable[[], onnx.ModelProto]] = {
    "cnn": build_cnn,
    "mlp": build_mlp,
    "transformer_block": build_transformer_block,
}


def build_all(out_dir: Path) -> list[Path]:
    """Build, check and write every sample into ``out_dir``; return the written paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, build in SAMPLES.items():
        path = out_dir / f"{name}.onnx"
        path.write_bytes(build().SerializeToString())
        paths.append(path)
    return paths


def run_sample(path: Path, batch: int = 2, seed: int = 0) -> dict[str, np.ndarray]:
    """Run a sample on onnxruntime CPU with random inputs; return outputs by name."""
    import onnxruntime as ort

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(seed)
    feeds = {}
    for inp in sess.get_inputs():
        shape = [batch if isinstance(d, str) or d is None else d for d in inp.shape]
        feeds[inp.name] = rng.standard_normal(shape).astype(np.float32)
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds), strict=True))


def summarize(path: Path) -> str:
    """Verify a written sample on onnxruntime and describe it in one line."""
    model = onnx.load(str(path))
    hist = Counter(n.op_type for n in model.graph.node)
    outs = run_sample(path)
    for name, value in outs.items():
        if not np.all(np.isfinite(value)) or float(np.abs(value).max()) < 1e-6:
            raise RuntimeError(f"{path.name}: output {name!r} is non-finite or ~0")
    ops = ", ".join(f"{op}={n}" for op, n in sorted(hist.items()))
    stats = " ".join(f"{k}:std={v.std():.3g}" for k, v in outs.items())
    return (
        f"{path.name}: {len(model.graph.node)} nodes, {path.stat().st_size} bytes, {stats}\n  {ops}"
    )


def main() -> int:
    """Regenerate all samples next to this script and print a summary."""
    for path in build_all(Path(__file__).resolve().parent):
        print(summarize(path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
