"""Tests for fusectl.validate: input generation, running on onnxruntime, comparison."""

from __future__ import annotations

import json
import math
import weakref

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime
import pytest

from fusectl import validate as v
from fusectl.errors import BadInputError

HEADER = '<ir_version: 8, opset_import: ["" : 17]>'


def model(text: str, header: str = HEADER) -> ir.Model:
    return ir.serde.deserialize_model(onnx.parser.parse_model(f"{header}\n{text}"))


def add_const(c: str, dtype: str = "float") -> ir.Model:
    """y = x + c, with x of shape [N, 3] and c a 3-element float constant cast to x's type."""
    to = int(ir.DataType.FLOAT16 if dtype == "float16" else ir.DataType.FLOAT)
    return model(
        f"g ({dtype}[N, 3] x) => ({dtype}[N, 3] y) <float[3] c = {{{c}}}> "
        f"{{ cc = Cast<to={to}>(c)\n y = Add(x, cc) }}"
    )


def only(result: v.ValidationResult, name: str = "y") -> v.OutputComparison:
    matches = [o for o in result.outputs if o.name == name]
    assert len(matches) == 1, result.outputs
    return matches[0]


def proto_bytes(m: ir.Model) -> bytes:
    return ir.to_proto(m).SerializeToString()


# --------------------------------------------------------------------------- verdicts


def test_identical_models_pass_with_zero_error():
    ref = add_const("0.0, 1.0, 2.0")
    result = v.validate(ref, add_const("0.0, 1.0, 2.0"))
    assert result.passed and result.error is None
    out = only(result)
    assert (out.max_abs, out.max_rel, out.mean_abs, out.pct_out_of_tol) == (0, 0, 0, 0)
    assert out.cosine == pytest.approx(1.0)
    assert out.dtype == "float32" and out.shape == (1, 3)
    assert (out.rtol, out.atol) == (1e-4, 1e-5)
    assert result.input_shapes == {"x": (1, 3)}


def test_perturbed_constant_fails_with_exact_max_abs():
    result = v.validate(add_const("0.0, 1.0, 2.0"), add_const("0.0, 1.5, 2.0"))
    assert not result.passed
    out = only(result)
    assert not out.passed
    assert out.max_abs == pytest.approx(0.5, abs=1e-6)
    assert out.mean_abs == pytest.approx(0.5 / 3, abs=1e-6)
    assert out.pct_out_of_tol == pytest.approx(100 / 3)
    assert "1 of 3 elements" in out.reason


def test_shape_mismatch_fails_with_reason():
    ref = model("g (float[N, 3] x) => (float[N, 3] y) { y = Identity(x) }")
    cand = model(
        "g (float[N, 3] x) => (float[1, N, 3] y) <int64[1] ax = {0}> { y = Unsqueeze(x, ax) }"
    )
    out = only(v.validate(ref, cand))
    assert not out.passed
    assert "shape mismatch" in out.reason and "(1, 1, 3)" in out.reason


def test_dtype_mismatch_fails_with_reason():
    ref = model("g (float[N, 3] x) => (float[N, 3] y) { y = Identity(x) }")
    cand = model("g (float[N, 3] x) => (double[N, 3] y) { y = Cast<to=11>(x) }")
    out = only(v.validate(ref, cand))
    assert not out.passed
    assert "dtype mismatch" in out.reason and "float64" in out.reason


def test_missing_output_fails():
    ref = model("g (float[2] x) => (float[2] y, float[2] z) { y = Identity(x)\n z = Neg(x) }")
    cand = model("g (float[2] x) => (float[2] y, float[2] w) { y = Identity(x)\n w = Neg(x) }")
    result = v.validate(ref, cand)
    assert not result.passed
    assert "missing" in only(result, "z").reason
    assert "not an output of the reference" in only(result, "w").reason
    assert only(result, "y").passed


