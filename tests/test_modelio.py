"""Tests for fusectl.modelio: hostile inputs, external data, atomic saves, signatures."""

from __future__ import annotations

import builtins
import hashlib
import io
import os
import random
import stat
import threading
import tracemalloc
from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto
from onnx import numpy_helper as nh

from fusectl import modelio
from fusectl.errors import BadInputError, InternalError
from fusectl.modelio import (
    load_model,
    model_summary,
    restore_signature,
    save_model,
    snapshot_signature,
    upgrade_opset,
)

W_ARR = np.arange(64 * 64, dtype=np.float32).reshape(64, 64) / 100.0
B_ARR = np.linspace(-1, 1, 64, dtype=np.float32)
X_ARR = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)
EXPECTED = X_ARR @ W_ARR + B_ARR

needs_fifo = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs POSIX FIFOs")
needs_symlink = pytest.mark.skipif(os.name != "posix", reason="needs POSIX symlinks")


# ----------------------------------------------------------------------------- helpers


def make_proto(opset: int = 13, initializers: list[TensorProto] | None = None) -> onnx.ModelProto:
    """Y = X @ W + B with a symbolic and an unknown dim, and every metadata field set."""
    x = oh.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 64])
    y = oh.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", None])
    if initializers is None:
        initializers = [nh.from_array(W_ARR, "W"), nh.from_array(B_ARR, "B")]
    graph = oh.make_graph(
        [oh.make_node("MatMul", ["X", "W"], ["T"]), oh.make_node("Add", ["T", "B"], ["Y"])],
        "main_graph",
        [x],
        [y],
        initializers,
        doc_string="graph doc",
    )
    model = oh.make_model(
        graph,
        opset_imports=[oh.make_opsetid("", opset), oh.make_opsetid("com.example", 1)],
        producer_name="unit-test",
        producer_version="9.9",
        doc_string="model doc",
        ir_version=8,  # onnxruntime cannot load onnx 1.23's default IR 14
    )
    model.domain = "org.example"
    model.model_version = 7
    oh.set_model_props(model, {"author": "me", "license": "MIT"})
    return model


def write_proto(proto: onnx.ModelProto, path: Path) -> Path:
    path.write_bytes(proto.SerializeToString())
    return path


def external_ref(arr: np.ndarray, name: str, location: str, offset: int = 0) -> TensorProto:
    """A TensorProto pointing at external data without writing anything."""
    t = nh.from_array(arr, name)
    length = len(t.raw_data)
    onnx.external_data_helper.set_external_data(t, location=location, offset=offset, length=length)
    t.ClearField("raw_data")
    return t


def save_external(proto: onnx.ModelProto, path: Path, location: str = "w.data") -> Path:
    onnx.save_model(
        proto,
        str(path),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=location,
        size_threshold=0,
    )
    return path


def run(path: Path) -> np.ndarray:
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return sess.run(None, {"X": X_ARR})[0]


def assert_bad(exc: BaseException, path: Path | str) -> str:
    msg = str(exc)
    assert isinstance(exc, BadInputError)
    assert "\n" not in msg, msg
    assert msg.startswith(str(path)), msg
    return msg


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def listing(folder: Path) -> list[str]:
    return sorted(os.listdir(folder))


