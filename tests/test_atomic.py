"""Atomic output, in-place backups and external data, through the command line.

A ``fusectl optimize`` process is SIGKILLed while it saves; the output path must then hold
what it held before (nothing, or the old file) or the complete new model, never a part of one.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
import onnxruntime as ort
import pytest
from onnx import TensorProto
from onnx import numpy_helper as nh

from fusectl.cli import main

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(__file__).parent / "data"
RUN_CLI = "import sys; from fusectl.cli import main; sys.exit(main(sys.argv[1:]))"
NO_RULES = "version: 1\nrules: []\n"

_spec = importlib.util.spec_from_file_location("large_model", ROOT / "bench" / "large_model.py")
large_model = importlib.util.module_from_spec(_spec)
sys.modules["large_model"] = large_model  # dataclasses look their module up
_spec.loader.exec_module(large_model)


# ------------------------------------------------------------------------------ models


def matmul_chain(path: Path, layers: int = 5, width: int = 1536) -> Path:
    """x -> (MatMul W_i -> Add b_i) * layers, weights inline: ~47 MB, saving takes a moment."""
    rng = np.random.default_rng(0)
    nodes, inits, x = [], [], "x"
    for i in range(layers):
        w = (rng.random((width, width), dtype=np.float32) - 0.5) / np.float32(width**0.5)
        bias = np.full(width, 0.1, np.float32)
        inits += [nh.from_array(w, f"W{i}"), nh.from_array(bias, f"b{i}")]
        nodes += [oh.make_node("MatMul", [x, f"W{i}"], [f"m{i}"]),
                  oh.make_node("Add", [f"m{i}", f"b{i}"], [f"y{i}"])]
        x = f"y{i}"
    graph = oh.make_graph(nodes, "chain",
                          [oh.make_tensor_value_info("x", TensorProto.FLOAT, [2, width])],
                          [oh.make_tensor_value_info(x, TensorProto.FLOAT, [2, width])], inits)
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)], ir_version=8)
    path.write_bytes(model.SerializeToString())
    return path


def small_valid_model(path: Path) -> Path:
    """A different valid model: the 'old file' an interrupted save must leave intact."""
    graph = oh.make_graph([oh.make_node("Relu", ["x"], ["y"])], "old",
                          [oh.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                          [oh.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    path.write_bytes(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)],
                                   ir_version=8).SerializeToString())
    return path


def llm(folder: Path, **sizes: int) -> Path:
    shape = large_model.Shape(**{"layers": 2, "hidden": 256, "ffn": 512, "vocab": 8000,
                                 "seq": 8, **sizes})
    return large_model.build_llm(folder, shape)


def read(path: Path) -> bytes | None:
    return path.read_bytes() if path.exists() else None


# ------------------------------------------------------------------------ killing a save


def _temp_files(folder: Path) -> list[Path]:
    return [p for p in folder.iterdir() if p.name.startswith(".") and p.name.endswith(".tmp")]


def run_and_kill(args: list[str], folder: Path, trigger: Callable[[list[Path]], bool],
                 timeout: float = 120) -> bool:
    """Start ``fusectl`` with ``args``; SIGKILL it as soon as ``trigger(temp files in folder)``
    holds. Returns True when the kill landed while a temp file existed (mid-save)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", RUN_CLI, *args], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + timeout
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            temps = _temp_files(folder)
            if temps and trigger(temps):
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                return True
            time.sleep(0.0005)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, proc.stderr.read().decode()
    return False


def _at_start(temps: list[Path]) -> bool:
    return True


def _when_bigger_than(size: int) -> Callable[[list[Path]], bool]:
    def trigger(temps: list[Path]) -> bool:
        try:
            return any(p.stat().st_size >= size for p in temps)
        except FileNotFoundError:  # renamed away meanwhile
            return True
    return trigger


