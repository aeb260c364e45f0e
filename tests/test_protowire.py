"""The streamed encoding is exactly protobuf's: same bytes, whatever the tensors hold."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fusectl import modelio, protowire
from fusectl.errors import BadInputError


def _model(tensors: dict[str, ir.TensorProtocol], **fields: object) -> ir.Model:
    """y = x + sum of nothing: a graph whose initializers are ``tensors`` (the rest of
    the graph, nodes, value_info and outputs, sits on both sides of them in the proto)."""
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2]))
    node = ir.Node("", "Relu", [x], num_outputs=1, name="relu")
    node.outputs[0].name = "y"
    node.outputs[0].type = ir.TensorType(ir.DataType.FLOAT)
    node.outputs[0].shape = ir.Shape([2])
    inits = []
    for name, tensor in tensors.items():
        value = ir.Value(name=name, const_value=tensor, type=ir.TensorType(tensor.dtype),
                         shape=ir.Shape(tensor.shape.dims))
        inits.append(value)
    graph = ir.Graph([x], [node.outputs[0]], nodes=[node], initializers=inits, name="g",
                     opset_imports={"": 18}, doc_string="the graph")
    model = ir.Model(graph, ir_version=10, producer_name="test", doc_string="the model")
    for key, value in fields.items():
        setattr(model, key, value)
    return model


def _assert_same_bytes(model: ir.Model, min_bytes: int = 1) -> protowire.Encoding:
    expected = ir.to_proto(model).SerializeToString()
    encoding = protowire.encode_model(model, min_bytes=min_bytes)
    assert encoding.size == len(expected)
    assert encoding.tobytes() == expected
    return encoding


def test_numpy_tensors_of_every_plain_dtype_are_spliced_exactly() -> None:
    rng = np.random.default_rng(0)
    tensors = {
        "f32": ir.Tensor(rng.standard_normal((3, 5)).astype(np.float32)),
        "f16": ir.Tensor(rng.standard_normal(7).astype(np.float16)),
        "f64": ir.Tensor(rng.standard_normal(4)),
        "i64": ir.Tensor(np.arange(300, dtype=np.int64)),
        "i8": ir.Tensor(np.arange(-5, 5, dtype=np.int8)),
        "u16": ir.Tensor(np.arange(9, dtype=np.uint16)),
        "bool": ir.Tensor(np.array([True, False, True])),
        "bf16": ir.Tensor(np.arange(6, dtype=np.float32).astype(ml_dtypes.bfloat16),
                          dtype=ir.DataType.BFLOAT16),
        "c64": ir.Tensor(np.array([1 + 2j, 3 - 4j], dtype=np.complex64)),
        "empty": ir.Tensor(np.zeros((0, 3), np.float32)),
        "strided": ir.Tensor(np.arange(24, dtype=np.float32).reshape(4, 6)[:, ::2]),
    }
    encoding = _assert_same_bytes(_model(tensors))
    assert any(isinstance(p, memoryview) and p.obj is not None and p.nbytes == 60
               for p in encoding.pieces)  # f32 went from its buffer, not through the proto


def test_tensors_serde_packs_or_spells_out_are_spliced_exactly() -> None:
    tensors = {
        "int4": ir.Tensor(np.array([1, -2, 3, 7, -8], dtype=ml_dtypes.int4),
                          dtype=ir.DataType.INT4),
        "strings": ir.StringTensor([b"a", b"bc"], shape=ir.Shape([2])),
        "doc": ir.Tensor(np.ones(4, np.float32), doc_string="why",
                         metadata_props={"k": "v"}),
    }
    _assert_same_bytes(_model(tensors))


def test_loaded_proto_tensors_are_spliced_exactly(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    model = _model({"w": ir.Tensor(rng.standard_normal((64, 64)).astype(np.float32)),
                    "b": ir.Tensor(np.ones(3, np.int32))})
    path = tmp_path / "m.onnx"
    onnx.save(ir.to_proto(model), path)
    loaded = modelio.load_model(path)
    assert isinstance(loaded.graph.initializers["w"].const_value, ir.serde.TensorProtoTensor)
    _assert_same_bytes(loaded)


def test_small_tensors_and_tensorless_models_take_the_plain_path() -> None:
    model = _model({"w": ir.Tensor(np.ones(4, np.float32))})
    assert len(_assert_same_bytes(model, min_bytes=1 << 20).pieces) == 1
    assert len(_assert_same_bytes(_model({})).pieces) == 1


def test_model_fields_on_both_sides_of_the_graph_stay_in_place() -> None:
    model = _model({"w": ir.Tensor(np.ones(40, np.float32))},
                   producer_version="1.2", domain="x.y", model_version=3)
    model.metadata_props["after"] = "graph"
    model.functions[("local", "f", "")] = ir.Function(
        "local", "f", "", graph=ir.Graph([], [], nodes=[], opset_imports={"": 18}),
        attributes=[])
    _assert_same_bytes(model)


def test_the_model_is_left_as_it_was() -> None:
    tensors = {"a": ir.Tensor(np.ones(40, np.float32)), "b": ir.Tensor(np.zeros(9))}
    model = _model(tensors)
    protowire.encode_model(model, min_bytes=1)
    assert all(model.graph.initializers[k].const_value is t for k, t in tensors.items())


def test_an_unexpected_layout_falls_back_to_protobuf(monkeypatch) -> None:
    def refuse(*_args: object) -> None:
        raise ValueError("not here")

    monkeypatch.setattr(protowire, "_splice", refuse)
    encoding = _assert_same_bytes(_model({"w": ir.Tensor(np.ones(40, np.float32))}))
    assert len(encoding.pieces) == 1


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["float32", "int64", "float16", "uint8"]),
                          st.lists(st.integers(0, 40), min_size=0, max_size=3)),
                min_size=1, max_size=6),
       st.integers(1, 600))
def test_any_mix_of_tensor_sizes_encodes_exactly(specs, min_bytes) -> None:
    rng = np.random.default_rng(len(specs))
    tensors = {f"t{i}": ir.Tensor((rng.standard_normal(shape) * 100).astype(dtype))
               for i, (dtype, shape) in enumerate(specs)}
    _assert_same_bytes(_model(tensors), min_bytes=min_bytes)


def test_saved_model_reads_back_with_its_weights(tmp_path: Path) -> None:
    weights = np.random.default_rng(2).standard_normal((300, 300)).astype(np.float32)
    out = tmp_path / "out.onnx"
    modelio.save_model(_model({"w": ir.Tensor(weights)}), out)
    onnx.checker.check_model(str(out))
    back = onnx.load(str(out))
    assert np.array_equal(onnx.numpy_helper.to_array(back.graph.initializer[0]), weights)


def test_over_protobufs_limit_is_one_line_and_nothing_written(tmp_path: Path,
                                                             monkeypatch) -> None:
    monkeypatch.setattr(modelio, "_PROTOBUF_LIMIT_BYTES", 1000)
    out = tmp_path / "out.onnx"
    with pytest.raises(BadInputError, match="2 GiB limit"):
        modelio.save_model(_model({"w": ir.Tensor(np.ones(1000, np.float32))}), out,
                           external_data=False)
    assert list(tmp_path.iterdir()) == []


def _inference_model() -> onnx.ModelProto:
    """A MatMul with big weights, then a Reshape whose target is a small initializer: its
    output shape needs that initializer's data (data propagation), the MatMul's the
    weights' dims only."""
    return onnx.parser.parse_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2, 256] x) => (float[4, 128] z) <int64[2] target = {4, 128}> {
            h = MatMul(x, w)
            y = Reshape(h, target)
            z = Relu(y)
        }
    """), np.random.default_rng(3).standard_normal((256, 256)).astype(np.float32)


def _with_weights() -> bytes:
    proto, weights = _inference_model()
    proto.graph.initializer.append(onnx.numpy_helper.from_array(weights, "w"))
    return proto.SerializeToString()


def test_without_weights_empties_only_the_big_initializers() -> None:
    light = protowire.without_weights(_with_weights())
    assert light is not None
    kept = {t.name: t for t in onnx.load_from_string(light).graph.initializer}
    assert kept["w"].raw_data == b"" and list(kept["w"].dims) == [256, 256]
    assert onnx.numpy_helper.to_array(kept["target"]).tolist() == [4, 128]


def test_shape_inference_reads_the_light_bytes_as_the_real_model() -> None:
    data = _with_weights()
    light = protowire.without_weights(data)
    infer = onnx.shape_inference.infer_shapes
    real, cut = (infer(b, strict_mode=True, data_prop=True).graph for b in (data, light))
    assert cut.value_info == real.value_info
    y = next(v for v in cut.value_info if v.name == "y")
    assert [d.dim_value for d in y.type.tensor_type.shape.dim] == [4, 128]


def test_without_weights_says_none_when_nothing_is_big_or_the_bytes_are_not_a_model() -> None:
    proto, _ = _inference_model()
    assert protowire.without_weights(proto.SerializeToString()) is None
    assert protowire.without_weights(b"\x3a\xff\xff\xff\x0f") is None  # graph past the end
    assert protowire.without_weights(b"\x0f") is None  # wire type 7


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_without_weights_never_raises_on_junk(junk: bytes) -> None:
    result = protowire.without_weights(junk, min_bytes=1)
    assert result is None or isinstance(result, bytes)


def test_a_loaded_model_is_typed_from_the_light_bytes(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "m.onnx"
    path.write_bytes(_with_weights())
    seen: list[int] = []
    real = modelio.infer_proto_shapes

    def spy(proto):  # type: ignore[no-untyped-def]
        seen.append(len(proto) if isinstance(proto, bytes) else proto.ByteSize())
        return real(proto)

    monkeypatch.setattr(modelio, "infer_proto_shapes", spy)
    model = modelio.load_model(path)
    assert seen and seen[0] < 64 * 1024  # the weights (256 KiB) were left out
    assert model.graph.node(0).outputs[0].shape == ir.Shape([2, 256])
    assert model.graph.node(1).outputs[0].shape == ir.Shape([4, 128])


def test_many_small_entries_are_not_walked_for_nothing(tmp_path: Path, monkeypatch) -> None:
    """A long graph of tiny tensors: the wire walk would find no big weight to cut out."""
    nodes = "\n".join(f"x{i + 1} = Relu(x{i})" for i in range(300))
    proto = onnx.parser.parse_model(f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2] x0) => (float[2] x300) {{
            {nodes}
        }}
    """)
    path = tmp_path / "m.onnx"
    onnx.save(proto, path)
    calls: list[int] = []
    monkeypatch.setattr(modelio, "without_weights", lambda data: calls.append(len(data)))
    modelio.load_model(path)
    assert calls == []
    path.write_bytes(_with_weights())
    modelio.load_model(path)
    assert len(calls) == 1