def load_refusing(model_path: Path, forbidden: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """load_model must fail with BadInputError without ever opening ``forbidden``.

    Python-level opens are recorded; ``forbidden`` is usually a FIFO, so a C-level open
    would block: the load runs in a thread and a hang is reported (then unblocked).
    """
    forbidden_real = os.path.realpath(forbidden)
    opened: list[str] = []
    real_open, real_os_open = builtins.open, os.open

    def note(file: object) -> None:
        if isinstance(file, (str, bytes, os.PathLike)):
            opened.append(os.path.realpath(os.fsdecode(file)))

    def rec_open(file, *args, **kwargs):  # type: ignore[no-untyped-def]
        note(file)
        return real_open(file, *args, **kwargs)

    def rec_os_open(file, *args, **kwargs):  # type: ignore[no-untyped-def]
        note(file)
        return real_os_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", rec_open)
    monkeypatch.setattr(io, "open", rec_open)
    monkeypatch.setattr(os, "open", rec_os_open)
    outcome: dict[str, BaseException] = {}

    def target() -> None:
        try:
            load_model(model_path)
        except BaseException as e:  # reported to the test thread
            outcome["exc"] = e

    worker = threading.Thread(target=target, daemon=True)
    worker.start()
    worker.join(10)
    if worker.is_alive():
        if Path(forbidden).is_fifo():  # unblock the reader so the thread can finish
            fd = real_os_open(forbidden, os.O_WRONLY | os.O_NONBLOCK)
            os.close(fd)
        pytest.fail(f"load_model blocked opening {forbidden}")
    monkeypatch.undo()
    assert os.path.realpath(model_path) in opened, "open recorder did not see the model file"
    assert forbidden_real not in opened, f"{forbidden} was opened"
    assert "exc" in outcome, "load_model accepted an escaping external-data location"
    return assert_bad(outcome["exc"], model_path)


@pytest.fixture
def plain_model(tmp_path: Path) -> Path:
    return write_proto(make_proto(), tmp_path / "model.onnx")


@pytest.fixture
def ext_model(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    return save_external(make_proto(), src / "model.onnx")


# ----------------------------------------------------------------------------- bad input


def test_missing_file(tmp_path: Path) -> None:
    p = tmp_path / "nope.onnx"
    with pytest.raises(BadInputError) as ei:
        load_model(p)
    assert "no such file" in assert_bad(ei.value, p)


def test_directory(tmp_path: Path) -> None:
    with pytest.raises(BadInputError) as ei:
        load_model(tmp_path)
    assert "directory" in assert_bad(ei.value, tmp_path)


def test_empty_file(tmp_path: Path) -> None:
    p = tmp_path / "empty.onnx"
    p.write_bytes(b"")
    with pytest.raises(BadInputError) as ei:
        load_model(p)
    assert "empty" in assert_bad(ei.value, p)


@pytest.mark.parametrize(
    "content",
    [
        random.Random(0).randbytes(4096),
        random.Random(1).randbytes(37),
        b"hello, this is a README\nnot a model\n",
        b"\x08\x07",  # parses fine: a ModelProto with only ir_version=7
        b"\x00" * 64,
    ],
    ids=["random4k", "random37", "text", "ir-version-only", "zeros"],
)
def test_not_a_model(tmp_path: Path, content: bytes) -> None:
    p = tmp_path / "junk.onnx"
    p.write_bytes(content)
    with pytest.raises(BadInputError) as ei:
        load_model(p)
    assert "not a valid ONNX model" in assert_bad(ei.value, p)


def test_truncated_protobuf(tmp_path: Path) -> None:
    data = make_proto().SerializeToString()
    for cut in (1, 3, 20, len(data) // 3, len(data) // 2, len(data) - 5):
        p = tmp_path / f"cut{cut}.onnx"
        p.write_bytes(data[:cut])
        with pytest.raises(BadInputError) as ei:
            load_model(p)
        assert_bad(ei.value, p)


@pytest.mark.parametrize("defect", ["no-graph", "ir-version-0", "no-opset"])
def test_structurally_empty_model(tmp_path: Path, defect: str) -> None:
    proto = make_proto()
    if defect == "no-graph":
        proto.ClearField("graph")
    elif defect == "ir-version-0":
        proto.ir_version = 0
    else:
        del proto.opset_import[:]
    p = write_proto(proto, tmp_path / "m.onnx")
    with pytest.raises(BadInputError) as ei:
        load_model(p)
    assert "not a valid ONNX model" in assert_bad(ei.value, p)


def test_missing_external_data_file(ext_model: Path) -> None:
    (ext_model.parent / "w.data").unlink()
    with pytest.raises(BadInputError) as ei:
        load_model(ext_model)
    msg = assert_bad(ei.value, ext_model)
    assert "w.data" in msg and "not found" in msg


def test_truncated_external_data_file(ext_model: Path) -> None:
    data = ext_model.parent / "w.data"
    data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(BadInputError) as ei:
        load_model(ext_model)
    assert "beyond the end" in assert_bad(ei.value, ext_model)


def test_hardlinked_external_data_refused(ext_model: Path, tmp_path: Path) -> None:
    os.link(ext_model.parent / "w.data", tmp_path / "elsewhere.data")
    with pytest.raises(BadInputError) as ei:
        load_model(ext_model)
    assert "hard link" in assert_bad(ei.value, ext_model)


def _escape_model(model_dir: Path, location: str, where: str = "initializer") -> Path:
    """A model whose W lives at ``location``; ``where`` places the tensor in odd spots."""
    model_dir.mkdir(parents=True, exist_ok=True)
    bad = external_ref(W_ARR, "W", location)
    if where == "initializer":
        proto = make_proto(initializers=[bad, nh.from_array(B_ARR, "B")])
    elif where == "constant":
        proto = make_proto(initializers=[nh.from_array(B_ARR, "B")])
        proto.graph.node.insert(0, oh.make_node("Constant", [], ["W"], value=bad))
    elif where == "subgraph":
        proto = make_proto()
        then_g = oh.make_graph(
            [oh.make_node("Identity", ["K"], ["o"])],
            "then",
            [],
            [oh.make_tensor_value_info("o", TensorProto.FLOAT, [64, 64])],
            [external_ref(W_ARR, "K", location)],
        )
        else_g = oh.make_graph(
            [oh.make_node("Identity", ["W"], ["o2"])],
            "else",
            [],
            [oh.make_tensor_value_info("o2", TensorProto.FLOAT, [64, 64])],
        )
        proto.graph.initializer.append(nh.from_array(np.array(True), "c"))
        proto.graph.node.append(
            oh.make_node("If", ["c"], ["unused"], then_branch=then_g, else_branch=else_g)
        )
    else:  # function body
        proto = make_proto()
        fn = oh.make_function(
            "com.example",
            "Evil",
            [],
            ["o"],
            [oh.make_node("Constant", [], ["o"], value=bad)],
            [oh.make_opsetid("", 13)],
        )
        proto.functions.append(fn)
    return write_proto(proto, model_dir / "model.onnx")


@needs_fifo
@pytest.mark.parametrize("where", ["initializer", "constant", "subgraph", "function"])
def test_dotdot_escape_never_opened(tmp_path, monkeypatch, where) -> None:
    secret = tmp_path / "x.data"
    os.mkfifo(secret)
    model = _escape_model(tmp_path / "m", "../x.data", where)
    assert "'..'" in load_refusing(model, secret, monkeypatch)


@needs_fifo
def test_nested_dotdot_escape_never_opened(tmp_path, monkeypatch) -> None:
    secret = tmp_path / "x.data"
    os.mkfifo(secret)
    (tmp_path / "m" / "sub").mkdir(parents=True)
    model = _escape_model(tmp_path / "m", "sub/../../x.data")
    load_refusing(model, secret, monkeypatch)


@needs_fifo
def test_absolute_location_never_opened(tmp_path, monkeypatch) -> None:
    secret = tmp_path / "x.data"
    os.mkfifo(secret)
    model = _escape_model(tmp_path / "m", str(secret))
    assert "absolute" in load_refusing(model, secret, monkeypatch)


def test_etc_passwd_never_opened(tmp_path, monkeypatch) -> None:
    model = _escape_model(tmp_path / "m", "/etc/passwd")
    assert "absolute" in load_refusing(model, Path("/etc/passwd"), monkeypatch)


@needs_fifo
@needs_symlink
def test_symlink_escape_never_opened(tmp_path, monkeypatch) -> None:
    secret = tmp_path / "outside.data"
    os.mkfifo(secret)
    model = _escape_model(tmp_path / "m", "w.data")
    os.symlink(secret, tmp_path / "m" / "w.data")
    assert "resolves to" in load_refusing(model, secret, monkeypatch)


@needs_symlink
def test_symlinked_directory_escape(tmp_path, monkeypatch) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    secret = outside / "w.data"
    secret.write_bytes(W_ARR.tobytes())
    model = _escape_model(tmp_path / "m", "link/w.data")
    os.symlink(outside, tmp_path / "m" / "link")
    load_refusing(model, secret, monkeypatch)


@needs_symlink
def test_symlink_inside_folder_is_fine(tmp_path: Path) -> None:
    model = _escape_model(tmp_path / "m", "w.data")
    (tmp_path / "m" / "real").mkdir()
    (tmp_path / "m" / "real" / "w.bin").write_bytes(W_ARR.tobytes())
    os.symlink(tmp_path / "m" / "real" / "w.bin", tmp_path / "m" / "w.data")
    loaded = load_model(model)
    np.testing.assert_array_equal(loaded.graph.initializers["W"].const_value.numpy(), W_ARR)


@needs_fifo
def test_fifo_data_inside_folder_refused_without_blocking(tmp_path, monkeypatch) -> None:
    model = _escape_model(tmp_path / "m", "w.data")
    os.mkfifo(tmp_path / "m" / "w.data")
    assert "not a regular file" in load_refusing(model, tmp_path / "m" / "w.data", monkeypatch)


@needs_fifo
def test_fifo_model_refused_without_blocking(tmp_path: Path) -> None:
    p = tmp_path / "pipe.onnx"
    os.mkfifo(p)
    with pytest.raises(BadInputError) as ei:
        load_model(p)
    assert "not a regular file" in assert_bad(ei.value, p)


# ----------------------------------------------------------------------------- loading


def test_external_data_stays_lazy(ext_model: Path) -> None:
    model = load_model(ext_model)
    w = model.graph.initializers["W"].const_value
    assert isinstance(w, ir.ExternalTensor)
    assert w.raw is None  # not memory-mapped yet
    assert os.path.isabs(w.base_dir)
    summary = model_summary(model)
    assert summary["initializer_bytes"] == W_ARR.nbytes + B_ARR.nbytes
    assert w.raw is None  # the summary never touched the data
    np.testing.assert_array_equal(w.numpy(), W_ARR)


def test_relative_path_from_model_folder(ext_model: Path, monkeypatch) -> None:
    monkeypatch.chdir(ext_model.parent)
    model = load_model("model.onnx")
    np.testing.assert_array_equal(model.graph.initializers["W"].const_value.numpy(), W_ARR)


def test_large_external_model_loads_and_saves_without_reading_into_memory(tmp_path) -> None:
    big = np.ones((8 * 1024 * 1024,), dtype=np.float32)  # 32 MiB
    proto = make_proto(initializers=[nh.from_array(W_ARR, "W"), nh.from_array(B_ARR, "B")])
    proto.graph.initializer.append(nh.from_array(big, "Big"))
    src = tmp_path / "src"
    src.mkdir()
    save_external(proto, src / "m.onnx")
    del proto
    tracemalloc.start()
    try:
        model = load_model(src / "m.onnx")
        _, load_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        save_model(model, tmp_path / "out.onnx")
        _, save_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert load_peak < 8 * 2**20, load_peak
    assert save_peak < 8 * 2**20, save_peak
    assert (tmp_path / "out.onnx.data").stat().st_size >= big.nbytes
    np.testing.assert_array_equal(run(tmp_path / "out.onnx"), run(src / "m.onnx"))


# ----------------------------------------------------------------------------- round trips


def test_round_trip_preserves_metadata_and_io(plain_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.onnx"
    assert save_model(load_model(plain_model), out) == [out]
    a, b = onnx.load(str(plain_model)), onnx.load(str(out))
    assert list(a.opset_import) == list(b.opset_import)
    assert list(a.metadata_props) == list(b.metadata_props)
    assert (a.doc_string, a.producer_name, a.producer_version) == (
        b.doc_string,
        b.producer_name,
        b.producer_version,
    )
    assert (a.ir_version, a.domain, a.model_version) == (b.ir_version, b.domain, b.model_version)
    assert (a.graph.name, a.graph.doc_string) == (b.graph.name, b.graph.doc_string)
    assert list(a.graph.input) == list(b.graph.input)
    assert list(a.graph.output) == list(b.graph.output)
    assert b.graph.output[0].type.tensor_type.shape.dim[0].dim_param == "N"
    unknown = b.graph.output[0].type.tensor_type.shape.dim[1]
    assert not unknown.HasField("dim_param") and not unknown.HasField("dim_value")
    np.testing.assert_allclose(run(out), EXPECTED, rtol=1e-5)


def test_external_model_resaved_beside_new_file(ext_model: Path, tmp_path: Path) -> None:
    before = {p.name: digest(p) for p in ext_model.parent.iterdir()}
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    out = out_dir / "model.opt.onnx"
    written = save_model(load_model(ext_model), out, overwrite_protect=ext_model)
    data = out_dir / "model.opt.onnx.data"
    assert written == [out, data]
    assert listing(out_dir) == ["model.opt.onnx", "model.opt.onnx.data"]
    proto = onnx.load(str(out), load_external_data=False)
    w = next(t for t in proto.graph.initializer if t.name == "W")
    assert w.data_location == TensorProto.EXTERNAL
    assert {e.key: e.value for e in w.external_data}["location"] == "model.opt.onnx.data"
    b = next(t for t in proto.graph.initializer if t.name == "B")
    assert b.data_location != TensorProto.EXTERNAL  # 256 bytes stays inline
    np.testing.assert_allclose(run(out), EXPECTED, rtol=1e-5)
    assert {p.name: digest(p) for p in ext_model.parent.iterdir()} == before


def test_forced_external_data_on_small_model(plain_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "model.opt.onnx"
    written = save_model(load_model(plain_model), out, external_data=True)
    assert written == [out, tmp_path / "model.opt.onnx.data"]
    assert (tmp_path / "model.opt.onnx.data").stat().st_size == W_ARR.nbytes
    np.testing.assert_allclose(run(out), EXPECTED, rtol=1e-5)


def test_forced_inline_on_external_model(ext_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "single.onnx"
    assert save_model(load_model(ext_model), out, external_data=False) == [out]
    assert listing(tmp_path) == ["single.onnx", "src"]
    proto = onnx.load(str(out), load_external_data=False)
    assert all(t.data_location != TensorProto.EXTERNAL for t in proto.graph.initializer)
    np.testing.assert_allclose(run(out), EXPECTED, rtol=1e-5)


def test_auto_external_threshold(plain_model: Path, tmp_path: Path, monkeypatch) -> None:
    model = load_model(plain_model)
    assert save_model(model, tmp_path / "a.onnx") == [tmp_path / "a.onnx"]
    monkeypatch.setattr(modelio, "EXTERNAL_DATA_AUTO_BYTES", 1000)
    assert save_model(model, tmp_path / "b.onnx")[1] == tmp_path / "b.onnx.data"


def test_external_constant_attribute_is_rehomed(tmp_path: Path) -> None:
    src = tmp_path / "src"
    model_path = _escape_model(src, "c.data", where="constant")
    (src / "c.data").write_bytes(W_ARR.tobytes())
    out = tmp_path / "out.onnx"
    save_model(load_model(model_path), out)
    np.testing.assert_allclose(run(out), EXPECTED, rtol=1e-5)


# ----------------------------------------------------------------------------- atomicity


def _half_then_fail(encoding, f) -> None:  # type: ignore[no-untyped-def]
    data = encoding.tobytes()
    f.write(data[: len(data) // 2])
    raise RuntimeError("disk on fire")


def test_failed_inline_save_leaves_old_file(plain_model: Path, tmp_path: Path, monkeypatch):
    out = tmp_path / "out.onnx"
    out.write_bytes(b"previous contents")
    before = listing(tmp_path)
    monkeypatch.setattr(modelio, "_write_encoding", _half_then_fail)
    with pytest.raises(RuntimeError, match="disk on fire"):
        save_model(load_model(plain_model), out)
    assert out.read_bytes() == b"previous contents"
    assert listing(tmp_path) == before


def test_failed_external_save_leaves_old_pair(ext_model: Path, tmp_path: Path, monkeypatch):
    out = tmp_path / "out.onnx"
    model = load_model(ext_model)
    save_model(model, out)
    saved = {p: digest(p) for p in (out, tmp_path / "out.onnx.data")}
    before = listing(tmp_path)
    monkeypatch.setattr(modelio, "_write_encoding", _half_then_fail)
    with pytest.raises(RuntimeError):
        save_model(model, out)
    assert {p: digest(p) for p in saved} == saved
    assert listing(tmp_path) == before
    monkeypatch.undo()
    save_model(model, out)  # the model is still intact and saveable
    np.testing.assert_allclose(run(out), EXPECTED, rtol=1e-5)


def test_failure_after_data_written_cleans_up(ext_model: Path, tmp_path: Path, monkeypatch):
    out = tmp_path / "out.onnx"
    out.write_bytes(b"old model")
    (tmp_path / "out.onnx.data").write_bytes(b"old data")
    before = listing(tmp_path)
    real = ir.external_data.convert_tensors_to_external

    def write_then_fail(*args, **kwargs):  # type: ignore[no-untyped-def]
        real(*args, **kwargs)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ir.external_data, "convert_tensors_to_external", write_then_fail)
    with pytest.raises(BadInputError) as ei:
        save_model(load_model(ext_model), out)
    assert "saving failed" in assert_bad(ei.value, out) and "No space left" in str(ei.value)
    assert out.read_bytes() == b"old model"
    assert (tmp_path / "out.onnx.data").read_bytes() == b"old data"
    assert listing(tmp_path) == before


def test_failed_data_rename_leaves_old_pair(ext_model: Path, tmp_path: Path, monkeypatch):
    out = tmp_path / "out.onnx"
    model = load_model(ext_model)
    save_model(model, out)
    saved = {p: digest(p) for p in (out, tmp_path / "out.onnx.data")}
    before = listing(tmp_path)
    real_replace = os.replace

    def failing_replace(src, dst):  # type: ignore[no-untyped-def]
        if os.fspath(dst).endswith("out.onnx.data") and ".tmp" in os.fspath(src):
            raise PermissionError(13, "Permission denied", os.fspath(dst))
        return real_replace(src, dst)

    monkeypatch.setattr(modelio.os, "replace", failing_replace)
    with pytest.raises(BadInputError):
        save_model(model, out)
    monkeypatch.undo()
    assert {p: digest(p) for p in saved} == saved
    assert listing(tmp_path) == before
    np.testing.assert_allclose(model.graph.initializers["W"].const_value.numpy(), W_ARR)


def test_rename_order_data_first_model_last(ext_model: Path, tmp_path: Path, monkeypatch):
    out = tmp_path / "out.onnx"
    renames: list[str] = []
    real_replace = os.replace

    def spy(src, dst):  # type: ignore[no-untyped-def]
        # The model must only appear after its data is complete under the final name.
        if os.fspath(dst) == os.fspath(out):
            assert (tmp_path / "out.onnx.data").stat().st_size == W_ARR.nbytes
        renames.append(Path(dst).name)
        return real_replace(src, dst)

    monkeypatch.setattr(modelio.os, "replace", spy)
    save_model(load_model(ext_model), out)
    assert renames[-2:] == ["out.onnx.data", "out.onnx"]
    assert not [n for n in listing(tmp_path) if n.startswith(".")]


@pytest.mark.skipif(os.name != "posix", reason="POSIX permission bits")
def test_saved_files_get_normal_permissions(ext_model: Path, tmp_path: Path) -> None:
    umask = os.umask(0o022)
    os.umask(umask)
    out = tmp_path / "out.onnx"
    model = load_model(ext_model)
    save_model(model, out)
    for p in (out, tmp_path / "out.onnx.data"):
        assert stat.S_IMODE(p.stat().st_mode) == 0o666 & ~umask  # not mkstemp's 0600
    out.chmod(0o640)
    (tmp_path / "out.onnx.data").chmod(0o604)
    save_model(model, out)
    assert stat.S_IMODE(out.stat().st_mode) == 0o640
    assert stat.S_IMODE((tmp_path / "out.onnx.data").stat().st_mode) == 0o604


# ----------------------------------------------------------------------------- overwrite / in place


def test_overwrite_protection(plain_model: Path) -> None:
    before = digest(plain_model)
    model = load_model(plain_model)
    spelled = plain_model.parent / "." / ".." / plain_model.parent.name / plain_model.name
    for target in (plain_model, spelled):
        with pytest.raises(BadInputError) as ei:
            save_model(model, target, overwrite_protect=plain_model)
        assert "refusing to overwrite" in assert_bad(ei.value, target)
    assert digest(plain_model) == before


@needs_symlink
def test_overwrite_protection_through_symlink(plain_model: Path, tmp_path: Path) -> None:
    link = tmp_path / "link.onnx"
    os.symlink(plain_model, link)
    with pytest.raises(BadInputError):
        save_model(load_model(plain_model), link, overwrite_protect=plain_model)


def test_overwrite_protection_of_input_data_file(tmp_path: Path) -> None:
    # The input keeps its weights in "out.onnx.data", exactly what saving out.onnx would write.
    src = save_external(make_proto(), tmp_path / "in.onnx", location="out.onnx.data")
    before = digest(tmp_path / "out.onnx.data")
    with pytest.raises(BadInputError) as ei:
        save_model(load_model(src), tmp_path / "out.onnx", overwrite_protect=src)
    assert "external data" in assert_bad(ei.value, tmp_path / "out.onnx")
    assert digest(tmp_path / "out.onnx.data") == before


def test_in_place_with_same_data_file_and_shifted_offsets(tmp_path: Path) -> None:
    """In place, the new data file replaces the one being read lazily; offsets also move."""
    first = np.full((128, 64), 7.0, dtype=np.float32)  # dropped below, so W moves to offset 0
    proto = make_proto()
    proto.graph.initializer.insert(0, nh.from_array(first, "Unused"))
    path = save_external(proto, tmp_path / "m.onnx", location="m.onnx.data")
    model = load_model(path)
    old_w = model.graph.initializers["W"].const_value
    model.graph.initializers.pop("Unused")
    written = save_model(model, path, overwrite_protect=None)
    assert written == [path, tmp_path / "m.onnx.data"]
    assert listing(tmp_path) == ["m.onnx", "m.onnx.data"]
    assert (tmp_path / "m.onnx.data").stat().st_size == W_ARR.nbytes
    np.testing.assert_allclose(run(path), EXPECTED, rtol=1e-5)
    # The in-memory model now reads the new file; the stale tensor refuses to read.
    np.testing.assert_array_equal(model.graph.initializers["W"].const_value.numpy(), W_ARR)
    with pytest.raises(ValueError, match="invalidated"):
        old_w.numpy()
    reloaded = load_model(path)
    np.testing.assert_array_equal(reloaded.graph.initializers["W"].const_value.numpy(), W_ARR)


def test_save_errors_are_one_line(plain_model: Path, tmp_path: Path) -> None:
    model = load_model(plain_model)
    for target in (tmp_path, tmp_path / "missing-dir" / "x.onnx"):
        with pytest.raises(BadInputError) as ei:
            save_model(model, target)
        assert_bad(ei.value, target)


# ----------------------------------------------------------------------------- signature


def test_snapshot_restore_after_optimizer_changes(plain_model: Path, tmp_path: Path) -> None:
    model = load_model(plain_model)
    sig = snapshot_signature(model)
    y = model.graph.outputs[0]
    y.shape = ir.Shape([3, 64])  # "shape inference" refined it
    y.name = "renamed"
    model.graph.inputs[0].shape = ir.Shape([1, 64])
    model.opset_imports[""] = 15
    model.opset_imports["com.microsoft"] = 1
    model.ir_version = 9
    model.producer_name = "fusectl"
    model.doc_string = None
    model.metadata_props["added"] = "x"
    model.metadata_props.pop("author")
    model.graph.name = "other"
    model.graph.doc_string = "changed"
    restore_signature(model, sig)
    out = tmp_path / "out.onnx"
    save_model(model, out)
    a, b = onnx.load(str(plain_model)), onnx.load(str(out))
    assert list(a.graph.input) == list(b.graph.input)
    assert list(a.graph.output) == list(b.graph.output)
    assert list(a.metadata_props) == list(b.metadata_props)
    assert {o.domain: o.version for o in b.opset_import} == {
        "": 13,
        "com.example": 1,
        "com.microsoft": 1,  # added by the optimizer: kept
    }
    assert (b.ir_version, b.producer_name, b.doc_string) == (8, "unit-test", "model doc")
    assert (b.graph.name, b.graph.doc_string) == ("main_graph", "graph doc")
    np.testing.assert_allclose(run(out), EXPECTED, rtol=1e-5)


def test_restore_keep_opsets(plain_model: Path) -> None:
    model = load_model(plain_model)
    sig = snapshot_signature(model)
    upgraded = upgrade_opset(model, 17)
    upgraded.ir_version = 9
    restore_signature(upgraded, sig, keep_opsets=True)
    assert upgraded.opset_imports[""] == 17
    assert upgraded.ir_version == 9
    restore_signature(upgraded, sig)
    assert upgraded.opset_imports[""] == 13 and upgraded.ir_version == 8


def test_restore_when_output_became_graph_input(tmp_path: Path) -> None:
    x = oh.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 64])
    y = oh.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 64])
    graph = oh.make_graph([oh.make_node("Identity", ["X"], ["Y"])], "g", [x], [y])
    proto = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 13)], ir_version=8)
    model = load_model(write_proto(proto, tmp_path / "m.onnx"))
    sig = snapshot_signature(model)
    g = model.graph
    g.outputs[0] = g.inputs[0]  # an optimizer removed the Identity
    g.remove(g.node(0), safe=True)
    restore_signature(model, sig)
    assert [v.name for v in g.inputs] == ["X"] and [v.name for v in g.outputs] == ["Y"]
    out = tmp_path / "out.onnx"
    save_model(model, out)
    np.testing.assert_array_equal(run(out), X_ARR)


