"""Tests for fusectl.validate: input generation, running on onnxruntime, comparison."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime
import pytest

from fusectl import ortprocess
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


def only(result: v.ValidationResult, name: str = "y", sample: int = 0) -> v.OutputComparison:
    matches = [o for o in result.outputs if o.name == name and o.sample == sample]
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
    assert out.dtype == "float32" and out.shape == (2, 3)  # batch-like N: 2
    assert (out.rtol, out.atol) == (1e-4, 1e-5)
    assert result.input_shapes == {"x": (2, 3)}


def test_perturbed_constant_fails_with_exact_max_abs():
    result = v.validate(add_const("0.0, 1.0, 2.0"), add_const("0.0, 1.5, 2.0"))
    assert not result.passed
    out = only(result)
    assert not out.passed
    assert out.max_abs == pytest.approx(0.5, abs=1e-6)
    assert out.mean_abs == pytest.approx(0.5 / 3, abs=1e-6)
    assert out.pct_out_of_tol == pytest.approx(100 / 3)
    assert "2 of 6 elements" in out.reason


def test_shape_mismatch_fails_with_reason():
    ref = model("g (float[N, 3] x) => (float[N, 3] y) { y = Identity(x) }")
    cand = model(
        "g (float[N, 3] x) => (float[1, N, 3] y) <int64[1] ax = {0}> { y = Unsqueeze(x, ax) }"
    )
    out = only(v.validate(ref, cand))
    assert not out.passed
    assert "shape mismatch" in out.reason and "(1, 2, 3)" in out.reason


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


def test_fp32_tolerance_is_relative_to_at_least_the_rms():
    """GPT-2 logits: RMS ~17, one element near zero moved by 1.2e-4 through reassociated
    sums. Tolerance there is 1e-5 + 1e-4 * 17 = 1.7e-3, so rounding passes and a real
    error of 0.01 on the same element does not."""
    rng = np.random.default_rng(0)
    ref = (rng.standard_normal(1000) * 17).astype(np.float32)
    ref[7] = 0.03
    rms = float(np.sqrt(np.mean(ref.astype(np.float64) ** 2)))
    rounding, bug = ref.copy(), ref.copy()
    rounding[7] += 1.2e-4
    bug[7] += 1e-5 + 1e-4 * rms + 1e-3
    (ok,) = v.compare_outputs({"y": ref}, {"y": rounding})
    (bad,) = v.compare_outputs({"y": ref}, {"y": bug})
    assert ok.passed
    assert not bad.passed and bad.pct_out_of_tol == pytest.approx(0.1)


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
    assert ids.dtype == np.int32 and ids.shape == (2, 400)
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


MASKED_FILL = (
    "g (float[N, S] x, bool[N, S] key_padding_mask) => (float[N, S] y) "
    "<float ninf = {{-inf}}, float zero = {{0.0}}> "
    "{{ {body} s = Softmax(a)\n y = Mul(s, x) }}"
)


@pytest.mark.parametrize(("body", "fill"), [
    # torch's masked_fill(mask, -inf): True masks the key out, so generate False
    ("m = Unsqueeze(key_padding_mask, zero_axes)\n w = Where(m, ninf, zero)\n a = Add(x, w)",
     False),
    # a Not in between: True keeps the key
    ("m = Not(key_padding_mask)\n w = Where(m, ninf, zero)\n a = Add(x, w)", True),
    # True picks the zero: it keeps the key
    ("w = Where(key_padding_mask, zero, ninf)\n a = Add(x, w)", True),
    # a fill that is not very negative masks nothing out
    ("w = Where(key_padding_mask, x, zero)\n a = Add(x, w)", True),
])
def test_mask_polarity_follows_where_the_mask_fills(body: str, fill: bool):
    text = MASKED_FILL.format(body=body)
    if "zero_axes" in text:
        text = text.replace("float zero = {0.0}>", "float zero = {0.0}, int64[1] zero_axes = {0}>")
    mask = v.generate_inputs(model(text))["key_padding_mask"]
    assert mask.dtype == np.bool_ and mask.shape == (2, 8)
    padded = np.zeros((2, 8), bool)
    padded[1, -1] = True  # one padded key, never a whole row
    np.testing.assert_array_equal(mask, np.where(padded, not fill, fill))


def assert_fused_and_validated(m: ir.Model, rule: str) -> None:
    """``rule`` fires once on ``m`` and the optimized model validates, nothing reverted."""
    import fusectl

    result = fusectl.optimize(m)
    assert result.passed and result.bisection is None
    assert result.rewrite.counts().get(rule) == 1


def test_key_padding_mask_attention_validates_once_fused():
    """nn.MultiheadAttention's key_padding_mask (dynamo export, opset 23): with the mask all
    True every key was masked, the reference's Softmax gave NaN and onnxruntime's fused
    Attention 0, so the fusion was reverted as a mismatch."""
    m = model(
        "g (float[2,4,6,16] Q, float[8,6,16] k3, float[2,4,6,16] V, bool[2,6] key_padding_mask)"
        " => (float[2,4,6,16] y)"
        " <int64[4] sh2 = {2, 4, 16, 6}, float c = {0.5}, float ninf = {-inf},"
        " float zero = {0.0}, int64[4] rows = {2, 1, 1, 6}, int64[4] heads = {2, 4, 1, 6}> {"
        " w = Where(key_padding_mask, ninf, zero)  w4 = Reshape(w, rows)"
        " mask = Expand(w4, heads)"
        " k3t = Transpose<perm=[0, 2, 1]>(k3)  kt = Reshape(k3t, sh2)"
        " qs = Mul(Q, c)  ks = Mul(kt, c)  s = MatMul(qs, ks)  a = Add(s, mask)"
        " p = Softmax<axis=-1>(a)  y = MatMul(p, V) }",
        header='<ir_version: 10, opset_import: ["" : 23]>',
    )
    assert_fused_and_validated(m, "attention-sdpa-flattened-key")


def test_a_candidate_that_drops_the_mask_fails():
    """With every key kept, a fusion that ignored the mask passed validation."""
    header = "g (float[N, S] x, int64[N, S] attention_mask) => (float[N, S] y) "
    reference = model(header + "<float zero = {0.0}, float low = {-10000.0}> {"
                      " keep = Cast<to=9>(attention_mask)  w = Where(keep, zero, low)"
                      " a = Add(x, w)  y = Softmax(a) }")
    dropped = model(header + "{ y = Softmax(x) }")
    assert v.validate(reference, reference).passed
    assert not v.validate(reference, dropped).passed


def test_query_by_key_mask_rows_masked_entirely_validate_once_fused():
    """DeBERTa's padding mask is mask[:, None, :, None] * mask[:, None, None, :]: a padded
    position's query row is masked entirely. onnxruntime's Attention returned 0 there for the
    finfo.min fill, the graph the mean of V; the additive mask is built with -1e30 instead."""
    m = model(
        "g (float[2,4,6,16] Q, float[2,4,6,16] K, float[2,4,6,16] V, int64[2,6] attention_mask)"
        " => (float[2,4,6,16] y)"
        " <int64[2] qa = {1, 3}, int64[2] ka = {1, 2}, float c = {0.25},"
        " float low = {-3.4028234663852886e38}> {"
        " mq = Unsqueeze(attention_mask, qa)  mk = Unsqueeze(attention_mask, ka)"
        " both = Mul(mq, mk)  keep = Cast<to=9>(both)"
        " kt = Transpose<perm=[0, 1, 3, 2]>(K)  s0 = MatMul(Q, kt)  s = Mul(s0, c)"
        " w = Where(keep, s, low)  p = Softmax<axis=-1>(w)  y = MatMul(p, V) }",
        header='<ir_version: 10, opset_import: ["" : 23]>',
    )
    assert_fused_and_validated(m, "attention-sdpa")


def test_attention_mask_pads_one_key_and_shares_dims():
    m = model(
        "g (int64[batch, seq] input_ids, int64[batch, seq] attention_mask) => (int64[batch, seq] y)"
        " { y = Mul(input_ids, attention_mask) }"
    )
    feeds = v.generate_inputs(m, v.ValidationOptions(dims={"seq": 6}))
    # ones but the last key of the second sequence: a fusion that drops the mask shows
    np.testing.assert_array_equal(feeds["attention_mask"], [[1] * 6, [1] * 5 + [0]])
    ids = feeds["input_ids"]
    assert ids.min() >= 0 and ids.max() < 10


def test_default_and_bound_dims():
    m = model(
        "g (float[N, seq, 3] a, float[batch_size, ?] b, bool[B] c) => (float[N, seq, 3] y) "
        "{ y = Identity(a) }"
    )
    feeds = v.generate_inputs(m)
    assert feeds["a"].shape == (2, 8, 3)
    assert feeds["b"].shape == (2, 8)
    assert feeds["c"].shape == (2,) and feeds["c"].dtype == np.bool_
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
    np.testing.assert_array_equal(v.run_model(m, feeds)["y"], x * [[1, 1, 1], [1, 1, 0]])
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


def test_given_inputs_making_every_float_output_nan_are_refused():
    """NaN facing NaN passes, so on an all-NaN input every output would agree without a
    number compared; a NaN among numbers, an empty input, or a model that maps NaN to
    numbers is compared as usual."""
    m = model("g (float[N, 3] x) => (float[N, 3] y) { y = Identity(x) }")
    nan = np.full((2, 3), np.nan, np.float32)
    message = ("^every float output of the model is NaN on the given inputs; validation "
               "would compare nothing$")
    with pytest.raises(BadInputError, match=message):
        v.validate(m, m, v.ValidationOptions(inputs={"x": nan}))
    brain = model("g (bfloat16[2] x) => (bfloat16[2] y) { y = Identity(x) }")
    with pytest.raises(BadInputError, match=message):
        v.validate(brain, brain, v.ValidationOptions(
            inputs={"x": np.full(2, np.nan, ml_dtypes.bfloat16)}))
    some = nan.copy()
    some[0, 0] = 1.0
    assert v.validate(m, m, v.ValidationOptions(inputs={"x": some})).passed
    empty = np.zeros((0, 3), np.float32)
    assert v.validate(m, m, v.ValidationOptions(inputs={"x": empty})).passed
    guarded = model("""g (float[N, 3] x, float[N, 3] w) => (float[N, 3] y)
        <float zero = {0.0}> { n = IsNaN(x)  c = Where(n, zero, x)  y = Add(c, w) }""")
    feeds = {"x": nan, "w": np.ones((2, 3), np.float32)}
    assert v.validate(guarded, guarded, v.ValidationOptions(inputs=feeds)).passed


def test_cli_exits_2_on_all_nan_inputs(capsys, tmp_path):
    """A CI gate must not pass vacuously: bad input, one line, no model written."""
    from fusectl.cli import main

    path = tmp_path / "m.onnx"
    ir.save(add_const("0.0, 1.0, 2.0"), path)
    np.savez(tmp_path / "nan.npz", x=np.full((4, 3), np.nan, np.float32))
    written = tmp_path / "o.onnx"
    code = main(["optimize", str(path), "--inputs", str(tmp_path / "nan.npz"), "-o",
                 str(written)])
    err = capsys.readouterr().err
    assert code == 2
    assert err.strip() == ("error: every float output of the model is NaN on the given "
                           "inputs; validation would compare nothing")
    assert not written.exists()


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
        (["a=JUNK"], None, "not a .npy/.npz file"),  # numpy would say "allow_pickle"
        ([], "JUNK", "not a .npy/.npz file"),
    ],
)
def test_load_input_files_errors(tmp_path, specs, npz, message):
    good = tmp_path / "good.npy"
    np.save(good, np.zeros(2))
    np.savez(tmp_path / "arch.npz", a=np.zeros(2))
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"this is no array at all\n" * 4)
    specs = [s.replace("GOOD", str(good)).replace("NPZ", str(tmp_path / "arch.npz"))
             .replace("JUNK", str(junk)) for s in specs]
    npz = str(junk) if npz == "JUNK" else npz
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
    created: list[ortprocess.Session] = []
    open_at_creation: list[int] = []
    real = ortprocess.open_session

    def tracking(source):
        open_at_creation.append(sum(s._open for s in created))
        created.append(real(source))
        return created[-1]

    monkeypatch.setattr(v, "open_session", tracking)
    ref = add_const("0.0, 1.0, 2.0")
    assert v.validate(ref, add_const("0.0, 1.0, 2.0"), v.ValidationOptions(samples=2)).passed
    bad = model("g (float[N, 3] x) => (float[N, 3] y) { y = Neg(x, x, x) }")
    assert v.validate(ref, bad).error is not None
    assert len(created) == 3  # reference, candidate, reference (the broken one never loads)
    assert open_at_creation == [0, 0, 0, 0]
    assert not any(s._open for s in created)  # every session was released


def test_onnxruntime_process_holds_one_session_at_a_time():
    with ortprocess.open_session(proto_bytes(add_const("1, 2, 3"))) as session:
        assert session.input_names == ["x"] and session.output_names == ["y"]
        with pytest.raises(ortprocess.OrtError, match="a session is open already"):
            ortprocess.open_session(proto_bytes(add_const("1, 2, 3")))
    with ortprocess.open_session(proto_bytes(add_const("1, 2, 3"))) as again:
        (y,), _ = again.run({"x": np.zeros((1, 3), np.float32)})
    assert y.tolist() == [[1.0, 2.0, 3.0]]


def test_session_options_disable_optimizations():
    from fusectl import ortchild

    options = ortchild.session_options()
    assert options.graph_optimization_level == onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
    assert options.log_severity_level == 4  # fatal only: our one-line error instead
    session = ortchild.open_session(proto_bytes(add_const("1, 2, 3")))
    assert session.get_providers() == ["CPUExecutionProvider"]


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
    assert result.passed and result.input_shapes == {"x": (2, 3)}
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
    assert out["max_abs"] is None and out["shape"] == [2, 3] and out["reason"]
    ok = v.to_dict(v.validate(add_const("1, 2, 3"), add_const("1, 2, 3")))
    json.dumps(ok, allow_nan=False)
    assert ok["outputs"][0]["max_abs"] == 0.0 and ok["input_shapes"] == {"x": [2, 3]}


# --------------------------------------------------------------------------- input folders


def save_pb(path, array: np.ndarray, name: str = "") -> None:
    path.write_bytes(onnx.numpy_helper.from_array(array, name).SerializeToString())


def test_inputs_from_a_test_data_set_folder(tmp_path):
    m = model("g (float[N, 3] x, int64[N] k) => (float[N, 3] y) { y = Identity(x) }")
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    k = np.array([4, 5], np.int64)
    save_pb(tmp_path / "input_0.pb", x, "x")
    save_pb(tmp_path / "input_1.pb", k)  # no name: the model's second input, by position
    save_pb(tmp_path / "output_0.pb", x, "y")  # expected outputs are ignored
    loaded = v.load_input_files([], tmp_path)
    assert set(loaded) == {"x", 1}
    feeds = v.generate_inputs(m, v.ValidationOptions(inputs=loaded))
    np.testing.assert_array_equal(feeds["x"], x)
    np.testing.assert_array_equal(feeds["k"], k)
    named = v.load_input_files([], tmp_path, input_names=["x", "k"])
    assert set(named) == {"x", "k"}
    result = v.validate(m, m, v.ValidationOptions(inputs=loaded))
    assert result.passed and result.input_shapes == {"x": (2, 3), "k": (2,)}


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ({}, "no input_0.pb"),
        ({"input_0.pb": "x", "input_2.pb": "k"}, "input_1.pb is missing"),
        ({"input_0.pb": b"\xff\xff\xff garbage"}, "cannot read"),
        ({"input_0.pb": "", "input_1.pb": "", "input_2.pb": ""}, "has only 2 inputs"),
        ({"input_0.pb": "k", "input_1.pb": ""}, "given twice"),
    ],
)
def test_input_folder_errors(tmp_path, files, message):
    for file, content in files.items():
        if isinstance(content, bytes):
            (tmp_path / file).write_bytes(content)
        else:
            save_pb(tmp_path / file, np.zeros(2, np.float32), content)
    with pytest.raises(BadInputError, match=message) as info:
        v.load_input_files([], tmp_path, input_names=["x", "k"])
    assert "\n" not in str(info.value)


def test_cli_accepts_an_input_folder(capsys, tmp_path):
    from fusectl.cli import main

    path = tmp_path / "m.onnx"
    ir.save(add_const("0.0, 1.0, 2.0"), path)
    data = tmp_path / "test_data_set_0"
    data.mkdir()
    save_pb(data / "input_0.pb", np.ones((4, 3), np.float32))
    report = tmp_path / "r.json"
    code = main(["optimize", str(path), "--inputs", str(data), "--json", str(report), "-q"])
    assert code == 0, capsys.readouterr().err
    assert json.loads(report.read_text())["validation"]["input_shapes"] == {"x": [4, 3]}
    save_pb(data / "input_1.pb", np.ones((4, 3), np.float32))
    assert main(["optimize", str(path), "--inputs", str(data), "-q"]) == 2
    err = capsys.readouterr().err
    assert "only 1 inputs" in err and len(err.strip().splitlines()) == 1


def test_inputs_that_cannot_be_generated_say_how_to_provide_them():
    strings = model("g (string[2] s) => (string[2] y) { y = Identity(s) }")
    with pytest.raises(BadInputError, match="of type string.*--input NAME=FILE.npy"):
        v.generate_inputs(strings)
    digits = v.generate_inputs(strings, v.ValidationOptions(input_ranges={"s": (0, 10)}))
    assert all(d in "0123456789" for d in digits["s"])
    proto = onnx.parser.parse_model(f"{HEADER}\ng (float x) => (float y) {{ y = Identity(x) }}")
    proto.graph.input[0].type.tensor_type.ClearField("shape")  # rank unknown
    with pytest.raises(BadInputError, match="rank is unknown; give its shape with --input-shape"):
        v.generate_inputs(ir.serde.deserialize_model(proto))


# --------------------------------------------------------------------------- half precision


def test_half_outputs_measure_relative_error_against_the_rms():
    # rms of the reference [0.001, 1, -1, 1, -1] is sqrt(4/5) = 0.894, so in fp16 an element
    # may be off by 1e-3 + 1e-2 * 0.894 = 0.0099 whatever its own magnitude.
    ref = np.array([0.001, 1, -1, 1, -1])
    near = ref + np.array([0.008, 0, 0, 0, 0])
    far = ref + np.array([0.011, 0, 0, 0, 0])
    (ok16,) = v.compare_outputs({"y": ref.astype(np.float16)}, {"y": near.astype(np.float16)})
    (bad16,) = v.compare_outputs({"y": ref.astype(np.float16)}, {"y": far.astype(np.float16)})
    (bad32,) = v.compare_outputs({"y": ref.astype(np.float32)}, {"y": near.astype(np.float32)})
    assert ok16.passed and not bad16.passed and not bad32.passed
    assert bad16.pct_out_of_tol == pytest.approx(20.0)


def test_wider_outputs_of_a_half_model_get_half_tolerances():
    ref, cand = {"y": np.array([1.0, 2.0], np.float32)}, {"y": np.array([1.005, 2.0], np.float32)}
    (strict,) = v.compare_outputs(ref, cand)
    (half,) = v.compare_outputs(ref, cand, compute_dtype=np.dtype(np.float16))
    assert not strict.passed and strict.tolerance_dtype is None
    assert half.passed and (half.rtol, half.atol, half.tolerance_dtype) == (1e-2, 1e-3, "float16")
    m = model(
        "g (float[N, 4] x) => (float[N, 4] y) { h = Cast<to=10>(x)\n y = Cast<to=1>(h) }"
    )
    result = v.validate(m, m)
    assert result.compute_dtype == "float16"
    assert {o.tolerance_dtype for o in result.outputs} == {"float16"}


def test_saturation_and_reference_overflow():
    top = float(np.finfo(np.float16).max)
    (saturated,) = v.compare_outputs(
        {"y": np.array([top, 1.0], np.float16)}, {"y": np.array([np.inf, 1.0], np.float16)}
    )
    (overflow,) = v.compare_outputs(
        {"y": np.array([100.0, 1.0], np.float16)}, {"y": np.array([np.inf, 1.0], np.float16)}
    )
    assert saturated.passed and not overflow.passed
    ref, cand = {"y": np.array([np.inf, 1.0], np.float16)}, {"y": np.array([5.0, 1.0], np.float16)}
    (normal,) = v.compare_outputs(ref, cand)
    (ranged,) = v.compare_outputs(ref, cand, range_sample=True)
    assert not normal.passed
    assert ranged.passed and ranged.range_sample  # the reference overflowed there itself


def fp16_rms_model(opset: int) -> ir.Model:
    """An fp16 RMS norm computed in float32 between Casts, as fp16 LLM exports write it."""
    helper, tp = onnx.helper, onnx.TensorProto
    nodes = [
        helper.make_node("Cast", ["x"], ["xf"], to=tp.FLOAT),
        helper.make_node("Pow", ["xf", "two"], ["sq"]),
        helper.make_node("ReduceMean", ["sq", "axes"], ["ms"]),
        helper.make_node("Add", ["ms", "eps"], ["v"]),
        helper.make_node("Sqrt", ["v"], ["r"]),
        helper.make_node("Div", ["xf", "r"], ["n"]),
        helper.make_node("Cast", ["n"], ["z"], to=tp.FLOAT16),
        helper.make_node("Mul", ["z", "w"], ["y"]),
    ]
    weights = {
        "axes": np.array([-1], np.int64),
        "eps": np.array(1e-6, np.float32),
        "two": np.array(2.0, np.float32),
        "w": np.linspace(0.5, 1.5, 64).astype(np.float16),
    }
    graph = helper.make_graph(
        nodes, "rms",
        [helper.make_tensor_value_info("x", tp.FLOAT16, ["batch", 4, 64])],
        [helper.make_tensor_value_info("y", tp.FLOAT16, ["batch", 4, 64])],
        [onnx.numpy_helper.from_array(a, n) for n, a in weights.items()],
    )  # fmt: skip
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)],
                              ir_version=10)
    return ir.serde.deserialize_model(proto)


def test_fp16_models_get_a_range_sample():
    m = fp16_rms_model(18)
    reference = v.run_reference(m)
    assert reference.range_sample == 1 and len(reference.feed_sets) == 2
    wide = np.abs(reference.feed_sets[1]["x"].astype(np.float32))
    assert 256 < wide.max() < 512  # squares overflow float16 for |x| > 256
    assert np.abs(reference.feed_sets[0]["x"].astype(np.float32)).max() <= 1
    assert v.run_reference(m, v.ValidationOptions(fp16_range_sample=False)).range_sample is None
    assert v.run_reference(add_const("1, 2, 3")).range_sample is None  # float32 model
    given = v.ValidationOptions(inputs={"x": np.ones((1, 4, 64), np.float16)})
    assert v.run_reference(m, given).range_sample is None  # no generated float input


# The deliberately wrong fp16 rule (written only here): it keeps the squares of an RMS norm
# in float16 to halve their traffic. On inputs in [-1, 1) that only rounds; beyond 256 the
# squares overflow to inf, the norm to inf, and the output to zero.
HALF_SQUARES = """\
version: 1
rules:
  - id: rmsnorm-half-squares
    summary: Broken on purpose - keeps the squares in float16; they overflow.
    match:
      - xf = Cast<to=1>(x)
      - sq = Pow(xf, two)
      - ms = ReduceMean<keepdims=1>(sq, axes)
    where:
      - expr: dtype(x) == "float16"
    replace:
      - xf = Cast<to=1>(x)
      - sq16 = Cast<to=10>(Mul(xf, xf))
      - ms = ReduceMean<keepdims=1>(Cast<to=1>(sq16), axes)