def test_fp16_model_uses_fp16_tolerances():
    # An absolute error of ~5e-4 is inside fp16's atol 1e-3 but far outside fp32's atol 1e-5.
    fp16 = v.validate(add_const("0, 0, 0", "float16"), add_const("0.0005, 0, 0", "float16"))
    out16 = only(fp16)
    assert fp16.passed
    assert (out16.rtol, out16.atol) == (1e-2, 1e-3)
    assert 4e-4 <= out16.max_abs <= 1e-3  # 5e-4, give or take fp16 rounding
    fp32 = v.validate(add_const("0, 0, 0"), add_const("0.0005, 0, 0"))
    assert not fp32.passed
    assert only(fp32).max_abs == pytest.approx(5e-4, rel=1e-3)


def test_same_relative_error_passes_fp16_fails_fp32():
    ref = np.array([1.0, 2.0, 4.0])
    cand = ref * (1 + 2**-10)  # relative error ~1e-3
    (c16,) = v.compare_outputs({"y": ref.astype(np.float16)}, {"y": cand.astype(np.float16)})
    (c32,) = v.compare_outputs({"y": ref.astype(np.float32)}, {"y": cand.astype(np.float32)})
    assert c16.passed and c16.max_rel == pytest.approx(2**-10)
    assert not c32.passed and c32.max_rel == pytest.approx(2**-10)


def test_bfloat16_tolerances():
    ref = np.array([1.0, 2.0], dtype=ml_dtypes.bfloat16)
    (c,) = v.compare_outputs({"y": ref}, {"y": ref})
    assert (c.dtype, c.rtol, c.atol, c.passed) == ("bfloat16", 2e-2, 1e-2, True)


def test_integer_outputs_must_be_exact():
    ref = np.array([1, 2, 3], dtype=np.int64)
    (same,) = v.compare_outputs({"y": ref}, {"y": ref.copy()})
    (off,) = v.compare_outputs({"y": ref}, {"y": ref + np.array([0, 1, 0])})
    assert same.passed and (same.rtol, same.atol) == (0, 0)
    assert not off.passed and off.max_abs == 1.0 and "differ" in off.reason
    # Large int64 values that float64 cannot tell apart are still compared exactly.
    big = np.array([2**60], dtype=np.int64)
    (huge,) = v.compare_outputs({"y": big}, {"y": big + 1})
    assert not huge.passed


def test_bool_outputs_are_exact_even_with_overrides():
    (c,) = v.compare_outputs(
        {"y": np.array([True, False])}, {"y": np.array([True, True])}, rtol=1.0, atol=1.0
    )
    assert not c.passed and c.pct_out_of_tol == 50.0


def test_tolerance_overrides_apply():
    ref = {"y": np.array([1.0, 2.0], np.float32)}
    cand = {"y": np.array([1.01, 2.0], np.float32)}
    (default,) = v.compare_outputs(ref, cand)
    (loose,) = v.compare_outputs(ref, cand, atol=0.02)
    assert not default.passed and loose.passed and loose.atol == 0.02


def test_nan_and_inf_positions():
    nan, inf = math.nan, math.inf
    ref = np.array([nan, 1.0, inf, -inf], np.float32)
    (same,) = v.compare_outputs({"y": ref}, {"y": ref.copy()})
    assert same.passed and same.max_abs == 0.0
    (nan_vs_num,) = v.compare_outputs({"y": ref}, {"y": np.array([0, 1, inf, -inf], np.float32)})
    assert not nan_vs_num.passed and nan_vs_num.pct_out_of_tol == 25.0
    (inf_sign,) = v.compare_outputs({"y": ref}, {"y": np.array([nan, 1, -inf, -inf], np.float32)})
    assert not inf_sign.passed