def test_restore_rejects_changed_io_count(plain_model: Path) -> None:
    model = load_model(plain_model)
    sig = snapshot_signature(model)
    model.graph.outputs.append(model.graph.inputs[0])
    with pytest.raises(InternalError):
        restore_signature(model, sig)


# ----------------------------------------------------------------------------- opset / summary


def test_upgrade_opset_13_to_17(ext_model: Path, tmp_path: Path) -> None:
    model = load_model(ext_model)
    upgraded = upgrade_opset(model, 17)
    assert upgraded.opset_imports[""] == 17
    w = upgraded.graph.initializers["W"].const_value
    assert isinstance(w, ir.ExternalTensor) and w.raw is None
    out = tmp_path / "up.onnx"
    save_model(upgraded, out)
    assert onnx.load(str(out), load_external_data=False).opset_import[0].version == 17
    np.testing.assert_allclose(run(out), EXPECTED, rtol=1e-5)


def test_upgrade_opset_refusals(plain_model: Path) -> None:
    model = load_model(plain_model)
    assert upgrade_opset(model, 13) is model
    for version, needle in ((11, "downgrade"), (999, "at most")):
        with pytest.raises(BadInputError) as ei:
            upgrade_opset(model, version)
        assert needle in str(ei.value) and "\n" not in str(ei.value)