"""


def test_fp16_overflow_is_caught_by_the_range_sample_and_bisected(tmp_path):
    import fusectl

    (tmp_path / "half.yaml").write_text(HALF_SQUARES)
    rules = fusectl.load_rule_set([tmp_path / "half.yaml"], builtin=False)
    result = fusectl.optimize(fp16_rms_model(18), rules=rules)
    bisection = result.bisection
    assert bisection is not None
    ordinary, ranged = bisection.initial.outputs
    assert ordinary.passed and not ordinary.range_sample  # only rounding on [-1, 1)
    assert not ranged.passed and ranged.range_sample
    assert ranged.max_abs > 0.5  # outputs of magnitude ~1 collapsed to 0
    assert [(a.rule_id, a.matched) for a in bisection.reverted] == [
        ("rmsnorm-half-squares", ("ReduceMean_0", "Pow_0", "Cast_0"))
    ]
    assert result.verified and result.rewrite.applications == ()


def test_legitimate_fp16_fusion_passes_both_samples():
    import fusectl

    result = fusectl.optimize(fp16_rms_model(23))
    assert result.rewrite.counts().get("rmsnorm-normalize-fp16") == 1
    assert result.passed and result.bisection is None
    assert [o.range_sample for o in result.validation.outputs] == [False, True]


# --------------------------------------------------------------------------- statistics


def test_error_histogram_buckets_by_decade():
    ref = np.zeros(7, np.float64)
    cand = np.array([0.0, 5e-10, 3e-3, 0.5, 150.0, np.nan, 2e-3])
    (out,) = v.compare_outputs({"y": ref}, {"y": cand})
    counts = dict(zip(v.HISTOGRAM_LABELS, out.histogram, strict=True))
    assert counts == {
        "0": 1, "<1e-9": 1, "1e-9": 0, "1e-8": 0, "1e-7": 0, "1e-6": 0, "1e-5": 0, "1e-4": 0,
        "1e-3": 2, "1e-2": 0, "1e-1": 1, "1e0": 0, "1e1": 0, ">=1e2": 1, "nan/inf": 1,
    }  # fmt: skip
    assert v.comparison_to_dict(out)["error_histogram"] == counts


@pytest.fixture
def session_sources(monkeypatch) -> list[object]:
    """What each onnxruntime session is created from, in order."""
    sources: list[object] = []
    real = ortprocess.open_session

    def spy(source):
        sources.append(source)
        return real(source)

    monkeypatch.setattr(v, "open_session", spy)
    return sources


def test_reference_outputs_are_reused_for_many_candidates(session_sources):
    created = session_sources
    reference = v.run_reference(add_const("0.0, 1.0, 2.0"), v.ValidationOptions(samples=2))
    good = v.check_candidate(reference, add_const("0.0, 1.0, 2.0"))
    bad = v.check_candidate(reference, add_const("0.0, 1.0, 9.0"))
    assert len(created) == 3  # one reference session for both candidates
    assert good.passed and not bad.passed and bad.samples == 2
    assert [o.max_abs for o in bad.outputs] == pytest.approx([7.0, 7.0])


def test_check_intermediates_compares_named_values_in_order():
    ref = model("g (float[N, 3] x) => (float[N, 3] y) { a = Relu(x)\n b = Neg(a)\n y = Abs(b) }")
    cand = model(
        "g (float[N, 3] x) => (float[N, 3] y) <float c = {2.0}> "
        "{ a = Relu(x)\n b0 = Neg(a)\n b = Mul(b0, c)\n y = Abs(b) }"
    )
    reference = v.run_reference(ref)
    compared = v.check_intermediates(ref, cand, ["b", "a", "b0", "y"], reference)
    assert [c.name for c in compared] == ["b", "a"]  # b0 is not in ref; y is an output
    b, a = compared
    assert a.passed and a.max_abs == 0
    feeds = reference.feed_sets[0]["x"]
    assert not b.passed and b.max_abs == pytest.approx(np.maximum(feeds, 0).max())
    assert [o.name for o in ref.graph.outputs] == ["y"]  # the models were copied


def test_progress_steps_count_the_runs():
    steps: list[str] = []
    v.validate(add_const("1, 2, 3"), add_const("1, 2, 3"), v.ValidationOptions(samples=2),
               progress=steps.append)
    counted = [(s.done, s.total) for s in steps if isinstance(s, v.ProgressStep)]
    assert counted == [(0, 4), (1, 4), (2, 4), (3, 4), (4, 4), (0, 2), (1, 2), (2, 2)]


def test_api_validates_token_ids_and_flags_nondeterminism():
    import fusectl

    values = ", ".join(str(float(i % 7)) for i in range(1000 * 4))
    m = model(
        "g (int64[1, 64] input_ids) => (float[1, 64, 4] y, float[1, 64, 4] r) "
        f"<float[1000, 4] emb = {{{values}}}, float[4, 4] w = {{1,0,0,0, 0,2,0,0, 0,0,3,0, "
        "0,0,0,4}, float[4] b = {1, 1, 1, 1}> "
        "{ e = Gather(emb, input_ids)\n m = MatMul(e, w)\n y = Add(m, b)\n"
        " r = RandomUniformLike(y) }"
    )
    result = fusectl.optimize(m)
    assert result.rewrite.applications  # MatMul + Add fused
    assert result.passed and result.bisection is None
    statuses = {o.name: (o.passed, o.nondeterministic) for o in result.validation.outputs}
    assert statuses == {"y": (True, False), "r": (True, True)}
    assert result.validation.input_shapes == {"input_ids": (1, 64)}


def test_external_data_models_are_loaded_from_disk(tmp_path, samples, session_sources):
    import fusectl

    path = tmp_path / "cnn.onnx"
    ir.save(ir.load(samples / "cnn.onnx"), path, external_data="cnn.data")
    assert fusectl.optimize(path).passed
    reference, candidate = session_sources
    assert reference == str(path)  # onnxruntime reads the user's files itself
    assert isinstance(candidate, str) and candidate.endswith("model.onnx")  # a temp file


def test_progress_display_follows_the_runs():
    import io

    from rich.console import Console

    from fusectl.report import validation_progress

    with validation_progress(Console(file=io.StringIO()), enabled=False) as say:
        say("anything")  # a no-op
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=100)
    with validation_progress(console, enabled=True) as say:
        v.validate(add_const("1, 2, 3"), add_const("1, 2, 3"), progress=say)
    assert "candidate run" in out.getvalue() or "comparing outputs" in out.getvalue()


def test_scalar_bool_input_is_a_0d_array():
    """An If condition is a rank-0 bool input; numpy's comparison gives a numpy.bool scalar,
    which onnxruntime refuses: the generator returns a 0-d array."""
    proto = onnx.parser.parse_model("""<ir_version: 8, opset_import: ["" : 17]>