def test_statistics_cosine_and_relative_error():
    (zeros,) = v.compare_outputs({"y": np.zeros(3, np.float32)}, {"y": np.zeros(3, np.float32)})
    assert zeros.cosine == 1.0
    (flip,) = v.compare_outputs(
        {"y": np.array([1.0, -2.0], np.float64)}, {"y": np.array([-1.0, 2.0], np.float64)}
    )
    assert flip.cosine == pytest.approx(-1.0)
    assert flip.max_rel == pytest.approx(2.0)
    assert flip.mean_abs == pytest.approx(3.0)


# --------------------------------------------------------------------------- input generation


def embedding_model() -> ir.Model:
    values = ", ".join(str(float(i)) for i in range(50 * 8))
    return model(
        "g (int32[N, S] ids) => (float[N, S, 8] y) "
        f"<float[50, 8] emb = {{{values}}}> "
        "{ ids64 = Cast<to=7>(ids)\n y = Gather<axis=0>(emb, ids64) }"
    )


def test_token_ids_feeding_gather_stay_in_range_and_model_runs():
    m = embedding_model()
    options = v.ValidationOptions(dims={"S": 400})
    feeds = v.generate_inputs(m, options)
    ids = feeds["ids"]
    assert ids.dtype == np.int32 and ids.shape == (1, 400)
    assert ids.min() >= 0 and ids.max() < 50
    assert ids.max() >= 10  # not the default [0, 10) range
    assert v.validate(m, embedding_model(), options).passed


def test_gather_axis_uses_that_axis_length():
    m = model(
        "g (int64[4] idx) => (float[2, 4] y) <float[2, 5] t = {0,1,2,3,4,5,6,7,8,9}> "
        "{ y = Gather<axis=1>(t, idx) }"
    )
    feeds = v.generate_inputs(m, v.ValidationOptions(seed=3))
    assert feeds["idx"].max() < 5
    assert v.run_model(m, feeds)["y"].shape == (2, 4)


def test_attention_mask_is_all_ones_and_shares_dims():
    m = model(
        "g (int64[batch, seq] input_ids, int64[batch, seq] attention_mask) => (int64[batch, seq] y)"
        " { y = Mul(input_ids, attention_mask) }"
    )
    feeds = v.generate_inputs(m, v.ValidationOptions(dims={"seq": 6}))
    assert feeds["attention_mask"].shape == (1, 6)
    assert np.all(feeds["attention_mask"] == 1)
    ids = feeds["input_ids"]
    assert ids.min() >= 0 and ids.max() < 10


def test_default_and_bound_dims():
    m = model(
        "g (float[N, seq, 3] a, float[batch_size, ?] b, bool[B] c) => (float[N, seq, 3] y) "
        "{ y = Identity(a) }"
    )
    feeds = v.generate_inputs(m)
    assert feeds["a"].shape == (1, 8, 3)
    assert feeds["b"].shape == (1, 8)
    assert feeds["c"].shape == (1,) and feeds["c"].dtype == np.bool_
    bound = v.generate_inputs(m, v.ValidationOptions(dims={"seq": 5, "N": 2}))
    assert bound["a"].shape == (2, 5, 3)
    with pytest.raises(BadInputError, match="unknown symbolic dim"):
        v.generate_inputs(m, v.ValidationOptions(dims={"sequence": 5}))


def test_generated_values_follow_dtype_seed_and_ranges():
    m = model(
        "g (float[100] f, float16[100] h, bfloat16[100] bf, uint8[100] u, int64[100] i) "
        "=> (float[100] y) { y = Identity(f) }"
    )
    a = v.generate_inputs(m, v.ValidationOptions(seed=1))
    b = v.generate_inputs(m, v.ValidationOptions(seed=1))
    c = v.generate_inputs(m, v.ValidationOptions(seed=1), sample=1)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["f"], c["f"])
    assert a["h"].dtype == np.float16 and a["bf"].dtype == ml_dtypes.bfloat16
    assert a["u"].dtype == np.uint8 and a["i"].dtype == np.int64
    for k in ("f", "h", "bf"):
        values = a[k].astype(np.float64)
        assert values.min() >= -1 and values.max() <= 1 and values.min() < -0.5
    assert a["i"].min() >= 0 and a["i"].max() == 9
    ranged = v.generate_inputs(m, v.ValidationOptions(input_ranges={"f": (5, 6), "i": (-3, 0)}))
    assert ranged["f"].min() >= 5 and ranged["f"].max() <= 6
    assert set(np.unique(ranged["i"])) == {-3, -2, -1}
    with pytest.raises(BadInputError, match="unknown input name 'g'"):
        v.generate_inputs(m, v.ValidationOptions(input_ranges={"g": (0, 1)}))


