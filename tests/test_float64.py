"""The float64 run of the reference (fusectl/float64.py) and how validation uses it: a
candidate as accurate as the reference is not failed for the reference's own float32 error,
and a wrong one still is."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from fusectl import float64
from fusectl import validate as v

HEADER = '<ir_version: 8, opset_import: ["" : 17]>'


def model(text: str, header: str = HEADER) -> ir.Model:
    return ir.serde.deserialize_model(onnx.parser.parse_model(f"{header}\n{text}"))


# y = (x + 1e4) - 1e4 rounds x to float32's step at 1e4 (2^-10): up to 4.9e-4 off, about
# eight times the fp32 tolerance at |x| <= 1. Exactly x in float64.
CANCELLING = model("""
g (float[64, 32] x) => (float[64, 32] y) <float big = {10000.0}>
{ a = Add(x, big)  y = Sub(a, big) }
""")


def shifted(offset: float) -> ir.Model:
    """y = x + offset: the exact result of CANCELLING when offset is 0."""
    return model(f"""
g (float[64, 32] x) => (float[64, 32] y) <float k = {{{offset!r}}}>
{{ y = Add(x, k) }}
""")


def only(result: v.ValidationResult) -> v.OutputComparison:
    (out,) = result.outputs
    return out


def test_the_reference_is_further_from_exact_than_the_tolerance():
    """The premise: compared with the reference alone, the exact candidate fails."""
    reference = v.run_reference(CANCELLING, v.ValidationOptions())
    truth = reference.float64_outputs(0)
    x = reference.feed_sets[0]["x"]
    assert truth is not None and truth["y"].dtype == np.float64
    np.testing.assert_allclose(truth["y"], x.astype(np.float64), atol=1e-9)
    assert np.abs(reference.outputs[0]["y"] - truth["y"]).max() > 3e-4
    plain = v.compare_outputs(reference.outputs[0], {"y": x + np.float32(0)})
    assert not plain[0].passed


def test_an_exact_candidate_passes_within_the_references_float32_error():
    result = v.validate(CANCELLING, shifted(0.0))
    out = only(result)
    assert result.passed and out.passed
    assert out.float64_floor is not None and 3e-4 < out.float64_floor < 1e-3
    assert "within the reference's own rounding error" in out.reason
    assert out.pct_out_of_tol > 0  # the float32 statistics are still reported
    assert v.comparison_to_dict(out)["float64_floor"] == pytest.approx(out.float64_floor)


def test_the_float64_model_is_built_once_for_every_sample(monkeypatch):
    from onnx import reference

    built = []
    real = reference.ReferenceEvaluator

    def counting(*args, **kwargs):
        built.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(reference, "ReferenceEvaluator", counting)
    result = v.validate(CANCELLING, shifted(0.0), v.ValidationOptions(samples=3))
    assert result.passed and len(result.outputs) >= 1
    assert len(built) == 1


def test_a_wrong_candidate_still_fails_and_says_so():
    result = v.validate(CANCELLING, shifted(0.01))
    out = only(result)
    assert not result.passed
    assert "beyond the reference's own rounding error too" in out.reason
    assert out.float64_floor is not None


def test_a_biased_candidate_fails_even_within_the_largest_error():
    """Every element within the reference's largest error, but on average far worse."""
    truth = np.zeros(1000)
    ref = np.zeros(1000, np.float32)
    ref[0] = 1e-3  # one rounding error; the rest exact
    cand = np.full(1000, 9e-4, np.float32)
    (plain,) = v.compare_outputs({"y": ref}, {"y": cand})
    judge = v._Judge.of(np.dtype(np.float32), None, None, None)
    judged = v._rejudge(plain, ref, cand, truth, judge)
    assert not judged.passed and "mean error against its float64 run" in judged.reason


def test_an_excuse_needs_rounding_and_no_more_elements_off():
    """A reference whose float64 run differs by more than rounding (a Floor flipped) vouches
    for nothing; nor may a candidate have many more elements off than the reference."""
    judge = v._Judge.of(np.dtype(np.float32), None, None, None)
    truth = np.linspace(-1, 1, 1000)
    noise = np.where(np.arange(1000) % 10 == 0, 4e-4, 0.0)
    ref = (truth + noise).astype(np.float32)
    close = (truth - noise).astype(np.float32)  # as far off, other side: as accurate
    (plain,) = v.compare_outputs({"y": ref}, {"y": close})
    assert not plain.passed and v._rejudge(plain, ref, close, truth, judge).passed
    everywhere = (truth + 4e-4 * np.sign(np.sin(np.arange(1000)))).astype(np.float32)
    (plain,) = v.compare_outputs({"y": ref}, {"y": everywhere})
    judged = v._rejudge(plain, ref, everywhere, truth, judge)
    assert not judged.passed and "elements out of tolerance of its float64 run" in judged.reason
    flipped = ref.copy()
    flipped[500] += 1.0  # a step the float64 run took the other way
    wrong = (truth + 0.003).astype(np.float32)
    (plain,) = v.compare_outputs({"y": flipped}, {"y": wrong})
    judged = v._rejudge(plain, flipped, wrong, truth, judge)
    assert not judged.passed and "more than rounding" in judged.reason


