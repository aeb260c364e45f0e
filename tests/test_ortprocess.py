"""onnxruntime crashes in its own process, and fusectl says so in one line.

onnxruntime 1.31 dies of SIGFPE on a Scan over an empty axis (onnx-asr's wespeaker feature
extractor reaches one on a short waveform): run in fusectl's process, that ended fusectl with
"Floating point exception" and exit 136.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
import onnx_ir as ir
import pytest
from onnx import TensorProto

from fusectl import ortprocess
from fusectl import validate as v
from fusectl.cli import main

crashes_on_posix = pytest.mark.skipif(os.name != "posix", reason="POSIX signals")


def frames_model(nodes: list[onnx.NodeProto], inits: list[TensorProto]) -> onnx.ModelProto:
    """(s [batch, 2], x [batch, T, 3]) -> y [batch, ?, 5]."""
    graph = oh.make_graph(
        nodes, "g",
        [oh.make_tensor_value_info("s", TensorProto.FLOAT, ["batch", 2]),
         oh.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "T", 3])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", None, 5])], inits)
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)], ir_version=8)


def scan_frames(skip: int = 0) -> onnx.ModelProto:
    """frames[:, t] = concat(state, x[:, t]) for t past ``skip``: a Scan over axis 1.

    With no step left (T <= skip) onnxruntime 1.31 divides by zero in its Scan kernel."""
    body = oh.make_graph(
        [oh.make_node("Concat", ["prev", "curr"], ["frame"], axis=-1),
         oh.make_node("Identity", ["prev"], ["next"])], "body",
        [oh.make_tensor_value_info("prev", TensorProto.FLOAT, ["B", 2]),
         oh.make_tensor_value_info("curr", TensorProto.FLOAT, ["B", 3])],
        [oh.make_tensor_value_info("next", TensorProto.FLOAT, ["B", 2]),
         oh.make_tensor_value_info("frame", TensorProto.FLOAT, ["B", 5])])
    nodes = [
        oh.make_node("Slice", ["x", "skip", "end", "axis"], ["steps"]),
        oh.make_node("Scan", ["s", "steps"], ["last", "frames"], body=body, num_scan_inputs=1,
                     scan_input_axes=[1], scan_output_axes=[1]),
        oh.make_node("Relu", ["frames"], ["y"]),
    ]
    inits = [oh.make_tensor("skip", TensorProto.INT64, [1], [skip]),
             oh.make_tensor("end", TensorProto.INT64, [1], [2**62]),
             oh.make_tensor("axis", TensorProto.INT64, [1], [1])]
    return frames_model(nodes, inits)


def frames_without_scan() -> onnx.ModelProto:
    """What ``scan_frames(0)`` computes, without a Scan (so onnxruntime runs it on any T)."""
    nodes = [
        oh.make_node("Shape", ["x"], ["xs"]),
        oh.make_node("Slice", ["xs", "zero", "two"], ["bt"]),
        oh.make_node("Concat", ["bt", "two1"], ["target"], axis=0),
        oh.make_node("Unsqueeze", ["s", "one"], ["s3"]),
        oh.make_node("Expand", ["s3", "target"], ["states"]),
        oh.make_node("Concat", ["states", "x"], ["frames"], axis=-1),
        oh.make_node("Relu", ["frames"], ["y"]),
    ]
    inits = [oh.make_tensor("zero", TensorProto.INT64, [1], [0]),
             oh.make_tensor("two", TensorProto.INT64, [1], [2]),
             oh.make_tensor("two1", TensorProto.INT64, [1], [2]),
             oh.make_tensor("one", TensorProto.INT64, [1], [1])]
    return frames_model(nodes, inits)


def feeds(steps: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"s": rng.normal(size=(2, 2)).astype(np.float32),
            "x": rng.normal(size=(2, steps, 3)).astype(np.float32)}


@pytest.fixture
def new_worker():
    """The next session starts a new child (or none), and this test's one is stopped after."""
    ortprocess._stop()
    yield
    ortprocess._stop()


def run_frames(steps: int = 3) -> np.ndarray:
    """``frames_without_scan`` run once in a new session: its output."""
    with ortprocess.open_session(frames_without_scan().SerializeToString()) as session:
        (y,), _ = session.run(feeds(steps))
    return y


@crashes_on_posix
def test_a_crash_is_an_error_and_the_next_session_runs():
    crashed = pytest.raises(ortprocess.OrtError, match=r"onnxruntime crashed \(SIGFPE\)")
    with crashed as caught, ortprocess.open_session(scan_frames().SerializeToString()) as session:
        session.run(feeds(0))
    assert caught.value.crashed
    with ortprocess.open_session(scan_frames().SerializeToString()) as session:
        (y,), _ = session.run(feeds(4))
    assert y.shape == (2, 4, 5)


def test_models_agree_where_onnxruntime_runs_both():
    """The two test models compute the same (so a difference below is the crash's)."""
    with ortprocess.open_session(scan_frames().SerializeToString()) as session:
        (expected,), _ = session.run(feeds(4))
    np.testing.assert_allclose(run_frames(4), expected)


@crashes_on_posix
def test_reference_crashing_on_generated_inputs_falls_back():
    """The first inputs leave the Scan no step (T = 8, skip 10): onnxruntime crashes; at
    T = 32 the model runs, and validation says it chose those inputs."""
    model = ir.serde.deserialize_model(scan_frames(skip=10))
    result = v.validate(model, model)
    assert result.passed
    assert result.input_shapes == {"s": (2, 2), "x": (2, 32, 3)}
    assert "onnxruntime crashed (SIGFPE)" in (result.batch_note or "")