def test_bfloat16_model_runs_end_to_end():
    text = (
        "g (bfloat16[N, 4] x) => (bfloat16[N, 4] y, float[N, 4] z) "
        "{ y = Identity(x)\n z = Cast<to=1>(x) }"
    )
    result = v.validate(model(text), model(text))
    assert result.passed, result
    assert only(result, "y").dtype == "bfloat16" and only(result, "y").rtol == 2e-2


def test_initializers_listed_as_inputs_are_not_fed():
    old = model(
        "g (float[3] x, float[3] w) => (float[3] y) <float[3] w = {1.0, 2.0, 3.0}> "
        "{ y = Add(x, w) }",
        header='<ir_version: 3, opset_import: ["" : 9]>',
    )
    assert [i.name for i in old.graph.inputs] == ["x", "w"]
    feeds = v.generate_inputs(old)
    assert list(feeds) == ["x"]
    assert v.validate(old, old).passed


def test_non_tensor_input_raises_bad_input():
    m = model("g (seq(float[3]) s) => (float[3] y) <int64 zero = {0}> { y = SequenceAt(s, zero) }")
    with pytest.raises(BadInputError, match="only dense tensor"):
        v.generate_inputs(m)


# --------------------------------------------------------------------------- user inputs


def test_user_inputs_are_used_and_bind_dims():
    m = model(
        "g (float[N, S] x, float[N, S] attention_mask) => (float[N, S] y) "
        "{ y = Mul(x, attention_mask) }"
    )
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    feeds = v.generate_inputs(m, v.ValidationOptions(inputs={"x": x}))
    assert feeds["x"] is x or np.array_equal(feeds["x"], x)
    assert feeds["attention_mask"].shape == (2, 3)  # N and S bound by the user's array
    np.testing.assert_array_equal(v.run_model(m, feeds)["y"], x)
    result = v.validate(m, m, v.ValidationOptions(inputs={"x": x}))
    assert result.passed and result.input_shapes == {"x": (2, 3), "attention_mask": (2, 3)}


def test_user_inputs_wrong_dtype_rank_or_name_raise():
    m = model("g (float[N, 3] x) => (float[N, 3] y) { y = Identity(x) }")
    with pytest.raises(BadInputError, match="expected dtype float32, got float64"):
        v.generate_inputs(m, v.ValidationOptions(inputs={"x": np.zeros((1, 3))}))
    with pytest.raises(BadInputError, match="expected rank 2"):
        v.generate_inputs(m, v.ValidationOptions(inputs={"x": np.zeros(3, np.float32)}))
    with pytest.raises(BadInputError, match="axis 1 must be 3"):
        v.generate_inputs(m, v.ValidationOptions(inputs={"x": np.zeros((1, 4), np.float32)}))
    with pytest.raises(BadInputError, match="unknown input name 'z'"):
        v.generate_inputs(m, v.ValidationOptions(inputs={"z": np.zeros((1, 3), np.float32)}))


def test_load_input_files(tmp_path):
    a = np.arange(4, dtype=np.int64)
    b = np.ones((2, 2), np.float32)
    np.save(tmp_path / "a.npy", a)
    np.savez(tmp_path / "all.npz", a=np.zeros(4, np.int64), b=b)
    loaded = v.load_input_files([f"a={tmp_path / 'a.npy'}"], str(tmp_path / "all.npz"))
    assert set(loaded) == {"a", "b"}
    np.testing.assert_array_equal(loaded["a"], a)  # --input wins over the archive
    np.testing.assert_array_equal(loaded["b"], b)
    assert v.load_input_files([], None) == {}