def test_passing_outputs_never_make_the_float64_run():
    reference = v.run_reference(CANCELLING, v.ValidationOptions())
    result = v.check_candidate(reference, CANCELLING)
    assert result.passed and only(result).float64_floor is None
    assert reference.float64_run.made == {}  # not computed: nothing failed


def test_contrib_and_quantized_models_have_no_float64_run():
    contrib = model("""
g (float[4] x) => (float[4] y) { y = com.microsoft.Gelu(x) }
""", '<ir_version: 8, opset_import: ["" : 17, "com.microsoft" : 1]>')
    quantized = model("""
g (float[4] x) => (float[4] y) <float s = {0.5}, uint8 z = {0}>
{ q = QuantizeLinear(x, s, z)  y = DequantizeLinear(q, s, z) }
""")
    assert float64.widened(contrib) is None and float64.widened(quantized) is None
    assert float64.float64_outputs(contrib, {"x": np.ones(4, np.float32)}) is None
    assert float64.unsupported(contrib) == "com.microsoft.Gelu is not a standard ONNX op"
    assert float64.unsupported(quantized) == "quantized op QuantizeLinear"
    with pytest.raises(float64.Unavailable, match="^quantized op QuantizeLinear$"):
        float64.Float64Run(quantized).run({"x": np.ones(4, np.float32)})


def test_a_failure_without_a_float64_run_says_why():
    """A contrib op keeps the float32 verdict, and the output's reason (what the report prints
    and the JSON holds) says in one line why no float64 run judged it again."""
    header = '<ir_version: 8, opset_import: ["" : 17, "com.microsoft" : 1]>'
    reference = model("""
g (float[64, 32] x) => (float[64, 32] y) <float big = {10000.0}>
{ a = Add(x, big)  s = Sub(a, big)  y = com.microsoft.Gelu(s) }
""", header)
    exact = model("g (float[64, 32] x) => (float[64, 32] y) { y = com.microsoft.Gelu(x) }",
                  header)
    result = v.validate(reference, exact)
    out = only(result)
    assert not result.passed and out.float64_floor is None
    assert out.reason.endswith(
        "out of tolerance; no float64 run: com.microsoft.Gelu is not a standard ONNX op")
    assert "\n" not in out.reason


def test_sequence_outputs_are_judged_in_float64_element_by_element():
    """A sequence output of tensors of different lengths (onnxruntime's ``y[0]``, ``y[1]``)
    is matched with the float64 run's elements instead of breaking validation."""
    reference = model("""
g (float[64, 32] x) => (seq(float[?, 32]) y) <float big = {10000.0}, int64[2] sp = {40, 24}>
{ a = Add(x, big)  s = Sub(a, big)  y = SplitToSequence<axis=0>(s, sp) }
""")
    exact = model("""
g (float[64, 32] x) => (seq(float[?, 32]) y) <int64[2] sp = {40, 24}>
{ y = SplitToSequence<axis=0>(x, sp) }
""")
    result = v.validate(reference, exact)
    assert [o.name for o in result.outputs] == ["y[0]", "y[1]"]
    assert result.passed and all(o.float64_floor is not None for o in result.outputs)


def cancelling_with_external_data(path) -> None:
    """CANCELLING, then a Gather of every column by int64 indices, every tensor in ``w.bin``."""
    from onnx import TensorProto, helper, numpy_helper

    nodes = [helper.make_node("Add", ["x", "big"], ["a"]),
             helper.make_node("Sub", ["a", "big"], ["s"]),
             helper.make_node("Gather", ["s", "columns"], ["y"], axis=1)]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [64, 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [64, 32])],
        [numpy_helper.from_array(np.array([1e4], np.float32), "big"),
         numpy_helper.from_array(np.arange(32, dtype=np.int64), "columns")])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                              ir_version=8)
    onnx.save_model(proto, path, save_as_external_data=True, all_tensors_to_one_file=True,
                    location="w.bin", size_threshold=0)
    stored = onnx.load(path, load_external_data=False).graph.initializer
    assert all(t.data_location == TensorProto.EXTERNAL for t in stored)