g (bool c, float[2] x) => (float[2] y) { y = Where(c, x, x) }""")
    feeds = v.generate_inputs(ir.serde.deserialize_model(proto))
    assert isinstance(feeds["c"], np.ndarray) and feeds["c"].shape == ()
    assert feeds["c"].dtype == np.bool_


def test_an_expression_dim_is_computed_from_its_symbols():
    """dynamo declares the attention mask of a model with a KV cache as ``s16 + s62`` long
    (new tokens + past ones): generated as 8 it would not broadcast against the scores."""
    m = model(
        'g (float[b, s16] x, float[b, "s16 + s62"] mask, float[b, 2, s62, 4] past) '
        "=> (float[b, s16] y) { y = Relu(x) }"
    )
    feeds = v.generate_inputs(m, v.ValidationOptions(), 0)
    assert feeds["mask"].shape == (2, 16) and feeds["past"].shape == (2, 2, 8, 4)
    bound = v.generate_inputs(m, v.ValidationOptions(dims={"s62": 3, "s16": 5}), 0)
    assert bound["mask"].shape == (2, 8) and bound["x"].shape == (2, 5)


def test_a_hyphenated_dim_name_is_a_name_not_a_difference():
    """``seq-len`` would evaluate as seq - len = 0 (an empty input compares nothing); a
    symbol no input names on its own means the dim is a plain name."""
    m = model('g (float[b, "seq-len"] x, float[b, "s1 - s2"] y) => (float[b, "seq-len"] z) '
              "{ z = Relu(x) }")
    feeds = v.generate_inputs(m, v.ValidationOptions(), 0)
    assert feeds["x"].shape == (2, 8) and feeds["y"].shape == (2, 8)
    summed = model('g (float[b, "seq+len"] x) => (float[b, "seq+len"] z) { z = Relu(x) }')
    assert v.generate_inputs(summed, v.ValidationOptions(), 0)["x"].shape == (2, 8)


def traced_batch_one(shift: str = "1.0") -> ir.Model:
    """A dynamic batch in the signature, batch 1 traced into a Reshape target inside: the
    model runs at batch 1 only."""
    return model(
        "g (float[batch, 4] x) => (float[batch, 2, 2] y) "
        f"<int64[3] t = {{1, 2, 2}}, float c = {{{shift}}}> {{ r = Reshape(x, t)\n y = Add(r, c) }}"
    )


def test_batch_like_dims_are_validated_at_two():
    """At batch 1 a rewrite that mixes up the batch axis passes; at 2 it shows."""
    ref = model("g (float[batch, 2, 3] x) => (float[batch, 3, 2] y) "
                "{ y = Transpose<perm=[0, 2, 1]>(x) }")
    wrong = model("g (float[batch, 2, 3] x) => (float[batch, 3, 2] y) "
                  "<int64[3] t = {-1, 3, 2}> { f = Transpose<perm=[2, 1, 0]>(x)\n"
                  " y = Reshape(f, t) }")
    result = v.validate(ref, wrong)
    assert result.input_shapes == {"x": (2, 2, 3)} and not result.passed
    assert v.validate(ref, wrong, v.ValidationOptions(batch=1)).passed


def test_a_model_that_runs_at_batch_one_only_is_validated_at_one():
    progress: list[str] = []
    reference = v.run_reference(traced_batch_one(), progress=progress.append)
    assert reference.input_shapes == {"x": (1, 4)}
    assert reference.batch_note and "fails with batch-like dims at 2" in reference.batch_note
    assert reference.batch_note in progress
    result = v.validate(traced_batch_one(), traced_batch_one())
    assert result.passed and v.to_dict(result)["batch_note"] == reference.batch_note
    assert not v.validate(traced_batch_one(), traced_batch_one("1.5")).passed
    assert v.validate(add_const("1, 2, 3"), add_const("1, 2, 3")).batch_note is None


def test_no_second_batch_when_the_batch_is_not_why_it_fails():
    """A session that cannot be created, or a batch the user's own array binds: a retry at
    batch 1 would fail the same way, so none is made."""
    progress: list[str] = []
    unknown_op = model("g (float[batch, 4] x) => (float[batch, 4] y) { y = Relu(x) }",
                       header='<ir_version: 8, opset_import: ["" : 17, "x.custom" : 1]>')
    unknown_op.graph.node(0).domain = "x.custom"
    with pytest.raises(BadInputError, match="cannot run the input model"):
        v.run_reference(unknown_op, progress=progress.append)
    with pytest.raises(BadInputError, match=r"requested shape:\{1,2,2\}"):
        v.run_reference(traced_batch_one(), v.ValidationOptions(
            inputs={"x": np.ones((3, 4), np.float32)}), progress=progress.append)
    two = model("g (float[batch, 4] x, float[batch, 4] m) => (float[batch, 2, 2] y) "
                "<int64[3] t = {1, 2, 2}> { s = Add(x, m)\n y = Reshape(s, t) }")
    with pytest.raises(BadInputError, match="requested shape"):  # x's batch 3 binds m's
        v.run_reference(two, v.ValidationOptions(inputs={"x": np.ones((3, 4), np.float32)}),
                        progress=progress.append)
    with pytest.raises(BadInputError):
        v.run_reference(traced_batch_one(), v.ValidationOptions(dims={"batch": 2}),
                        progress=progress.append)
    assert progress and not any("trying" in p for p in progress)


@pytest.mark.parametrize("batch", [0, -1, True])
def test_a_batch_below_one_is_refused(batch):
    with pytest.raises(BadInputError, match="expected a positive integer"):
        v.generate_inputs(traced_batch_one(), v.ValidationOptions(batch=batch))


@pytest.mark.parametrize("size", [0, -1, True])
def test_a_size_below_one_is_refused(size):
    with pytest.raises(BadInputError, match="size .*expected a positive integer"):
        v.generate_inputs(traced_batch_one(), v.ValidationOptions(size=size))


def test_a_model_failing_at_size_8_is_validated_at_32():
    """A detector whose feature pyramid needs sizes divisible by 32 fails at the default 8;
    at 32 it runs, with a note, and the candidate is compared on the same inputs."""
    needs_wide = model("g (float[batch, W] x, float[32] c) => (float[batch, 32] y) "
                       "<int64[1] s = {0}, int64[1] e = {32}, int64[1] a = {1}> "
                       "{ t = Slice(x, s, e, a)\n y = Add(t, c) }")
    progress: list[str] = []
    reference = v.run_reference(needs_wide, progress=progress.append)
    assert reference.input_shapes == {"x": (2, 32), "c": (32,)}
    assert reference.batch_note.startswith("inputs generated with dynamic dims at 32: the "
                                           "input model fails with dynamic dims at 8")
    assert [p for p in progress if "trying" in p] == [
        f"the input model fails on generated inputs; trying {how}"
        for how in ("batch-like dims at 1", "dynamic dims at 32")]
    # no batch-like dim: the batch-1 fallback would generate the same inputs, and is skipped
    progress.clear()
    no_batch = model("g (float[W] x, float[32] c) => (float[32] y) "
                     "<int64[1] s = {0}, int64[1] e = {32}, int64[1] a = {0}> "
                     "{ t = Slice(x, s, e, a)\n y = Add(t, c) }")
    assert v.run_reference(no_batch, progress=progress.append).input_shapes["x"] == (32,)
    assert [p for p in progress if "trying" in p] == [
        "the input model fails on generated inputs; trying dynamic dims at 32"]
    assert v.validate(needs_wide, needs_wide).passed
    assert v.run_reference(needs_wide, v.ValidationOptions(dims={"W": 40})).batch_note is None


@pytest.mark.parametrize("first", [-1, "p2o.DynamicDimension.0"])
def test_the_first_axis_keeps_size_8_on_fallback(first):
    """Paddle2ONNX's images are [-1, 3, -1, -1] (or named so): the first axis is a batch by
    another name and stays at 8 when the others go to 32 (at 32 too, a 3-D volume's work
    would grow 4 times more)."""
    images = model("g (float[N, 3, H, W] x) => (float[N, 3, H, W] y) { y = Relu(x) }")
    for value in images.graph.inputs[:1] + images.graph.outputs[:1]:
        value.shape = ir.Shape([first, 3, -1, -1])
    assert v.generate_inputs(images)["x"].shape == (8, 3, 8, 8)
    assert v.generate_inputs(images, v.ValidationOptions(size=32))["x"].shape == (8, 3, 32, 32)
    # and where batch-like dims fall back to 1, so does it (an export that traced batch 1)
    assert v.generate_inputs(images, v.ValidationOptions(batch=1))["x"].shape == (1, 3, 8, 8)


def test_an_export_tracing_batch_one_behind_an_unnamed_leading_dim_runs_at_one():
    traced = model("g (float[N, 3, H, W] x) => (float[3, H, W] y) "
                   "<int64[1] a = {0}> { y = Squeeze(x, a) }")
    traced.graph.inputs[0].shape = ir.Shape([-1, 3, -1, -1])
    reference = v.run_reference(traced)
    assert reference.input_shapes == {"x": (1, 3, 8, 8)}
    assert "batch-like dims at 1" in reference.batch_note


def test_a_name_that_leads_one_input_has_one_size_in_all():
    """T leads x, so it is a batch by another name: 8 in m too, not 8 in x and 32 in m."""
    two = model("g (float[T, 4] x, float[2, T] m) => (float[2, 4] y) { y = MatMul(m, x) }")
    feeds = v.generate_inputs(two, v.ValidationOptions(size=32))
    assert feeds["x"].shape == (8, 4) and feeds["m"].shape == (2, 8)


def test_each_fallback_that_generates_the_same_inputs_is_skipped():
    """No batch-like dim: batch 1 is the default again, and batch 1 with 32 (512) is 32 (512)
    again."""
    needs_40 = model("g (float[W] x, float[40] c) => (float[40] y) { y = Add(x, c) }")
    progress: list[str] = []
    with pytest.raises(BadInputError, match="cannot run the input model"):
        v.run_reference(needs_40, progress=progress.append)
    assert [p for p in progress if "trying" in p] == [
        f"the input model fails on generated inputs; trying dynamic dims at {size}"
        for size in (32, 512)]


def test_a_model_failing_at_every_batch_names_the_batch_one_shapes():
    """No batch or size helps (W must be 40): the error is the one at the given settings,
    after every fallback was tried."""
    needs_w = model("g (float[batch, W] x, float[40] c) => (float[batch, 40] y) "
                    "{ y = Add(x, c) }")
    progress: list[str] = []
    with pytest.raises(BadInputError, match=r"generated inputs: x \[2, 8\]"):
        v.run_reference(needs_w, progress=progress.append)
    tried = [p for p in progress if p.startswith("the input model fails")]
    assert tried == [f"the input model fails on generated inputs; trying {how}" for how in (
        "batch-like dims at 1", "dynamic dims at 32",
        "batch-like dims at 1 and other dynamic dims at 32", "dynamic dims at 512",
        "batch-like dims at 1 and other dynamic dims at 512")]


def test_a_model_needing_a_long_signal_is_validated_at_512():
    """silero-vad reflects a window of 512 samples (Pad mode=reflect needs pads shorter
    than the axis): it fails at 8 and 32 and runs at 512, batch kept at 2."""
    reflect = model("g (float[batch, T] x) => (float[batch, U] y) "
                    "<int64[4] p = {0, 64, 0, 64}> { y = Pad<mode=\"reflect\">(x, p) }")
    progress: list[str] = []
    reference = v.run_reference(reflect, progress=progress.append)
    assert reference.input_shapes == {"x": (2, 512)}
    assert reference.batch_note.startswith("inputs generated with dynamic dims at 512")
    assert v.validate(reflect, reflect).passed


def test_the_512_fallback_is_skipped_for_large_inputs():
    """A volume with three dynamic axes would be 512**3 elements: never generated, the error
    is the one at the given settings."""
    volume = model("g (float[1, 1, D, H, W] x) => (float[1, 1, D, H, V] y) "
                   "<int64[10] p = {0, 0, 0, 0, 40, 0, 0, 0, 0, 40}> "
                   "{ y = Pad<mode=\"reflect\">(x, p) }")
    progress: list[str] = []
    with pytest.raises(BadInputError, match=r"generated inputs: x \[1, 1, 8, 8, 8\]"):
        v.run_reference(volume, progress=progress.append)
    assert not any("512" in p for p in progress)


def test_high_rank_dynamic_inputs_are_generated_within_the_element_budget():
    """Nine dynamic dims at 8 are 134M elements (a two-node model took a minute): the dims
    are halved until the inputs fit, with a note; 32-sized fallbacks over the budget are
    never tried (32**9 elements would not fit in memory)."""
    dims = ", ".join(f"d{i}" for i in range(9))
    nine = model(f"g (float[{dims}] x, float[{dims}] b) => (float[{dims}] y) "
                 "{ s = Add(x, b)\n y = Softmax<axis=-1>(s) }")
    progress: list[str] = []
    reference = v.run_reference(nine, progress=progress.append)
    assert reference.input_shapes == {"x": (4,) * 9, "b": (4,) * 9}
    assert reference.batch_note.startswith("inputs generated with dynamic dims at 4: at 8")
    assert v.validate(nine, nine).passed
    fallbacks = v._distinct_fallbacks(nine, v.ValidationOptions(size=4))
    assert [f.size for f in fallbacks] == [4]  # the batch at 1; none at 32 or 512
    small = model("g (float[N, C] x) => (float[N, C] y) { y = Relu(x) }")
    assert v.run_reference(small).batch_note is None  # within budget: untouched


def anonymous_vad() -> ir.Model:
    """silero-vad's shape: x [?, ?] and state [2, ?, 128], the anonymous batch shared by
    both (the model fails when they differ), the signal at least 64 samples long."""
    vad = model("g (float[N, T] x, float[2, B, 128] state) => (float[N, U] y, float[B, V] s) "
                "<int64[4] p = {0, 32, 0, 32}, int64[1] a0 = {0}, int64[1] a1 = {1}, "
                "int64[1] e = {128}> "
                "{ y = Pad<mode=\"reflect\">(x, p)\n h = ReduceSum<keepdims=0>(state, a0)\n"
                "  head = Slice(x, a0, e, a1)\n s = Concat<axis=1>(h, head) }")
    for value, axes in ((vad.graph.inputs[0], (0, 1)), (vad.graph.inputs[1], (1,))):
        value.shape = ir.Shape([None if axis in axes else d for axis, d in
                                enumerate(value.shape)])
    return vad


def test_given_shapes_set_anonymous_dims():
    """No --dim can name an anonymous dim; a whole shape per input can."""
    vad = anonymous_vad()
    with pytest.raises(BadInputError, match="--input-shape NAME=D0,D1"):
        v.run_reference(vad)  # [8, 8] at first; later fallbacks size the batches apart
    options = v.ValidationOptions(shapes={"x": (1, 512), "state": (2, 1, 128)})
    feeds = v.generate_inputs(vad, options)
    assert feeds["x"].shape == (1, 512) and feeds["state"].shape == (2, 1, 128)
    assert v.validate(vad, vad, options).passed


def test_a_given_shape_binds_its_names_in_other_inputs():
    two = model("g (float[batch, T] x, float[2, batch, 4] h) => (float[batch, T] y) "
                "{ y = Relu(x) }")
    feeds = v.generate_inputs(two, v.ValidationOptions(shapes={"x": (3, 40)}))
    assert feeds["x"].shape == (3, 40) and feeds["h"].shape == (2, 3, 4)
    assert v.shape_named_dims(two, v.ValidationOptions(shapes={"x": (3, 40)})) == {
        "batch": 3, "T": 40}


@pytest.mark.parametrize("shapes, dims, message", [
    ({"x": (1, 2, 3)}, {}, r"shape \[1, 2, 3\] has rank 3, the model declares"),
    ({"h": (3, 1, 4)}, {}, r"input 'h': axis 0 is 2 in the model \(\[2,batch,4\]\), not 3"),
    ({"x": (3, 4), "h": (2, 5, 4)}, {}, "axis 1 is dim batch, which input 'x' sets to 3, not 5"),
    ({"x": (3, 4)}, {"batch": 2}, "axis 0 is dim batch, bound to 2 by --dim, not 3"),
    ({"x": (-1, 4)}, {}, "must be non-negative integers"),
    ({"z": (1,)}, {}, "unknown input name 'z'"),
])
def test_a_given_shape_the_model_contradicts_is_refused(shapes, dims, message):
    two = model("g (float[batch, T] x, float[2, batch, 4] h) => (float[batch, T] y) "
                "{ y = Relu(x) }")
    with pytest.raises(BadInputError, match=message):
        v.generate_inputs(two, v.ValidationOptions(shapes=shapes, dims=dims))


def test_an_input_given_both_an_array_and_a_shape_is_refused():
    two = model("g (float[batch, T] x) => (float[batch, T] y) { y = Relu(x) }")
    with pytest.raises(BadInputError, match="both an array and a shape"):
        v.generate_inputs(two, v.ValidationOptions(inputs={"x": np.ones((1, 2), np.float32)},
                                                   shapes={"x": (1, 2)}))


def kv_mask_model() -> ir.Model:
    """optimum's decoder inputs: a mask over the past and the new tokens."""
    return model("g (float[batch, past] a, float[batch, seq] b, float[batch, M] m) "
                 "=> (float[batch] y) <int64[1] one = {1}> "
                 "{ c = Concat<axis=1>(a, b)\n s = Add(c, m)\n y = ReduceSum<keepdims=0>(s, one) }")