def test_upgrade_opset_converter_failure_is_one_line(tmp_path: Path) -> None:
    x = oh.make_tensor_value_info("X", TensorProto.FLOAT, [2])
    graph = oh.make_graph([oh.make_node("NoSuchOp", ["X"], ["Y"])], "g", [x], [x])
    graph.output[0].name = "Y"
    proto = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 13)], ir_version=8)
    model = ir.from_proto(proto)  # load_model refuses it: onnx's checker knows no NoSuchOp
    with pytest.raises(BadInputError) as ei:
        upgrade_opset(model, 17)
    assert str(ei.value).startswith("cannot upgrade opset 13 to 17") and "\n" not in str(ei.value)


def test_model_summary_counts_subgraphs(tmp_path: Path) -> None:
    proto = make_proto()
    then_g = oh.make_graph(
        [oh.make_node("Relu", ["Y"], ["a"]), oh.make_node("Neg", ["a"], ["o"])],
        "then",
        [],
        [oh.make_tensor_value_info("o", TensorProto.FLOAT, None)],
    )
    else_g = oh.make_graph(
        [oh.make_node("Relu", ["Y"], ["o2"])],
        "else",
        [],
        [oh.make_tensor_value_info("o2", TensorProto.FLOAT, None)],
        [nh.from_array(np.zeros((4, 4), np.float16), "H")],
    )
    proto.graph.initializer.append(nh.from_array(np.array(True), "c"))
    proto.graph.node.append(
        oh.make_node("If", ["c"], ["z"], then_branch=then_g, else_branch=else_g)
    )
    proto.graph.node.append(oh.make_node("Custom", ["z"], ["w"], domain="com.example"))
    summary = model_summary(load_model(write_proto(proto, tmp_path / "m.onnx")))
    assert summary["node_count"] == 4
    assert summary["subgraph_node_count"] == 3
    assert summary["op_histogram"] == {
        "MatMul": 1,
        "Add": 1,
        "If": 1,
        "Relu": 2,
        "Neg": 1,
        "com.example.Custom": 1,
    }
    assert summary["initializer_count"] == 4
    assert summary["initializer_bytes"] == W_ARR.nbytes + B_ARR.nbytes + 1 + 32
    assert summary["opset_imports"] == {"": 13, "com.example": 1}