def test_a_model_with_external_data_is_judged_in_float64(tmp_path, monkeypatch):
    """Its float and int64 weights are read from the data file into the one proto the
    evaluator gets; the exact candidate then passes on the reference's own rounding."""
    path = tmp_path / "model.onnx"
    cancelling_with_external_data(path)
    monkeypatch.chdir(tmp_path.parent)  # the data file is found beside the model, not here
    result = v.validate(path, shifted(0.0))
    out = only(result)
    assert result.passed, out.reason
    assert out.float64_floor is not None and 3e-4 < out.float64_floor < 1e-3


def test_external_data_that_cannot_be_read_is_the_reason(tmp_path):
    path = tmp_path / "model.onnx"
    cancelling_with_external_data(path)
    reference = v.run_reference(path, v.ValidationOptions())
    (tmp_path / "w.bin").unlink()  # the float64 run reads the weights only when needed
    out = only(v.check_candidate(reference, shifted(0.0)))
    assert not out.passed and out.float64_floor is None
    assert "; no float64 run: cannot widen the model: " in out.reason
    assert "\n" not in out.reason


def test_widening_keeps_resize_scales_and_integer_tensors():
    m = model("""
g (float[1, 1, 2, 2] x) => (float[1, 1, 4, 4] y)
<float[4] sc = {1.0, 1.0, 2.0, 2.0}>
{ c = Cast<to=1>(x)  y = Resize<mode="nearest">(c, , sc) }
""")
    wide = float64.widened(m)
    assert wide is not None
    cast, back, resize = wide.graph
    assert cast.attributes["to"].value == int(ir.DataType.DOUBLE)
    assert resize.inputs[2] is back.outputs[0] and back.inputs[0].name == "sc"
    assert resize.inputs[2].type.dtype == ir.DataType.FLOAT  # the standard wants float32
    x = np.arange(4, dtype=np.float32).reshape(1, 1, 2, 2)
    out = float64.float64_outputs(m, {"x": x})
    assert out is not None and out["y"].dtype == np.float64
    np.testing.assert_array_equal(out["y"], x.repeat(2, 2).repeat(2, 3))
    assert m.graph.node(0).attributes["to"].value == int(ir.DataType.FLOAT)  # not modified


def test_constant_float_attributes_are_widened():
    m = model("""
g (float[3] x) => (float[3] y)
{ k = Constant<value_float=0.1>()  y = Add(x, k) }
""")
    out = float64.float64_outputs(m, {"x": np.zeros(3, np.float32)})
    assert out is not None
    assert out["y"].dtype == np.float64  # the Constant became a float64 tensor
    np.testing.assert_array_equal(out["y"], np.full(3, np.float64(np.float32(0.1))))


def test_float_outputs_by_default_are_widened_and_other_dtypes_kept():
    """ConstantOfShape without a value makes float32 zeros, a window float32 values: both
    become float64; a Cast to int64 stays one."""
    m = model("""
g (float[4] x) => (float[4] y, int64[4] n)
<int64[1] four = {4}, int64 size = {4}>
{ z = ConstantOfShape(four)  w = HannWindow(size)  s = Add(x, z)  y = Add(s, w)
  n = Cast<to=7>(x) }
""")
    out = float64.float64_outputs(m, {"x": np.ones(4, np.float32)})
    assert out is not None and out["y"].dtype == np.float64 and out["n"].dtype == np.int64
    periodic = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(4) / 4)
    np.testing.assert_allclose(out["y"], 1 + periodic, rtol=1e-15)


def test_resize_10_keeps_its_second_input_float():
    m = model("""
g (float[1, 1, 2, 2] x) => (float[1, 1, 4, 4] y)
<float[4] sc = {1.0, 1.0, 2.0, 2.0}>
{ y = Resize<mode="nearest">(x, sc) }
""", '<ir_version: 6, opset_import: ["" : 10]>')
    wide = float64.widened(m)
    assert wide is not None and wide.graph.node(1).inputs[1].type.dtype == ir.DataType.FLOAT
    onnx.checker.check_model(ir.to_proto(wide), full_check=True)  # scales must be float32