@crashes_on_posix
def test_candidate_crashing_fails_validation():
    reference = ir.serde.deserialize_model(frames_without_scan())
    candidate = ir.serde.deserialize_model(scan_frames())
    options = v.ValidationOptions(inputs=feeds(0))
    result = v.validate(reference, candidate, options)
    assert not result.passed
    assert result.error == "onnxruntime could not run the candidate: onnxruntime crashed (SIGFPE)"
    assert v.validate(reference, reference, options).passed  # a new process took over


@crashes_on_posix
def test_cli_reports_the_crash_in_one_line(capsys, tmp_path: Path):
    path = tmp_path / "frames.onnx"
    onnx.save(scan_frames(), path)
    np.savez(tmp_path / "inputs.npz", **feeds(0))
    before = path.read_bytes()
    code = main(["optimize", str(path), "--inputs", str(tmp_path / "inputs.npz"),
                 "-o", str(tmp_path / "out.onnx")])
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err
    assert "onnxruntime cannot run the input model: onnxruntime crashed (SIGFPE)" in lines[0]
    assert not (tmp_path / "out.onnx").exists() and path.read_bytes() == before


@crashes_on_posix
def test_a_killed_process_is_reported_by_its_signal():
    session = ortprocess.open_session(scan_frames().SerializeToString())
    worker = ortprocess._worker
    assert isinstance(worker, ortprocess._Child)
    os.kill(worker.process.pid, signal.SIGKILL)
    with pytest.raises(ortprocess.OrtError, match=r"onnxruntime crashed \(SIGKILL\)"):
        session.run(feeds(4))
    session.close()  # nothing to release: its process is gone


def test_sessions_run_in_this_process_where_no_child_starts(monkeypatch, new_worker):
    monkeypatch.setattr(ortprocess.sys, "executable", "")
    assert run_frames().shape == (2, 3, 5)
    assert isinstance(ortprocess._worker, ortprocess._InProcess)


def test_the_child_takes_its_own_folder_off_the_path():
    """It runs as a script beside fusectl's modules, whose bisect.py would shadow the
    standard library's: its first lines take that folder off ``sys.path``."""
    import subprocess
    import sys

    probe = ("import os, sys; child = sys.argv[1]; sys.path.insert(0, os.path.dirname(child)); "
             "exec(compile(open(child).read(), child, 'exec'), "
             "{'__name__': '__main__', '__file__': child}); "
             "sys.stderr.write(repr([os.path.dirname(child) in sys.path, "
             "'fusectl' in sys.modules]))")
    done = subprocess.run([sys.executable, "-c", probe, ortprocess._CHILD], check=True,
                          capture_output=True, text=True, stdin=subprocess.DEVNULL)
    assert done.stderr.strip().endswith("[False, False]"), done.stderr


@crashes_on_posix
def test_a_process_killed_while_idle_is_replaced_quietly():
    ortprocess.warm_up()
    idle = ortprocess._worker
    assert isinstance(idle, ortprocess._Child)
    idle.process.kill()
    idle.process.wait()
    assert run_frames(2).shape == (2, 2, 5) and ortprocess._worker is not idle


@crashes_on_posix
def test_ctrl_c_is_the_parents(monkeypatch):
    """The child ignores SIGINT (the terminal sends it to both); an interrupt in the parent
    mid-request stops the child, whose reply would otherwise answer the next request."""
    ortprocess.warm_up()
    child = ortprocess._worker
    assert isinstance(child, ortprocess._Child)
    os.kill(child.process.pid, signal.SIGINT)
    assert run_frames(2).shape == (2, 2, 5)
    assert ortprocess._worker is child and child.process.poll() is None

    def interrupted(message):
        raise KeyboardInterrupt

    monkeypatch.setattr(child, "request", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ortprocess.open_session(frames_without_scan().SerializeToString())
    assert ortprocess._worker is None and child.process.poll() is not None


def test_what_the_interpreter_prints_first_is_skipped(tmp_path: Path, monkeypatch,
                                                      new_worker):
    """A sitecustomize (or .pth file) that prints while Python starts wrote into the replies'
    pipe: the child's first words tell the parent where its replies begin."""
    (tmp_path / "sitecustomize.py").write_text(
        "import os\nos.write(1, b'hello from sitecustomize\\n' * 100)\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])]))
    assert run_frames().shape == (2, 3, 5)
    assert isinstance(ortprocess._worker, ortprocess._Child)


def test_a_child_that_never_says_it_runs_falls_back_to_this_process(tmp_path: Path,
                                                                     monkeypatch, new_worker):
    """A frozen or embedded executable cannot run the script: sessions run in-process."""
    mute = tmp_path / "mute.py"
    mute.write_text("import sys\nsys.exit(0)\n")
    monkeypatch.setattr(ortprocess, "_CHILD", str(mute))
    assert run_frames().shape == (2, 3, 5)
    assert isinstance(ortprocess._worker, ortprocess._InProcess)


def test_sessions_of_several_threads_take_turns():
    from concurrent.futures import ThreadPoolExecutor

    model = ir.serde.deserialize_model(frames_without_scan())

    def run(steps: int) -> tuple[int, ...]:
        return v.run_model(model, feeds(steps))["y"].shape

    with ThreadPoolExecutor(4) as pool:
        shapes = list(pool.map(run, [1 + i % 5 for i in range(20)]))
    assert shapes == [(2, 1 + i % 5, 5) for i in range(20)]


def test_a_closed_session_does_not_run():
    session = ortprocess.open_session(frames_without_scan().SerializeToString())
    session.close()
    with pytest.raises(ortprocess.OrtError, match="the session is closed"):
        session.run(feeds(2))