def _minus_one_model(path: Path) -> Path:
    """Conv + BatchNormalization with batch declared -1 (Paddle2ONNX's dynamic dim) on the
    input, the output and an intermediate's value_info."""
    rng = np.random.default_rng(0)
    inits = [nh.from_array(rng.normal(0, 0.3, (4, 3, 3, 3)).astype(np.float32), "w")]
    inits += [nh.from_array(rng.uniform(0.5, 1.5, 4).astype(np.float32), n)
              for n in ("s", "b", "m", "v")]
    graph = oh.make_graph(
        [oh.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
         oh.make_node("BatchNormalization", ["c", "s", "b", "m", "v"], ["y"])],
        "paddle", [oh.make_tensor_value_info("x", TensorProto.FLOAT, [-1, 3, 8, 8])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, [-1, 4, 8, 8])], inits,
        value_info=[oh.make_tensor_value_info("c", TensorProto.FLOAT, [-1, 4, 8, 8])])
    onnx.save(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 13)], ir_version=7), path)
    return path


def test_minus_one_dims_are_dynamic_inside_and_declared_again_on_save(tmp_path: Path) -> None:
    import fusectl

    source = _minus_one_model(tmp_path / "paddle.onnx")
    for model in (load_model(source), modelio.from_proto(onnx.load(source))):
        for value in (*model.graph.inputs, *model.graph.outputs,
                      *(o for n in model.graph for o in n.outputs)):
            assert value.shape is not None
            assert not any(isinstance(d, int) and d < 0 for d in value.shape), value
        assert modelio.snapshot_signature(model).inputs[0].dims == (-1, 3, 8, 8)
    result = fusectl.optimize(source)
    assert result.passed, result.validation
    assert result.rewrite.counts() == {"conv-bn-fold": 1}
    assert result.traffic_after.total_bytes >= 0  # a -1 never multiplies into the bytes
    out = tmp_path / "out.onnx"
    save_model(result.model, out)
    saved = onnx.load(out)
    for info, batch in ((saved.graph.input[0], -1), (saved.graph.output[0], -1)):
        assert info.type.tensor_type.shape.dim[0].dim_value == batch
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    x = np.ones((2, 3, 8, 8), np.float32)
    assert session.run(None, {"x": x})[0].shape == (2, 4, 8, 8)
    # An ir.Model handed to the API is read the same way, and its signature kept too.
    from_ir = fusectl.optimize(ir.load(source))
    assert from_ir.passed and from_ir.rewrite.counts() == {"conv-bn-fold": 1}
    assert from_ir.model.graph.inputs[0].shape[0] == -1
    assert from_ir.traffic_after.total_bytes >= 0