def with_sum_dim(m: ir.Model) -> ir.Model:
    value = m.graph.inputs[2]
    value.shape = ir.Shape([value.shape[0], ir.SymbolicDim("past + seq")])
    return m


def test_a_given_shape_of_a_sum_dim_is_checked_against_its_parts():
    vad = with_sum_dim(kv_mask_model())
    options = v.ValidationOptions(shapes={"a": (2, 4), "b": (2, 3), "m": (2, 7)})
    assert v.generate_inputs(vad, options)["m"].shape == (2, 7)
    assert v.shape_named_dims(vad, options) == {"batch": 2, "past": 4, "seq": 3}
    # alone, the mask's shape binds batch; its sum is left to the traffic model
    assert v.shape_named_dims(vad, v.ValidationOptions(shapes={"m": (2, 7)})) == {"batch": 2}
    with pytest.raises(BadInputError, match="axis 1 is dim past \\+ seq, which the sizes of "
                                            "past and seq make 7, not 10"):
        v.generate_inputs(vad, v.ValidationOptions(shapes={"a": (2, 4), "b": (2, 3),
                                                           "m": (2, 10)}))


def test_a_given_shape_is_checked_against_given_arrays_and_without_validation():
    two = model("g (float[batch, T] x, float[2, batch, 4] h) => (float[batch, T] y) "
                "{ y = Relu(x) }")
    options = v.ValidationOptions(inputs={"x": np.ones((3, 4), np.float32)},
                                  shapes={"h": (2, 5, 4)})
    with pytest.raises(BadInputError, match="axis 1 is dim batch, which input 'x' sets to 3"):
        v.generate_inputs(two, options)
    with pytest.raises(BadInputError, match="which input 'x' sets to 3"):
        v.shape_named_dims(two, options)  # what optimize --no-validate and diff call too
    with pytest.raises(BadInputError, match="unknown input name 'zz'"):
        v.shape_named_dims(two, v.ValidationOptions(shapes={"zz": (1,)}))