@pytest.mark.parametrize(
    ("specs", "npz", "message"),
    [
        (["a.npy"], None, "expected NAME=FILE.npy"),
        (["=a.npy"], None, "expected NAME=FILE.npy"),
        (["a=missing.npy"], None, "cannot read"),
        ([], "missing.npz", "cannot read"),
        (["x=GOOD"], None, "unknown input name 'x'"),
        (["a=GOOD", "a=GOOD"], None, "given twice"),
        (["a=NPZ"], None, "expected a .npy"),
    ],
)
def test_load_input_files_errors(tmp_path, specs, npz, message):
    good = tmp_path / "good.npy"
    np.save(good, np.zeros(2))
    np.savez(tmp_path / "arch.npz", a=np.zeros(2))
    specs = [s.replace("GOOD", str(good)).replace("NPZ", str(tmp_path / "arch.npz")) for s in specs]
    with pytest.raises(BadInputError, match=message) as info:
        v.load_input_files(specs, npz, input_names=["a"])
    assert "\n" not in str(info.value)


# --------------------------------------------------------------------------- runtime behaviour

RANDOM_TEXT = (
    "g (float[N, 4] x) => (float[N, 4] y, float[N, 4] r) { y = Neg(x)\n r = RandomUniformLike(x) }"
)


def test_nondeterministic_reference_output_is_flagged_and_passes():
    result = v.validate(model(RANDOM_TEXT), model(RANDOM_TEXT), v.ValidationOptions(samples=2))
    assert result.passed
    rs = [o for o in result.outputs if o.name == "r"]
    assert [o.sample for o in rs] == [0, 1]
    assert all(o.nondeterministic and o.passed and "non-deterministic" in o.reason for o in rs)
    assert not any(o.nondeterministic for o in result.outputs if o.name == "y")


def test_nondeterminism_does_not_hide_other_failures():
    cand = model(RANDOM_TEXT.replace("Neg(x)", "Identity(x)"))
    result = v.validate(model(RANDOM_TEXT), cand)
    assert not result.passed
    assert not only(result, "y").passed and only(result, "r").passed


def test_broken_candidate_is_a_failure_with_error():
    ref = model("g (float[2] x) => (float[2] y) { y = Neg(x) }")
    cand = model("g (float[2] x) => (float[2] y) { y = NoSuchOp(x) }")
    result = v.validate(ref, cand)
    assert not result.passed
    assert result.error is not None and "NoSuchOp" in result.error
    assert json.dumps(v.to_dict(result))


def test_candidate_failing_at_run_time_is_a_failure():
    ref = model("g (float[N] x) => (float[N] y) { y = Neg(x) }")
    # Reshape to a fixed 5 elements: loads fine, fails when run on the 8 generated elements.
    cand = model(
        "g (float[N] x) => (float[N] y) <int64[1] s = {5}> { t = Reshape(x, s)\n y = Neg(t) }"
    )
    result = v.validate(ref, cand)
    assert not result.passed and "could not run the candidate" in result.error


def test_broken_reference_raises_bad_input():
    ref = model("g (float[2] x) => (float[2] y) { y = NoSuchOp(x) }")
    with pytest.raises(BadInputError, match="onnxruntime cannot run the input model"):
        v.validate(ref, ref)