@pytest.mark.parametrize(("op", "opset", "inputs"), [
    ("SimplifiedLayerNormalization", 17, ["x", "g"]),
    ("LayerNormalization", 12, ["x", "g", "b"]),
])
def test_onnxruntime_default_domain_ops_load(tmp_path: Path, op, opset, inputs) -> None:
    """A model fusectl or onnxruntime optimized for onnxruntime holds contrib ops in the
    default domain that onnx's checker has no schema for at that opset: it loads again."""
    inits = [nh.from_array(np.ones(4, np.float32), "g"), nh.from_array(np.zeros(4, np.float32),
                                                                       "b")]
    graph = oh.make_graph([oh.make_node(op, inputs, ["y"], axis=-1, epsilon=1e-5)], "g",
                          [oh.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                          [oh.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
                          inits[:len(inputs) - 1])
    path = tmp_path / "contrib.onnx"
    onnx.save(oh.make_model(graph, opset_imports=[oh.make_opsetid("", opset)], ir_version=8),
              path)
    model = load_model(path)
    assert [n.op_type for n in model.graph] == [op]
    bad = onnx.load(path)
    bad.graph.node[0].op_type = "NotAnOnnxruntimeOp"  # the rest is still checked
    onnx.save(bad, path)
    with pytest.raises(BadInputError, match="onnx checker"):
        load_model(path)


def test_an_output_declared_with_the_wrong_rank_does_not_untype_the_model(tmp_path: Path):
    """onnx's strict inference gives up on the whole model when an exporter declared an
    output with the wrong rank (onnxruntime ignores it); the values inside still get types."""
    graph = oh.make_graph(
        [oh.make_node("Relu", ["x"], ["r"]), oh.make_node("Reshape", ["r", "s"], ["y"])], "g",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, [1, "seqlen"])],
        [nh.from_array(np.array([6, 1, 4], np.int64), "s")])
    path = tmp_path / "wrong_rank.onnx"
    onnx.save(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 14)], ir_version=8), path)
    with pytest.raises(onnx.shape_inference.InferenceError):
        onnx.shape_inference.infer_shapes(onnx.load(path), strict_mode=True, data_prop=True)
    model = load_model(path)
    relu = next(n for n in model.graph if n.op_type == "Relu")
    assert relu.outputs[0].shape == ir.Shape([2, 3, 4])