def test_a_given_shape_sets_the_rank_of_an_input_that_has_none():
    unranked = model("g (float[2, 3] x) => (float[2, 3] y) { y = Relu(x) }")
    unranked.graph.inputs[0].shape = None
    with pytest.raises(BadInputError, match="rank is unknown; give its shape with"):
        v.generate_inputs(unranked)
    assert v.generate_inputs(unranked, v.ValidationOptions(shapes={"x": (2, 3)}))["x"].shape \
        == (2, 3)


def test_the_512_fallback_budget_leaves_out_given_shapes():
    """A large input whose shape the user fixed is no reason to skip the fallback another
    input needs."""
    two = model("g (float[1, N] big, float[batch, T] x) => (float[1, N] z, float[batch, U] y) "
                "<int64[4] p = {0, 64, 0, 64}> "
                "{ z = Relu(big)\n y = Pad<mode=\"reflect\">(x, p) }")
    options = v.ValidationOptions(shapes={"big": (1, 1 << 25)})
    assert v._distinct_fallbacks(two, options)[-2:] == [
        replace(options, size=512), replace(options, batch=1, size=512)]


def test_a_given_shape_of_a_dim_named_with_a_slash_is_not_checked_as_a_quotient():
    """``h/2`` is a name (symdims does no arithmetic on it either): an odd h is no
    contradiction."""
    two = model("g (float[1, h] a, float[1, D] b) => (float[1, h] y) { y = Relu(a) }")
    two.graph.inputs[1].shape = ir.Shape([1, ir.SymbolicDim("h/2")])
    feeds = v.generate_inputs(two, v.ValidationOptions(shapes={"a": (1, 9), "b": (1, 4)}))
    assert feeds["b"].shape == (1, 4)