def test_sessions_never_coexist_and_are_released(monkeypatch):
    created: list[weakref.ref] = []
    alive_at_creation: list[int] = []
    real = onnxruntime.InferenceSession

    class Tracking(real):
        def __init__(self, *args, **kwargs):
            alive_at_creation.append(sum(ref() is not None for ref in created))
            super().__init__(*args, **kwargs)
            created.append(weakref.ref(self))

    monkeypatch.setattr(onnxruntime, "InferenceSession", Tracking)
    ref = add_const("0.0, 1.0, 2.0")
    assert v.validate(ref, add_const("0.0, 1.0, 2.0"), v.ValidationOptions(samples=2)).passed
    bad = model("g (float[N, 3] x) => (float[N, 3] y) { y = Neg(x, x, x) }")
    assert v.validate(ref, bad).error is not None
    assert len(created) == 3  # reference, candidate, reference (the broken one never loads)
    assert alive_at_creation == [0, 0, 0, 0]
    assert all(r() is None for r in created)  # nothing retained a session


def test_session_options_disable_optimizations(monkeypatch):
    seen = []
    real = onnxruntime.InferenceSession

    def spy(source, sess_options=None, **kwargs):
        seen.append((sess_options, kwargs))
        return real(source, sess_options, **kwargs)

    monkeypatch.setattr(onnxruntime, "InferenceSession", spy)
    v.run_model(add_const("1, 2, 3"), {"x": np.zeros((1, 3), np.float32)})
    ((options, kwargs),) = seen
    assert options.graph_optimization_level == onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
    assert options.log_severity_level == 3
    assert kwargs["providers"] == ["CPUExecutionProvider"]


def test_models_are_not_modified_including_external_data_route(monkeypatch):
    ref, cand = add_const("0.0, 1.0, 2.0"), add_const("0.0, 1.0, 2.0")
    before = proto_bytes(ref), proto_bytes(cand)
    assert v.validate(ref, cand).passed
    monkeypatch.setattr(v, "_PROTO_LIMIT_BYTES", 0)  # force the temp-file/external-data route
    assert v.validate(ref, add_const("0.0, 1.0, 2.5")).outputs[0].max_abs == pytest.approx(0.5)
    assert (proto_bytes(ref), proto_bytes(cand)) == before


def test_models_given_as_paths(tmp_path):
    ir.save(add_const("0.0, 1.0, 2.0"), tmp_path / "ref.onnx", external_data="ref.data")
    ir.save(add_const("0.0, 1.0, 2.0"), tmp_path / "cand.onnx")
    result = v.validate(tmp_path / "ref.onnx", str(tmp_path / "cand.onnx"))
    assert result.passed and result.input_shapes == {"x": (1, 3)}
    missing = v.validate(tmp_path / "ref.onnx", tmp_path / "nope.onnx")
    assert not missing.passed and missing.error


def test_progress_callback_reports_stages():
    stages: list[str] = []
    v.validate(add_const("1, 2, 3"), add_const("1, 2, 3"), progress=stages.append)
    assert "reference run 1/2 (sample 1/1)" in stages
    assert "reference run 2/2 (sample 1/1)" in stages
    assert stages.index("released reference session") < stages.index("creating candidate session")
    assert stages[-1] == "comparing outputs"


def test_samples_must_be_positive():
    with pytest.raises(BadInputError, match="samples"):
        v.validate(add_const("1, 2, 3"), add_const("1, 2, 3"), v.ValidationOptions(samples=0))


def test_to_dict_is_json_ready():
    ref = model("g (float[N, 3] x) => (float[N, 3] y) { y = Identity(x) }")
    cand = model("g (float[N, 3] x) => (double[N, 3] y) { y = Cast<to=11>(x) }")
    result = v.validate(ref, cand)
    data = v.to_dict(result)
    text = json.dumps(data, allow_nan=False)
    assert json.loads(text)["passed"] is False
    (out,) = data["outputs"]
    assert out["max_abs"] is None and out["shape"] == [1, 3] and out["reason"]
    ok = v.to_dict(v.validate(add_const("1, 2, 3"), add_const("1, 2, 3")))
    json.dumps(ok, allow_nan=False)
    assert ok["outputs"][0]["max_abs"] == 0.0 and ok["input_shapes"] == {"x": [1, 3]}