def test_protobufs_own_size_refusal_is_one_clear_error(tmp_path, plain_model, monkeypatch):
    """Over 2 GiB outside the initializers (a Constant's tensor kept inline), protobuf
    refuses to serialize with a bare EncodeError: the user gets the 2 GiB advice instead,
    and nothing is written."""
    from google.protobuf.message import EncodeError

    from fusectl import modelio

    def refuse(model):
        raise EncodeError("Failed to serialize proto")

    monkeypatch.setattr(modelio, "encode_model", refuse)
    out = tmp_path / "out.onnx"
    with pytest.raises(BadInputError, match="2 GiB limit; save with external data"):
        save_model(load_model(plain_model), out)
    assert not out.exists() and list(tmp_path.iterdir()) == [plain_model]  # no temp file


def _stale_batch_model(path: Path) -> None:
    """``Reshape(x*x, Concat(Shape(Relu(x))[:1], [2, 2]))`` with the batch made dynamic in
    the signature but ``value_info`` still declaring the Relu's output ``[1, 4]``."""
    graph = oh.make_graph(
        [oh.make_node("Relu", ["x"], ["a"]),
         oh.make_node("Shape", ["a"], ["sh"], end=1),
         oh.make_node("Concat", ["sh", "two"], ["t"], axis=0),
         oh.make_node("Mul", ["x", "x"], ["b"]),
         oh.make_node("Reshape", ["b", "t"], ["z"])], "g",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [oh.make_tensor_value_info("z", TensorProto.FLOAT, ["N", 2, 2])],
        [nh.from_array(np.array([2, 2], np.int64), "two")],
        value_info=[oh.make_tensor_value_info("a", TensorProto.FLOAT, [1, 4])])
    onnx.save(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)], ir_version=8), path)