def test_a_model_written_at_a_newer_ir_version_than_onnxruntime_reads_is_validated(tmp_path):
    """onnx 1.23's make_model writes IR 14 and onnxruntime 1.31 reads up to 13: the model is
    run at the newest IR onnxruntime reads (its opsets need 7), the caller's model keeps its
    version; a model whose opsets need the newer IR still fails with onnxruntime's reason."""
    newest = onnx.IR_VERSION
    relu = model("g (float[N, 4] x) => (float[N, 4] y) { y = Relu(x) }")
    relu.ir_version = newest
    try:
        onnxruntime.InferenceSession(ir.to_proto(relu).SerializeToString(),
                                     providers=["CPUExecutionProvider"])
        pytest.skip("this onnxruntime reads onnx's newest IR version")
    except Exception as e:  # noqa: BLE001 - the refusal this test is about
        assert "Unsupported model IR version" in str(e)
    path = tmp_path / "relu.onnx"
    ir.save(relu, path)
    progress: list[str] = []
    assert v.validate(str(path), relu, progress=progress.append).passed
    assert relu.ir_version == newest
    assert sum("read as" in str(p) for p in progress) == 2  # reference and candidate
    opset = onnx.defs.onnx_opset_version()
    if onnx.helper.find_min_ir_version_for([onnx.helper.make_opsetid("", opset)]) == newest:
        latest = model("g (float[N, 4] x) => (float[N, 4] y) { y = Relu(x) }",
                       header=f'<ir_version: {newest}, opset_import: ["" : {opset}]>')
        with pytest.raises(BadInputError, match="onnxruntime cannot run"):
            v.run_reference(latest)
