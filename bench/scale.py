"""How fusectl's time grows with graph size, and its time on the light ResNet-50.

Run by hand: ``python bench/scale.py [--nodes 1000 10000 50000]``. Builds Conv+BN+Relu
chains (three nodes per block) and times each stage of ``fusectl.optimize``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import fusectl


def conv_bn_relu_chain(nodes: int, channels: int = 4, size: int = 8) -> onnx.ModelProto:
    """A chain of Conv -> BatchNormalization -> Relu blocks with about ``nodes`` nodes."""
    rng = np.random.default_rng(0)
    blocks = max(1, nodes // 3)
    graph_nodes, inits = [], []
    current = "x"
    for i in range(blocks):
        w = rng.normal(0, 0.3, (channels, channels, 3, 3)).astype(np.float32)
        inits.append(numpy_helper.from_array(w, f"w{i}"))
        for name, value in (("s", 1.0), ("b", 0.0), ("m", 0.0), ("v", 1.0)):
            inits.append(numpy_helper.from_array(
                np.full(channels, value, np.float32) + rng.uniform(0, 0.1, channels).astype(
                    np.float32), f"{name}{i}"))
        graph_nodes += [
            helper.make_node("Conv", [current, f"w{i}"], [f"c{i}"], name=f"conv{i}",
                             pads=[1, 1, 1, 1]),
            helper.make_node("BatchNormalization", [f"c{i}", f"s{i}", f"b{i}", f"m{i}",
                                                    f"v{i}"], [f"n{i}"], name=f"bn{i}"),
            helper.make_node("Relu", [f"n{i}"], [f"r{i}"], name=f"relu{i}"),
        ]
        current = f"r{i}"
    graph = helper.make_graph(
        graph_nodes, "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, channels, size, size])],
        [helper.make_tensor_value_info(current, TensorProto.FLOAT, [1, channels, size, size])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def timed(path: str | Path, check: bool) -> tuple[float, fusectl.OptimizeResult]:
    start = time.perf_counter()
    result = fusectl.optimize(path, check=check)
    return time.perf_counter() - start, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nodes", type=int, nargs="+", default=[1000, 10000])
    args = parser.parse_args()
    rules = fusectl.load_rule_set()
    del rules
    light = Path(os.path.dirname(onnx.__file__)) / "backend/test/data/light/light_resnet50.onnx"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        targets = [("light_resnet50", light)]
        for n in args.nodes:
            path = Path(tmp) / f"chain{n}.onnx"
            onnx.save(conv_bn_relu_chain(n), path)
            targets.append((f"chain-{n}", path))
        for name, path in targets:
            for check in (False, True):
                seconds, result = timed(path, check)
                stages = ", ".join(f"{k} {v:.2f}" for k, v in result.seconds.items())
                rows.append((name, result.nodes_before, result.nodes_after, check, seconds,
                             stages))
    print(f"{'model':16} {'nodes':>7} {'after':>7} {'validate':>8} {'seconds':>8}  stages")
    for name, before, after, check, seconds, stages in rows:
        print(f"{name:16} {before:7d} {after:7d} {str(check):>8} {seconds:8.2f}  {stages}")


if __name__ == "__main__":
    main()
