"""The public Python API: an honest ``__all__`` and an ``optimize`` that leaves its input alone."""

from __future__ import annotations

import onnx
import onnx_ir as ir

import fusectl


def test_all_is_honest() -> None:
    for name in fusectl.__all__:
        assert hasattr(fusectl, name), name
    public = {n for n in vars(fusectl) if not n.startswith("_") and callable(getattr(fusectl, n))}
    assert {"optimize", "load_rule_set", "load_model", "save_model"} <= public


def test_optimize_ir_model_is_not_mutated(samples) -> None:
    model = ir.load(samples / "mlp.onnx")
    before = ir.to_proto(model).SerializeToString()
    result = fusectl.optimize(model)
    assert ir.to_proto(model).SerializeToString() == before
    assert result.passed and result.rewrite.counts() == {
        "matmul-add-to-gemm": 3, "transpose-cancel": 1,
    }
    assert result.nodes_after == result.nodes_before - 5
    assert result.bytes_saved == sum(a.bytes_saved for a in result.rewrite.applications)
    onnx.checker.check_model(ir.to_proto(result.model), full_check=True)


def test_rule_subset_and_targets(samples, tmp_path) -> None:
    rules = fusectl.load_rule_set(include=["transpose-*"])
    result = fusectl.optimize(samples / "mlp.onnx", rules=rules, check=False)
    assert result.validation is None
    assert set(result.rewrite.counts()) == {"transpose-cancel"}
    out = tmp_path / "m.onnx"
    fusectl.save_model(result.model, out)
    assert "Transpose" not in {n.op_type for n in onnx.load(out).graph.node}


OPT_IN_RULES = """
version: 1
rules:
  - id: transpose-pair-gone
    summary: Two inverse Transposes are nothing (a stand-in for a rule with a trade-off).
    opt_in: measured slower somewhere
    when: {opset: ">=1"}
    match:
      - t = Transpose<perm=[1, 0]>(x)
      - y = Transpose<perm=[1, 0]>(t)
    replace:
      - y = Identity(x)
    tests:
      - name: fires
        model: |
          <ir_version: 8, opset_import: ["" : 17]>
          g (float[2,3] x) => (float[3,2] z)
          { t = Transpose<perm=[1,0]>(x)  y = Transpose<perm=[1,0]>(t)  z = Transpose(y) }
        expect: {fires: 1}
"""


def test_opt_in_rules_run_only_when_named(tmp_path) -> None:
    path = tmp_path / "opt_in.yaml"
    path.write_text(OPT_IN_RULES)
    default = fusectl.load_rule_set([path], builtin=False)
    assert default == []
    named = fusectl.load_rule_set([path], builtin=False, include=["transpose-pair-*"])
    assert [r.id for r in named] == ["transpose-pair-gone"]
    listed = fusectl.load_rule_set([path], builtin=False, opt_in=True)
    assert [r.id for r in listed] == ["transpose-pair-gone"]
    skipped = fusectl.load_rule_set([path], builtin=False, opt_in=True,
                                    exclude=["transpose-pair-gone"])
    assert skipped == []
    # --opt-in beside --rule adds to the named rules instead of being dropped
    both = fusectl.load_rule_set(include=["conv-bn-fold"], also_opt_in=["ort-skip-rmsnorm"],
                                 target="onnxruntime")
    assert sorted(r.id for r in both) == ["conv-bn-fold", "ort-skip-rmsnorm"]
    # ... and only opt-in rules: a default rule its glob matches stays out beside --rule
    wide = fusectl.load_rule_set(include=["conv-bn-fold"], also_opt_in=["ort-skip-*"],
                                 target="onnxruntime")
    ids = {r.id for r in wide}
    assert "ort-skip-rmsnorm" in ids and "ort-skip-layernorm-bias" not in ids


def test_builtin_opt_in_rules_are_off_by_default() -> None:
    every = fusectl.load_rule_set(target="onnxruntime", opt_in=True)
    default = {r.id for r in fusectl.load_rule_set(target="onnxruntime")}
    opt_in = {r.id for r in every if r.rule.opt_in}
    assert "ort-skip-rmsnorm" in opt_in
    assert not opt_in & default
    assert {r.id for r in every} - opt_in == default


def test_folded_weights_keep_the_model_dtype(tmp_path) -> None:
    """fp16 weights folded with fp32 arithmetic must come back as fp16 initializers."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    arrays = {
        "W": rng.normal(0, 0.3, (4, 3, 3, 3)), "s": rng.uniform(0.5, 1.5, 4),
        "b": rng.normal(0, 0.1, 4), "m": rng.normal(0, 0.1, 4), "v": rng.uniform(0.5, 2, 4),
    }
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "W"], ["c"]),
         helper.make_node("BatchNormalization", ["c", "s", "b", "m", "v"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [1, 4, 6, 6])],
        [numpy_helper.from_array(a.astype(np.float16), n) for n, a in arrays.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    result = fusectl.optimize(ir.from_proto(model), check=False)
    assert result.rewrite.counts() == {"conv-bn-fold": 1}
    dtypes = {v.const_value.dtype for v in result.model.graph.initializers.values()}
    assert dtypes == {ir.DataType.FLOAT16}


def test_folded_string_constant_keeps_the_signature_and_validates(tmp_path):
    """onnxscript's folder makes a string initializer onnx-ir cannot serialize and onnx-ir's
    shape inference then listed it as a graph input (exit 3: signature changed)."""
    import onnx.parser

    from fusectl.api import optimize

    proto = onnx.parser.parse_model('''<ir_version: 8, opset_import: ["" : 17]>
g (float[2] x) => (float[2] y, string[2] s)
<string[2] s0 = {"a", "b"}> { y = Relu(x)  s = Identity(s0) }''')
    result = optimize(ir.serde.deserialize_model(proto), rules=[])
    assert result.passed, result.validation
    assert [v.name for v in result.model.graph.inputs] == ["x"]
    assert [v.name for v in result.model.graph.outputs] == ["y", "s"]


def test_a_capture_never_names_a_value_the_match_removes() -> None:
    """``z = Add(y, y)`` after ``y = MatMul(x, W)``: matmul-add-to-gemm would bind its
    addend to y itself, which the replacement removes while reading it (this crashed with
    an internal error). y has a reader besides the pattern, so no match is tried (the
    engine refuses such a capture too), and the model still validates."""
    import onnx.parser

    model = onnx.parser.parse_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2,3] x) => (float[2,4] z)
        <float[3,4] W = {0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.2}>
        { y = MatMul(x, W)  z = Add(y, y) }""")
    result = fusectl.optimize(ir.from_proto(model))
    assert result.validation is not None and result.validation.passed
    assert "matmul-add-to-gemm" not in result.rewrite.counts()
    assert result.nodes_after == 2
