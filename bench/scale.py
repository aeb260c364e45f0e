"""How fusectl's time grows with graph size, and its time on the light ResNet-50.

Run by hand: ``python bench/scale.py [--nodes 1000 10000 100000] [--kind chain mixed]
[--no-validate] [--no-resnet]``. Builds graphs of about N nodes and times each stage of
``fusectl.optimize`` (the rule library is loaded once, outside the timings):

* ``chain``: Conv -> BatchNormalization -> Relu blocks (three nodes per block);
* ``mixed``: blocks of ten nodes touching several rule families: Conv + BN + Relu, a
  Transpose pair, a per-channel Mul, two sibling 1x1 Convs summed.

``tests/test_scale.py`` uses the same builders to guard linear cost by call counts.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's fusectl

import fusectl  # noqa: E402


def _bn(rng: np.random.Generator, prefix: str, channels: int) -> list[TensorProto]:
    return [numpy_helper.from_array(np.full(channels, value, np.float32)
                                    + rng.uniform(0, 0.1, channels).astype(np.float32),
                                    f"{name}{prefix}")
            for name, value in (("s", 1.0), ("b", 0.0), ("m", 0.0), ("v", 1.0))]


def _model(nodes: list, inits: list, last: str, channels: int, size: int) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes, "scale",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, channels, size, size])],
        [helper.make_tensor_value_info(last, TensorProto.FLOAT, [1, channels, size, size])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def conv_bn_relu_chain(nodes: int, channels: int = 4, size: int = 8) -> onnx.ModelProto:
    """A chain of Conv -> BatchNormalization -> Relu blocks with about ``nodes`` nodes."""
    rng = np.random.default_rng(0)
    graph_nodes, inits = [], []
    current = "x"
    for i in range(max(1, nodes // 3)):
        w = rng.normal(0, 0.3, (channels, channels, 3, 3)).astype(np.float32)
        inits += [numpy_helper.from_array(w, f"w{i}"), *_bn(rng, str(i), channels)]
        graph_nodes += [
            helper.make_node("Conv", [current, f"w{i}"], [f"c{i}"], name=f"conv{i}",
                             pads=[1, 1, 1, 1]),
            helper.make_node("BatchNormalization", [f"c{i}", f"s{i}", f"b{i}", f"m{i}",
                                                    f"v{i}"], [f"n{i}"], name=f"bn{i}"),
            helper.make_node("Relu", [f"n{i}"], [f"r{i}"], name=f"relu{i}"),
        ]
        current = f"r{i}"
    return _model(graph_nodes, inits, current, channels, size)


def mixed_blocks(nodes: int, channels: int = 4, size: int = 8) -> onnx.ModelProto:
    """Blocks of ten nodes: Conv -> BN -> Relu -> Transpose -> Transpose (inverse) -> Mul
    (per channel) -> two sibling 1x1 Convs -> Add -> Relu."""
    rng = np.random.default_rng(0)
    graph_nodes, inits = [], []
    current = "x"
    for i in range(max(1, nodes // 10)):
        w = rng.normal(0, 0.3, (channels, channels, 3, 3)).astype(np.float32)
        k = rng.uniform(0.5, 1.5, (channels, 1, 1)).astype(np.float32)
        inits += [numpy_helper.from_array(w, f"w{i}"), *_bn(rng, str(i), channels),
                  numpy_helper.from_array(k, f"k{i}")]
        for side in "pq":
            one = rng.normal(0, 0.5, (channels, channels, 1, 1)).astype(np.float32)
            inits.append(numpy_helper.from_array(one, f"{side}{i}"))
        graph_nodes += [
            helper.make_node("Conv", [current, f"w{i}"], [f"c{i}"], pads=[1, 1, 1, 1]),
            helper.make_node("BatchNormalization", [f"c{i}", f"s{i}", f"b{i}", f"m{i}",
                                                    f"v{i}"], [f"n{i}"]),
            helper.make_node("Relu", [f"n{i}"], [f"r{i}"]),
            helper.make_node("Transpose", [f"r{i}"], [f"t{i}"], perm=[0, 2, 3, 1]),
            helper.make_node("Transpose", [f"t{i}"], [f"u{i}"], perm=[0, 3, 1, 2]),
            helper.make_node("Mul", [f"u{i}", f"k{i}"], [f"g{i}"]),
            helper.make_node("Conv", [f"g{i}", f"p{i}"], [f"cp{i}"]),
            helper.make_node("Conv", [f"g{i}", f"q{i}"], [f"cq{i}"]),
            helper.make_node("Add", [f"cp{i}", f"cq{i}"], [f"a{i}"]),
            helper.make_node("Relu", [f"a{i}"], [f"o{i}"]),
        ]
        current = f"o{i}"
    return _model(graph_nodes, inits, current, channels, size)


def shared_transposes(nodes: int, channels: int = 4, size: int = 8) -> onnx.ModelProto:
    """Blocks of four nodes: Relu -> Transpose -> Transpose (inverse) -> Add of both, so each
    cancelling pair's first Transpose is also read elsewhere (a KV cache's present heads):
    transpose-cancel writes it again, the case the cycle check must not make quadratic."""
    graph_nodes = []
    current = "x"
    for i in range(max(1, nodes // 4)):
        graph_nodes += [
            helper.make_node("Relu", [current], [f"r{i}"]),
            helper.make_node("Transpose", [f"r{i}"], [f"t{i}"], perm=[0, 1, 3, 2]),
            helper.make_node("Transpose", [f"t{i}"], [f"u{i}"], perm=[0, 1, 3, 2]),
            helper.make_node("Add", [f"u{i}", f"t{i}"], [f"a{i}"]),
        ]
        current = f"a{i}"
    return _model(graph_nodes, [], current, channels, size)


BUILDERS = {"chain": conv_bn_relu_chain, "mixed": mixed_blocks, "shared": shared_transposes}


def timed(path: str | Path, rules: list, check: bool) -> tuple[float, fusectl.OptimizeResult]:
    start = time.perf_counter()
    result = fusectl.optimize(path, rules=rules, check=check)
    return time.perf_counter() - start, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--kind", nargs="+", choices=sorted(BUILDERS), default=["chain"])
    parser.add_argument("--no-validate", action="store_true", help="time without validation")
    parser.add_argument("--no-resnet", action="store_true", help="skip the light ResNet-50")
    args = parser.parse_args()
    start = time.perf_counter()
    rules = fusectl.load_rule_set()
    print(f"rule library: {len(rules)} rules loaded in {time.perf_counter() - start:.2f} s")
    light = Path(os.path.dirname(onnx.__file__)) / "backend/test/data/light/light_resnet50.onnx"
    checks = (False,) if args.no_validate else (False, True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        targets = [] if args.no_resnet else [("light_resnet50", light)]
        for kind in args.kind:
            for n in args.nodes:
                path = Path(tmp) / f"{kind}{n}.onnx"
                onnx.save(BUILDERS[kind](n), path)
                targets.append((f"{kind}-{n}", path))
        for name, path in targets:
            for check in checks:
                seconds, result = timed(path, rules, check)
                stages = ", ".join(f"{k} {v:.2f}" for k, v in result.seconds.items())
                rows.append((name, result.nodes_before, result.nodes_after, check, seconds,
                             stages))
                print(f"{name:16} {result.nodes_before:7d} {result.nodes_after:7d} "
                      f"{str(check):>8} {seconds:8.2f}  {stages}", flush=True)
    print(f"\n{'model':16} {'nodes':>7} {'after':>7} {'validate':>8} {'seconds':>8}  stages")
    for name, before, after, check, seconds, stages in rows:
        print(f"{name:16} {before:7d} {after:7d} {str(check):>8} {seconds:8.2f}  {stages}")


if __name__ == "__main__":
    main()