def test_a_stale_declared_dim_gives_way_to_the_computed_one(tmp_path: Path) -> None:
    """onnx's inference keeps a declared 1 over the batch it computes; the model's own
    arithmetic wins at load, so no rule bakes the 1 into a Reshape target."""
    path = tmp_path / "stale.onnx"
    _stale_batch_model(path)
    kept = onnx.shape_inference.infer_shapes(onnx.load(path), data_prop=True)
    declared = next(v for v in kept.graph.value_info if v.name == "a")
    assert [d.dim_value for d in declared.type.tensor_type.shape.dim] == [1, 4]  # onnx's merge
    model = load_model(path)
    relu = next(n for n in model.graph if n.op_type == "Relu")
    assert relu.outputs[0].shape == ir.Shape(["N", 4])


def test_a_stale_declared_batch_does_not_break_the_optimized_model(tmp_path: Path) -> None:
    """End to end, without validation: the optimized model still runs, and agrees, at a
    batch other than the declared 1."""
    from fusectl import api

    path, out = tmp_path / "stale.onnx", tmp_path / "out.onnx"
    _stale_batch_model(path)
    result = api.optimize(path, check=False)
    assert result.ops_after["Shape"] == 0  # the Shape chain became a constant target
    save_model(result.model, out)
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    expected = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    got = ort.InferenceSession(str(out), options, providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(got.run(None, {"x": x})[0], expected.run(None, {"x": x})[0])


def test_a_declared_name_stays_where_inference_cannot_tell(tmp_path: Path) -> None:
    """A Reshape to a target fed at run time: inference knows the rank only, so the
    declared dims stay; a declared rank that contradicts the computed one does not."""
    graph = oh.make_graph(
        [oh.make_node("Reshape", ["x", "t"], ["r"]), oh.make_node("Relu", ["r"], ["y"]),
         oh.make_node("Relu", ["x"], ["w"]), oh.make_node("Add", ["w", "w"], ["v"])], "g",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4]),
         oh.make_tensor_value_info("t", TensorProto.INT64, [2])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, None),
         oh.make_tensor_value_info("v", TensorProto.FLOAT, None)],
        value_info=[oh.make_tensor_value_info("r", TensorProto.FLOAT, ["S", 8]),
                    oh.make_tensor_value_info("w", TensorProto.FLOAT, ["N", 4, 1])])
    path = tmp_path / "declared.onnx"
    model_proto = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)], ir_version=8)
    model_proto.graph.output[0].type.tensor_type.elem_type = TensorProto.FLOAT
    onnx.save(model_proto, path)
    model = load_model(path)
    shapes = {v.name: v.shape for n in model.graph for v in n.outputs}
    assert shapes["r"] == ir.Shape(["S", 8])
    assert shapes["w"] == ir.Shape(["N", 4])


def test_a_minus_one_only_in_value_info_is_dynamic_on_the_light_path(tmp_path: Path) -> None:
    """The weights make the loader infer on the file's bytes without them; those bytes still
    hold a ``-1`` that only ``value_info`` declares, which must not reach the IR."""
    w = np.ones((256, 128), np.float32)  # 128 KiB: the light path
    graph = oh.make_graph(
        [oh.make_node("MatMul", ["x", "w"], ["m"]), oh.make_node("Reshape", ["m", "t"], ["r"]),
         oh.make_node("Relu", ["r"], ["y"])], "g",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 256]),
         oh.make_tensor_value_info("t", TensorProto.INT64, [2])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [nh.from_array(w, "w")],
        value_info=[oh.make_tensor_value_info("r", TensorProto.FLOAT, [-1, 128])])
    path = tmp_path / "minus_one.onnx"
    onnx.save(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)], ir_version=8), path)
    model = load_model(path)
    shapes = {v.name: v.shape for n in model.graph for v in n.outputs}
    assert shapes["r"] is not None and all(not isinstance(d, int) or d >= 0
                                           for d in shapes["r"].dims)
    assert shapes["m"] == ir.Shape(["N", 128])


def test_an_in_memory_proto_is_checked_against_its_arithmetic_too(tmp_path: Path) -> None:
    """No file bytes: the declarations are set aside for the second inference (not a copy
    of the whole proto) and put back."""
    path = tmp_path / "stale.onnx"
    _stale_batch_model(path)
    proto = onnx.load(path)
    model = modelio.from_proto(proto)
    relu = next(n for n in model.graph if n.op_type == "Relu")
    assert relu.outputs[0].shape == ir.Shape(["N", 4])
    assert [v.name for v in proto.graph.value_info] == ["a"]


def test_a_model_with_a_map_output_is_refused_in_one_line(tmp_path: Path):
    """skl2onnx's classifiers end in ZipMap, whose seq(map(int64, float)) output onnx-ir
    cannot hold: a valid model, refused with the reason and the export option that avoids
    it (not "not a valid ONNX model")."""
    zipmap = oh.make_node("ZipMap", ["p"], ["probabilities"], domain="ai.onnx.ml",
                          classlabels_int64s=[0, 1])
    graph = oh.make_graph(
        [oh.make_node("Softmax", ["x"], ["p"]), zipmap], "g",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2])],
        [oh.make_value_info("probabilities", oh.make_sequence_type_proto(
            oh.make_map_type_proto(TensorProto.INT64,
                                   oh.make_tensor_type_proto(TensorProto.FLOAT, [])))),
         ])
    model = oh.make_model(graph, ir_version=8, opset_imports=[
        oh.make_opsetid("", 17), oh.make_opsetid("ai.onnx.ml", 3)])
    onnx.checker.check_model(model)
    path = tmp_path / "zipmap.onnx"
    onnx.save(model, path)
    with pytest.raises(BadInputError, match="value 'probabilities' is a map, .*'zipmap': False"):
        modelio.load_model(path)
    # a ZipMap nobody reads, its map typed nowhere: onnx-ir's own refusal, said the same way
    del model.graph.output[:]
    model.graph.output.extend([oh.make_tensor_value_info("p", TensorProto.FLOAT, [1, 2])])
    onnx.save(model, path)
    with pytest.raises(BadInputError, match="a value is a map, .*'zipmap': False"):
        modelio.load_model(path)
