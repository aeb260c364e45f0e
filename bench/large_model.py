"""A synthetic LLM-like model above 2 GB (external data) through ``fusectl optimize``.

Run by hand: ``python bench/large_model.py [--layers 3 --hidden 4096 --ffn 11008]``.
Writes the model into a temp folder (weights streamed into the external data file with
numpy, chunk by chunk: never the whole model in memory), runs ``fusectl optimize`` on it in a
child process (validation on onnxruntime included), and reports its peak RSS summed with
that of its own onnxruntime process, relative to the model size, the time and the files
written. Everything is deleted at the end unless ``--keep``. ``tests/test_atomic.py`` runs the
same builder at ~20 MB in CI.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from onnx import TensorProto, helper

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's fusectl, in the child too (PYTHONPATH below)
RUN_CLI = "import sys; from fusectl.cli import main; sys.exit(main(sys.argv[1:]))"
OPSET = 17
IR_VERSION = 8
CHUNK_ELEMENTS = 1 << 24  # 64 MiB of float32 per write


@dataclass(frozen=True)
class Shape:
    """Sizes of the synthetic decoder."""

    layers: int = 3
    hidden: int = 4096
    ffn: int = 11008
    vocab: int = 32000
    seq: int = 8

    def parameters(self) -> int:
        per_layer = 4 * self.hidden**2 + 2 * self.hidden * self.ffn + self.ffn + 5 * self.hidden
        return 2 * self.vocab * self.hidden + self.layers * per_layer


class WeightWriter:
    """Streams seeded random weights into one external data file and returns the references."""

    def __init__(self, folder: Path, location: str, seed: int = 0) -> None:
        self.location = location
        self.file = open(folder / location, "wb")  # noqa: SIM115 - closed by close()
        self.rng = np.random.default_rng(seed)
        self.offset = 0

    def tensor(self, name: str, dims: tuple[int, ...], scale: float,
               mean: float = 0.0) -> TensorProto:
        """Write ``prod(dims)`` floats uniform in mean ± scale, chunk by chunk; align to 4 KiB."""
        count = math.prod(dims)
        for start in range(0, count, CHUNK_ELEMENTS):
            n = min(CHUNK_ELEMENTS, count - start)
            chunk = self.rng.random(n, dtype=np.float32)
            chunk *= np.float32(2 * scale)
            chunk += np.float32(mean - scale)
            chunk.tofile(self.file)
        length = count * 4
        tensor = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=list(dims))
        tensor.data_location = TensorProto.EXTERNAL
        for key, value in (("location", self.location), ("offset", str(self.offset)),
                           ("length", str(length))):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, value
        self.offset += length
        pad = -self.offset % 4096
        if pad:
            self.file.write(b"\0" * pad)
            self.offset += pad
        return tensor

    def close(self) -> None:
        self.file.close()


def _layer_norm(nodes: list, inits: list, writer: WeightWriter, x: str, p: str,
                hidden: int) -> str:
    """LayerNorm decomposed as exporters write it (LayerNormalization rule material)."""
    inits += [writer.tensor(f"{p}.gamma", (hidden,), 0.1, 1.0),
              writer.tensor(f"{p}.beta", (hidden,), 0.1)]
    nodes += [
        helper.make_node("ReduceMean", [x], [f"{p}.mean"], axes=[-1]),
        helper.make_node("Sub", [x, f"{p}.mean"], [f"{p}.d"]),
        helper.make_node("Mul", [f"{p}.d", f"{p}.d"], [f"{p}.sq"]),
        helper.make_node("ReduceMean", [f"{p}.sq"], [f"{p}.var"], axes=[-1]),
        helper.make_node("Add", [f"{p}.var", "eps"], [f"{p}.ve"]),
        helper.make_node("Sqrt", [f"{p}.ve"], [f"{p}.std"]),
        helper.make_node("Div", [f"{p}.d", f"{p}.std"], [f"{p}.n"]),
        helper.make_node("Mul", [f"{p}.n", f"{p}.gamma"], [f"{p}.g"]),
        helper.make_node("Add", [f"{p}.g", f"{p}.beta"], [f"{p}.out"]),
    ]
    return f"{p}.out"


def build_llm(folder: Path, shape: Shape = Shape(), name: str = "llm.onnx") -> Path:
    """Write ``folder/name`` + ``folder/name.data``: embedding, decoder layers (LayerNorm,
    single-head attention, erf-GELU MLP with biases, residuals), LM head."""
    h, f = shape.hidden, shape.ffn
    writer = WeightWriter(folder, name + ".data")
    w_scale = 1.0 / math.sqrt(h)
    inits = [writer.tensor("embed", (shape.vocab, h), 1.0)]
    inits += [helper.make_tensor("eps", TensorProto.FLOAT, [], [1e-5]),
              helper.make_tensor("inv_sqrt_h", TensorProto.FLOAT, [], [1.0 / math.sqrt(h)]),
              helper.make_tensor("half", TensorProto.FLOAT, [], [0.5]),
              helper.make_tensor("one", TensorProto.FLOAT, [], [1.0]),
              helper.make_tensor("sqrt2", TensorProto.FLOAT, [], [math.sqrt(2.0)])]
    nodes = [helper.make_node("Gather", ["embed", "input_ids"], ["x0"])]
    x = "x0"
    for i in range(shape.layers):
        p = f"l{i}"
        for w in ("q", "k", "v", "o"):
            inits.append(writer.tensor(f"{p}.W{w}", (h, h), w_scale))
        inits += [writer.tensor(f"{p}.W1", (h, f), w_scale), writer.tensor(f"{p}.b1", (f,), 0.1),
                  writer.tensor(f"{p}.W2", (f, h), 1.0 / math.sqrt(f)),
                  writer.tensor(f"{p}.b2", (h,), 0.1)]
        n1 = _layer_norm(nodes, inits, writer, x, f"{p}.ln1", h)
        nodes += [
            helper.make_node("MatMul", [n1, f"{p}.Wq"], [f"{p}.q"]),
            helper.make_node("MatMul", [n1, f"{p}.Wk"], [f"{p}.k"]),
            helper.make_node("MatMul", [n1, f"{p}.Wv"], [f"{p}.v"]),
            helper.make_node("Transpose", [f"{p}.k"], [f"{p}.kt"], perm=[0, 2, 1]),
            helper.make_node("MatMul", [f"{p}.q", f"{p}.kt"], [f"{p}.s"]),
            helper.make_node("Mul", [f"{p}.s", "inv_sqrt_h"], [f"{p}.ss"]),
            helper.make_node("Softmax", [f"{p}.ss"], [f"{p}.a"], axis=-1),
            helper.make_node("MatMul", [f"{p}.a", f"{p}.v"], [f"{p}.ctx"]),
            helper.make_node("MatMul", [f"{p}.ctx", f"{p}.Wo"], [f"{p}.o"]),
            helper.make_node("Add", [x, f"{p}.o"], [f"{p}.x1"]),
        ]
        n2 = _layer_norm(nodes, inits, writer, f"{p}.x1", f"{p}.ln2", h)
        nodes += [
            helper.make_node("MatMul", [n2, f"{p}.W1"], [f"{p}.f"]),
            helper.make_node("Add", [f"{p}.f", f"{p}.b1"], [f"{p}.fb"]),
            helper.make_node("Div", [f"{p}.fb", "sqrt2"], [f"{p}.fd"]),
            helper.make_node("Erf", [f"{p}.fd"], [f"{p}.fe"]),
            helper.make_node("Add", [f"{p}.fe", "one"], [f"{p}.f1"]),
            helper.make_node("Mul", [f"{p}.fb", f"{p}.f1"], [f"{p}.fm"]),
            helper.make_node("Mul", [f"{p}.fm", "half"], [f"{p}.gelu"]),
            helper.make_node("MatMul", [f"{p}.gelu", f"{p}.W2"], [f"{p}.m"]),
            helper.make_node("Add", [f"{p}.m", f"{p}.b2"], [f"{p}.mb"]),
            helper.make_node("Add", [f"{p}.x1", f"{p}.mb"], [f"{p}.x2"]),
        ]
        x = f"{p}.x2"
    inits.append(writer.tensor("lm_head", (h, shape.vocab), w_scale))
    nodes.append(helper.make_node("MatMul", [x, "lm_head"], ["logits"]))
    writer.close()
    graph = helper.make_graph(
        nodes, "llm",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, shape.seq])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, shape.seq, shape.vocab])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              ir_version=IR_VERSION, producer_name="fusectl-bench")
    path = folder / name
    path.write_bytes(model.SerializeToString())
    return path


def _tree_peaks(pid: int, peaks: dict[int, int]) -> None:
    """Record the peak resident bytes (VmHWM) of a process and its descendants so far
    (Linux's /proc; nothing elsewhere)."""
    stack = [pid]
    while stack:
        current = stack.pop()
        try:
            for line in Path(f"/proc/{current}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    peaks[current] = max(peaks.get(current, 0), int(line.split()[1]) * 1024)
            for task in Path(f"/proc/{current}/task").iterdir():
                stack += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue  # ended meanwhile


def _peak_child(command: list[str]) -> tuple[int, float, subprocess.CompletedProcess]:
    """Run ``command``; the sum of its peak resident memory and its children's (fusectl runs
    onnxruntime in a child process; an upper bound, the peaks need not coincide) read every
    50 ms, and wall seconds."""
    start = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    peaks: dict[int, int] = {}
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        process = subprocess.Popen(command, stdout=out, stderr=err, text=True, env=env)
        while process.poll() is None:
            _tree_peaks(process.pid, peaks)
            time.sleep(0.05)
        seconds = time.perf_counter() - start
        out.seek(0)
        err.seek(0)
        done = subprocess.CompletedProcess(command, process.returncode, out.read(), err.read())
    return sum(peaks.values()), seconds, done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=Shape.layers)
    parser.add_argument("--hidden", type=int, default=Shape.hidden)
    parser.add_argument("--ffn", type=int, default=Shape.ffn)
    parser.add_argument("--vocab", type=int, default=Shape.vocab)
    parser.add_argument("--dir", type=Path, help="where to build (default: a temp folder)")
    parser.add_argument("--keep", action="store_true", help="keep the files")
    parser.add_argument("--no-validate", action="store_true")
    args = parser.parse_args()
    shape = Shape(args.layers, args.hidden, args.ffn, args.vocab)
    need = shape.parameters() * 4 * 2.2
    folder = Path(tempfile.mkdtemp(prefix="fusectl-llm-", dir=args.dir))
    free = shutil.disk_usage(folder).free
    if free < need:
        sys.exit(f"need {need / 2**30:.1f} GiB free in {folder}, have {free / 2**30:.1f} GiB")
    try:
        start = time.perf_counter()
        model = build_llm(folder, shape)
        size = model.stat().st_size + (folder / (model.name + ".data")).stat().st_size
        print(f"built {model} ({size / 2**30:.2f} GiB, {shape.parameters():,} parameters) "
              f"in {time.perf_counter() - start:.1f} s")
        out = folder / "llm.opt.onnx"
        command = [sys.executable, "-c", RUN_CLI, "optimize", str(model), "-o", str(out),
                   "--json", str(folder / "report.json")]
        if args.no_validate:
            command.append("--no-validate")
        peak, seconds, done = _peak_child(command)
        print(done.stdout[-3000:])
        if done.returncode != 0:
            print(done.stderr, file=sys.stderr)
            sys.exit(f"fusectl exited {done.returncode}")
        report = json.loads((folder / "report.json").read_text())
        written = sorted(p.name for p in folder.iterdir())
        data = out.with_name(out.name + ".data")
        print(f"fusectl optimize: {seconds:.1f} s, peak RSS {peak / 2**30:.2f} GiB = "
              f"{peak / size:.2f} x the model ({size / 2**30:.2f} GiB)")
        print(f"stages: {report.get('seconds')}")
        print(f"files: {written}; output data {data.stat().st_size / 2**30:.2f} GiB")
    finally:
        if args.keep:
            print(f"kept {folder}")
        else:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