@pytest.fixture(scope="module")
def no_rules(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("rules") / "none.yaml"
    path.write_text(NO_RULES)
    return path


def test_killed_inline_save_leaves_old_file_or_new_model(tmp_path: Path, no_rules: Path):
    model = matmul_chain(tmp_path / "m.onnx")
    out = tmp_path / "out.onnx"
    args = ["optimize", str(model), "-o", str(out), "--no-validate", "-q",
            "--no-builtin-rules", "--rules", str(no_rules)]
    assert not run_and_kill(args, tmp_path, lambda _temps: False)  # a complete run
    new = out.read_bytes()
    onnx.checker.check_model(onnx.load_from_string(new))
    old = small_valid_model(tmp_path / "old.onnx").read_bytes()
    mid_save = 0
    for trigger in (_at_start, _when_bigger_than(len(new) // 3),
                    _when_bigger_than(len(new) * 9 // 10)):
        out.write_bytes(old)
        mid_save += run_and_kill(args, tmp_path, trigger)
        assert read(out) in (old, new), "a partial model was left at the output path"
    out.unlink()
    mid_save += run_and_kill(args, tmp_path, _when_bigger_than(len(new) // 2))
    assert read(out) in (None, new)
    assert mid_save >= 3, "the kills should land while the model is being written"


def test_killed_in_place_save_leaves_old_or_new_input(tmp_path: Path, no_rules: Path):
    model = matmul_chain(tmp_path / "m.onnx", layers=4)
    old = model.read_bytes()
    args = ["optimize", str(model), "--in-place", "--no-validate", "-q",
            "--no-builtin-rules", "--rules", str(no_rules)]
    assert run_and_kill(args, tmp_path, _when_bigger_than(len(old) // 2))
    assert model.read_bytes() == old
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["m.onnx"]


def test_killed_external_data_save_leaves_a_consistent_pair(tmp_path: Path, no_rules: Path):
    """The data file is renamed first, the model last: whatever the kill point, the model at
    the output path is either the old one with its old data or the new one with new data."""
    source = tmp_path / "src"
    source.mkdir()
    model = llm(source, hidden=512, ffn=1024)
    out = tmp_path / "out.onnx"
    data = tmp_path / "out.onnx.data"
    args = ["optimize", str(model), "-o", str(out), "--no-validate", "-q",
            "--no-builtin-rules", "--rules", str(no_rules)]
    assert not run_and_kill(args, tmp_path, lambda _temps: False)
    new = (out.read_bytes(), data.read_bytes())
    assert len(new[0]) < 100_000 < len(new[1]), "weights belong in the data file"
    old = (small_valid_model(tmp_path / "old.onnx").read_bytes(), b"old data")
    mid_save = 0
    for trigger in (_at_start, _when_bigger_than(len(new[1]) // 2)):
        out.write_bytes(old[0])
        data.write_bytes(old[1])
        mid_save += run_and_kill(args, tmp_path, trigger)
        assert (read(out), read(data)) in (old, new)
    assert mid_save == 2


# ------------------------------------------------------------------------ in place, backup


def run(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[int, str]:
    code = main([str(a) for a in args])
    return code, capsys.readouterr().err


def files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


@pytest.fixture
def cnn(tmp_path: Path, samples: Path) -> Path:
    target = tmp_path / "cnn.onnx"
    shutil.copy(samples / "cnn.onnx", target)
    return target


def test_in_place_keeps_no_backup_unless_asked(capsys, cnn: Path) -> None:
    original = cnn.read_bytes()
    code, err = run(capsys, "optimize", cnn, "--in-place", "-q")
    assert code == 0, err
    assert files(cnn.parent) == ["cnn.onnx"] and cnn.read_bytes() != original
    cnn.write_bytes(original)
    code, err = run(capsys, "optimize", cnn, "--in-place", "--backup", "-q")
    assert code == 0, err
    assert files(cnn.parent) == ["cnn.onnx", "cnn.onnx.bak"]
    assert (cnn.parent / "cnn.onnx.bak").read_bytes() == original
    assert "BatchNormalization" not in {n.op_type for n in onnx.load(cnn).graph.node}


def test_backup_needs_in_place(capsys, cnn: Path) -> None:
    code, err = run(capsys, "optimize", cnn, "--backup")
    assert code == 2 and "--backup" in err and len(err.strip().splitlines()) == 1
    assert files(cnn.parent) == ["cnn.onnx"]


def test_backup_exactly_when_the_input_is_rewritten(capsys, cnn: Path) -> None:
    """A rule that changes outputs: exit 1; the input is either untouched with no backup, or
    (its bad applications reverted) rewritten with the original kept as the backup."""
    original = cnn.read_bytes()
    code, _ = run(capsys, "optimize", cnn, "--in-place", "--backup", "--no-builtin-rules",
                  "--rules", DATA / "wrong_bn_fold.yaml", "-q")
    assert code == 1
    if cnn.read_bytes() == original:
        assert files(cnn.parent) == ["cnn.onnx"]
    else:
        assert (cnn.parent / "cnn.onnx.bak").read_bytes() == original


def test_in_place_backup_of_external_data_model(capsys, tmp_path: Path) -> None:
    """Both files are backed up; renaming the backups back restores a model that runs."""
    model = llm(tmp_path)
    data = tmp_path / "llm.onnx.data"
    original = (model.read_bytes(), data.read_bytes())
    code, err = run(capsys, "optimize", model, "--in-place", "--backup", "-q")
    assert code == 0, err
    assert files(tmp_path) == ["llm.onnx", "llm.onnx.bak", "llm.onnx.data", "llm.onnx.data.bak"]
    assert ((tmp_path / "llm.onnx.bak").read_bytes(),
            (tmp_path / "llm.onnx.data.bak").read_bytes()) == original
    assert model.read_bytes() != original[0]
    ids = {"input_ids": np.arange(8, dtype=np.int64).reshape(1, 8) * 97}
    optimized = ort.InferenceSession(str(model)).run(None, ids)[0]
    os.replace(tmp_path / "llm.onnx.bak", model)
    os.replace(tmp_path / "llm.onnx.data.bak", data)
    restored = ort.InferenceSession(str(model)).run(None, ids)[0]
    np.testing.assert_allclose(optimized, restored, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------ external data


def test_external_data_model_optimizes_and_saves_external_data(capsys, tmp_path: Path):
    """bench/large_model.py at ~20 MB: streamed weights in an external data file; fusectl
    validates it and writes OUT.data beside the output, which onnxruntime runs."""
    source = tmp_path / "src"
    source.mkdir()
    model = llm(source)
    shape = large_model.Shape(layers=2, hidden=256, ffn=512, vocab=8000, seq=8)
    data_size = (source / "llm.onnx.data").stat().st_size
    assert data_size >= shape.parameters() * 4 > 19_000_000
    out = tmp_path / "out" / "llm.opt.onnx"
    out.parent.mkdir()
    code, err = run(capsys, "optimize", model, "-o", out, "-q")
    assert code == 0, err
    assert files(out.parent) == ["llm.opt.onnx", "llm.opt.onnx.data"]
    assert out.stat().st_size < 200_000, "the weights must not be inline"
    assert (out.parent / "llm.opt.onnx.data").stat().st_size > 19_000_000
    onnx.checker.check_model(onnx.load(out))  # with its external data
    references = onnx.load(out, load_external_data=False)
    locations = {e.value for t in references.graph.initializer for e in t.external_data
                 if e.key == "location"}
    assert locations == {"llm.opt.onnx.data"}
    ids = {"input_ids": np.array([[1, 5, 7000, 42, 3, 3, 9, 0]], dtype=np.int64)}
    expected = ort.InferenceSession(str(model)).run(None, ids)[0]
    actual = ort.InferenceSession(str(out)).run(None, ids)[0]
    assert actual.shape == (1, 8, 8000)
    np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-4)