def test_a_model_given_as_a_path_runs_in_float64_and_the_file_is_untouched(tmp_path):
    path = tmp_path / "cancelling.onnx"
    ir.save(CANCELLING, path)
    before = path.read_bytes()
    x = np.linspace(-1, 1, 64 * 32, dtype=np.float32).reshape(64, 32)
    out = float64.float64_outputs(path, {"x": x})
    assert out is not None and out["y"].dtype == np.float64
    np.testing.assert_allclose(out["y"], x.astype(np.float64), atol=1e-9)
    assert path.read_bytes() == before
    assert float64.float64_outputs(tmp_path / "missing.onnx", {"x": x}) is None


# The float16 version of CANCELLING: (x + 1000) - 1000 in float16 rounds x to 2^-1 steps
# near 1000, far beyond float16's tolerance; exactly x in float64.
CANCELLING_FP16 = model("""
g (float16[64, 32] x) => (float16[64, 32] y) <float16 big = {BIG}>
{ a = Add(x, big)  y = Sub(a, big) }
""".replace("BIG", str(np.float16(1000.0).view(np.uint16))))  # the parser takes fp16 bits


def test_float16_models_are_widened_too():
    wide = float64.widened(CANCELLING_FP16)
    assert wide is not None
    assert wide.graph.inputs[0].type.dtype == ir.DataType.DOUBLE
    assert wide.graph.initializers["big"].const_value.dtype == ir.DataType.DOUBLE
    feeds = {"x": np.linspace(-1, 1, 64 * 32).reshape(64, 32).astype(np.float16)}
    out = float64.float64_outputs(CANCELLING_FP16, feeds)
    np.testing.assert_allclose(out["y"], feeds["x"].astype(np.float64), atol=1e-12)


# A model computing in float16 (judged with float16 tolerances): x + 100 rounded to float16's
# step there (2^-4), up to 0.031 off, about five float16 tolerances. Exactly x in float64.
ROUNDED_IN_FP16 = model("""
g (float[64, 32] x) => (float[64, 32] y) <float big = {100.0}>
{ a = Add(x, big)  h = Cast<to=10>(a)  f = Cast<to=1>(h)  y = Sub(f, big) }
""")


def test_a_half_precision_reference_is_judged_against_float64_too():
    options = v.ValidationOptions(fp16_range_sample=False)
    exact = v.validate(ROUNDED_IN_FP16, shifted(0.0), options)
    out = only(exact)
    assert exact.compute_dtype == "float16" and out.pct_out_of_tol > 0
    assert exact.passed and out.float64_floor is not None
    wrong = v.validate(ROUNDED_IN_FP16, shifted(0.05), options)
    assert not wrong.passed
    assert "beyond the reference's own rounding error too" in only(wrong).reason


def test_an_ill_conditioned_range_sample_asks_only_for_no_larger_error():
    """At the edge of float16's range the reference itself can be far from exact; there the
    candidate passes when no element of it is further from exact than the reference's."""
    judge = v._Judge.of(np.dtype(np.float16), None, None, None)
    truth = np.linspace(-1, 1, 1000)
    ref = (truth + np.where(np.arange(1000) % 7 == 0, 0.5, 0.0)).astype(np.float16)
    closer = (truth + np.where(np.arange(1000) % 7 == 0, -0.4, 0.0)).astype(np.float16)
    elsewhere = (truth + np.where(np.arange(1000) % 7 == 3, 0.4, 0.0)).astype(np.float16)
    zeros = np.zeros(1000, np.float16)
    for cand, passes in ((closer, True), (elsewhere, False), (zeros, False)):
        (plain,) = v.compare_outputs({"y": ref}, {"y": cand})
        assert not plain.passed
        ordinary = v._rejudge(plain, ref, cand, truth, judge)
        assert not ordinary.passed and "more than rounding" in ordinary.reason
        ranged = v._rejudge(replace(plain, range_sample=True), ref, cand, truth, judge)
        assert ranged.passed is passes
        if not passes:
            assert "candidate is further from exact at" in ranged.reason


def test_float64_outputs_are_made_once_per_sample():
    """Bisection re-checks candidates on the same reference: its float64 run is made once
    per sample, not once per check."""
    calls = []

    class Counting:
        def run(self, feeds):
            calls.append(dict(feeds))
            return {"y": np.zeros(2)}

    outputs = v.Float64Outputs(Counting())
    first = outputs.get(0, {"x": 1})
    assert outputs.get(0, {"x": 1}) is first
    outputs.get(1, {"x": 2})
    assert len(calls) == 2


def test_a_float64_value_of_another_shape_is_no_judge():
    assert v._float64_missing(None, np.zeros(2)) == "the float64 run has no such output"
    assert v._float64_missing(np.zeros(3), np.zeros(2)) == "its float64 value has shape [3]"
    assert v._float64_missing(np.zeros(2), np.zeros(2)) is None
