"""``fusectl optimize --json`` against its schema (fusectl/schemas/optimize.schema.json).

Each situation that changes the document's shape (bisection, intermediates, no validation,
gates, several samples, a float16 model) is run once and its document validated; the schema
must also declare every key the document carries (even where it allows more), and reject
documents that are wrong. The numbers checked along the way are worked out by hand from
samples/cnn.onnx (image[1,3,32,32] -> Conv+BN -> pool -> Conv+Mul+Add -> Conv+BN -> Gemm).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jsonschema
import onnx
import onnx.parser
import pytest

import fusectl
from fusectl.cli import main
from fusectl.rulefile import builtin_rule_paths

SCHEMA = json.loads(
    (Path(fusectl.__file__).parent / "schemas" / "optimize.schema.json").read_text()
)
DATA = Path(__file__).parent / "data"

# The three conv folds of the library, compiled alone: cheap, and what they save is easy
# to add up by hand. The wrong rule is bisection's culprit.
CONV_FOLDS = ("--no-builtin-rules", "--rules", builtin_rule_paths()[0] / "10-conv.yaml",
              "--rule", "conv-bn-fold", "--rule", "conv-mul-fold", "--rule", "conv-add-fold")
WRONG_FOLD = ("--no-builtin-rules", "--rules", DATA / "wrong_bn_fold.yaml")

# Bytes each fold removes (fp32): a BatchNormalization reads x, scale, bias, mean, var and
# writes y; a per-channel Mul/Add reads x and a [32,1,1] constant and writes y.
BN1 = (16 * 32 * 32 + 4 * 16) * 4 + 16 * 32 * 32 * 4  # 131328
BN3 = (32 * 16 * 16 + 4 * 32) * 4 + 32 * 16 * 16 * 4 - 32 * 4  # 65920: conv3 gains a bias
SCALE2 = SHIFT2 = (32 * 16 * 16 + 32) * 4 + 32 * 16 * 16 * 4  # 65664
FOLDS = {("conv-bn-fold", "bn1"): BN1, ("conv-bn-fold", "bn3"): BN3,
         ("conv-mul-fold", "scale2"): SCALE2, ("conv-add-fold", "shift2"): SHIFT2}


def undocumented(value: Any, schema: dict, path: str = "$") -> list[str]:
    """Keys of ``value`` that ``schema`` does not declare, even where it allows extra keys
    (validation statistics may grow, but what is emitted today must be documented)."""
    schema = _resolve(schema)
    if value is None:
        return []
    branches = schema.get("oneOf") or schema.get("anyOf") or ()
    for branch in branches:
        if _resolve(branch).get("type") != "null":
            return undocumented(value, branch, path)
    properties = dict(schema.get("properties", {}))
    for part in schema.get("allOf", ()):
        properties.update(_resolve(part).get("properties", {}))
    extra = schema.get("additionalProperties", True)
    found = []
    if isinstance(value, dict):
        for key, item in value.items():
            if key in properties:
                found += undocumented(item, properties[key], f"{path}.{key}")
            elif isinstance(extra, dict):
                found += undocumented(item, extra, f"{path}.{key}")
            else:
                found.append(f"{path}.{key}")
    elif isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            found += undocumented(item, schema["items"], f"{path}[{i}]")
    return found


def _resolve(schema: dict) -> dict:
    ref = schema.get("$ref")
    return SCHEMA["$defs"][ref.rsplit("/", 1)[1]] if ref else schema


def check(doc: dict) -> dict:
    jsonschema.validate(doc, SCHEMA, cls=jsonschema.Draft202012Validator)
    assert undocumented(doc, SCHEMA) == []
    return doc


def optimize_json(capsys, tmp_path: Path, model: Path, *args: object) -> tuple[int, dict]:
    path = tmp_path / "report.json"
    code = main(["optimize", str(model), "--json", str(path), "-q", *map(str, args)])
    capsys.readouterr()
    return code, check(json.loads(path.read_text()))


@pytest.fixture
def cnn(samples: Path) -> Path:
    return samples / "cnn.onnx"


def test_schema_is_valid_2020_12() -> None:
    jsonschema.Draft202012Validator.check_schema(SCHEMA)


def test_success(capsys, tmp_path: Path, cnn: Path) -> None:
    out = tmp_path / "cnn.opt.onnx"
    code, doc = optimize_json(capsys, tmp_path, cnn, *CONV_FOLDS, "-o", out)
    assert code == 0 and doc["passed"] is True
    assert doc["model"] == str(cnn) and doc["output"] == str(out) and out.exists()
    saved = {(a["rule"], a["created"][0]): a["bytes_saved"] for a in doc["applications"]}
    assert saved == FOLDS
    assert doc["traffic"]["bytes_saved"] == sum(FOLDS.values()) == 328576
    assert doc["nodes"] == {"before": 14, "after": 10}
    assert doc["ops"]["before"]["BatchNormalization"] == 2
    assert "BatchNormalization" not in doc["ops"]["after"]
    conv1 = doc["node_traffic"]["before"][0]  # image, W[16,3,3,3], b[16] in; [1,16,32,32] out
    assert (conv1["name"], conv1["bytes_read"], conv1["bytes_written"]) == (
        "conv1", (3 * 32 * 32 + 16 * 3 * 9 + 16) * 4, 16 * 32 * 32 * 4)
    validation = doc["validation"]
    assert validation["passed"] and validation["input_shapes"] == {"image": [2, 3, 32, 32]}
    (logits,) = validation["outputs"]
    assert logits["shape"] == [2, 10] and sum(logits["error_histogram"].values()) == 20
    assert doc["bisection"] is None and doc["intermediates"] is None and doc["gates"] == []
    assert set(doc["seconds"]) == {"load", "prepare", "rewrite", "measure", "validate"}


def test_bisection_reverts_the_wrong_fold(capsys, tmp_path: Path, cnn: Path) -> None:
    out = tmp_path / "cnn.opt.onnx"
    code, doc = optimize_json(capsys, tmp_path, cnn, *WRONG_FOLD, "-o", out)
    assert code == 1 and doc["passed"] is False
    bisection = doc["bisection"]
    assert bisection["explained"] is True
    assert sorted(a["matched"] for a in bisection["reverted"]) == [["bn1", "conv1"],
                                                                  ["bn3", "conv3"]]
    assert bisection["initial_validation"]["passed"] is False
    # what is written (and described) is the model with both folds reverted
    assert doc["output"] == str(out) and doc["validation"]["passed"] is True
    assert doc["applications"] == [] and doc["nodes"] == {"before": 14, "after": 14}
    assert doc["traffic"]["bytes_saved"] == 0 and "bisect" in doc["seconds"]


def test_check_intermediates(capsys, tmp_path: Path, cnn: Path) -> None:
    code, doc = optimize_json(capsys, tmp_path, cnn, *CONV_FOLDS, "--check-intermediates",
                              "--check-only")
    assert code == 0 and doc["output"] is None
    boundaries = [(b["value"], b["rule"], b["shape"], b["passed"]) for b in doc["intermediates"]]
    assert boundaries == [("bn1", "conv-bn-fold", [2, 16, 32, 32], True),
                          ("shift2", "conv-add-fold", [2, 32, 16, 16], True),
                          ("bn3", "conv-bn-fold", [2, 32, 16, 16], True)]
    assert "intermediates" in doc["seconds"]


def test_check_intermediates_with_drift(capsys, tmp_path: Path, cnn: Path) -> None:
    code, doc = optimize_json(capsys, tmp_path, cnn, *WRONG_FOLD, "--check-intermediates",
                              "--check-only")
    assert code == 1
    first = doc["intermediates"][0]  # the first drift, in topological order
    assert (first["value"], first["matched"], first["passed"]) == ("bn1", ["bn1", "conv1"],
                                                                   False)
    assert first["pct_out_of_tol"] > 0 and doc["bisection"]["reverted"]


def test_no_validate(capsys, tmp_path: Path, cnn: Path) -> None:
    code, doc = optimize_json(capsys, tmp_path, cnn, *CONV_FOLDS, "--no-validate",
                              "--check-only")
    assert code == 0 and doc["passed"] is True
    assert doc["validation"] is None and doc["bisection"] is None
    assert "validate" not in doc["seconds"]
    assert doc["traffic"]["bytes_saved"] == sum(FOLDS.values())


def test_gates_met(capsys, tmp_path: Path, cnn: Path) -> None:
    code, doc = optimize_json(capsys, tmp_path, cnn, *CONV_FOLDS, "--check-only",
                              "--fail-under-saved", "30", "--fail-under-fusions", "4",
                              "--require-rule", "conv-bn-*")
    assert code == 0
    assert [(g["gate"], g["passed"]) for g in doc["gates"]] == [
        ("--fail-under-saved 30", True), ("--fail-under-fusions 4", True),
        ("--require-rule conv-bn-*", True)]
    assert doc["gates"][1]["actual"] == "4"
    assert doc["gates"][2]["actual"] == "2 applications"  # bn1 and bn3


def test_gate_not_met(capsys, tmp_path: Path, cnn: Path) -> None:
    code, doc = optimize_json(capsys, tmp_path, cnn, *CONV_FOLDS, "--check-only",
                              "--fail-under-saved", "40")
    assert code == 1 and doc["passed"] is True  # a gate is policy, not a failed validation
    (gate,) = doc["gates"]
    percent = 100 * sum(FOLDS.values()) / doc["traffic"]["bytes_before"]
    assert gate["passed"] is False and gate["actual"] == f"{percent:.2f}%"
    assert doc["traffic"]["percent_saved"] == pytest.approx(percent, abs=1e-3)


def test_two_samples(capsys, tmp_path: Path, cnn: Path) -> None:
    code, doc = optimize_json(capsys, tmp_path, cnn, *CONV_FOLDS, "--check-only",
                              "--samples", "2")
    assert code == 0
    assert doc["validation"]["samples"] == 2
    assert [(o["name"], o["sample"]) for o in doc["validation"]["outputs"]] == [
        ("logits", 0), ("logits", 1)]


# float16 arithmetic: an fp32 output judged with fp16 tolerances, a non-deterministic output,
# and the float16 range sample as a second input set.
HALF_MODEL = """<ir_version: 8, opset_import: ["" : 17]>
g (float16[1,3,8,8] x) => (float16[1,3,8,8] z, float[1,3,8,8] wide, float[1,3,8,8] noise) {
  square = Mul(x, x)
  z = Relu(square)
  wide = Cast<to=1>(z)
  noise = RandomNormalLike<dtype=1>(wide)
}"""


def test_half_precision_range_sample(capsys, tmp_path: Path) -> None:
    model = tmp_path / "half.onnx"
    onnx.save(onnx.parser.parse_model(HALF_MODEL), model)
    code, doc = optimize_json(capsys, tmp_path, model, *WRONG_FOLD, "--check-only")
    assert code == 0
    validation = doc["validation"]
    assert validation["compute_dtype"] == "float16" and validation["samples"] == 2
    assert 4 <= validation["range_scale"] <= 512
    outputs = {(o["name"], o["sample"]): o for o in validation["outputs"]}
    assert [outputs[("z", s)]["range_sample"] for s in (0, 1)] == [False, True]
    assert outputs[("wide", 0)]["tolerance_dtype"] == "float16"
    assert outputs[("z", 0)]["tolerance_dtype"] is None
    assert outputs[("noise", 0)]["nondeterministic"] is True


# ------------------------------------------------------------- the schema can say no


@pytest.fixture(scope="module")
def document(tmp_path_factory: pytest.TempPathFactory) -> dict:
    path = tmp_path_factory.mktemp("doc") / "report.json"
    cnn = Path(__file__).resolve().parent.parent / "samples" / "cnn.onnx"
    args = ["optimize", str(cnn), *map(str, WRONG_FOLD), "--check-intermediates",
            "--check-only", "--fail-under-saved", "1", "--json", str(path), "-q"]
    assert main(args) == 1
    return check(json.loads(path.read_text()))


def broken(doc: dict, edit) -> dict:
    doc = copy.deepcopy(doc)
    edit(doc)
    return doc


@pytest.mark.parametrize("edit", [
    pytest.param(lambda d: d.update(extra=1), id="unknown top-level key"),
    pytest.param(lambda d: d.pop("gates"), id="missing key"),
    pytest.param(lambda d: d.update(passed="yes"), id="passed not a boolean"),
    pytest.param(lambda d: d["traffic"].update(bytes_saved="328576"), id="bytes as a string"),
    pytest.param(lambda d: d.update(schema="fusectl.optimize/2"), id="other version"),
    pytest.param(lambda d: d["rules"].update(reverted=[]), id="unknown key in rules"),
    pytest.param(lambda d: d["validation"]["outputs"][0].update(max_abs="nan"),
                 id="NaN spelled as a string"),
    pytest.param(lambda d: d["bisection"]["reverted"][0].update(matched="bn1"),
                 id="matched not a list"),
    pytest.param(lambda d: d["intermediates"][0].pop("value"), id="boundary without value"),
    pytest.param(lambda d: d["gates"][0].update(passed=None), id="gate verdict null"),
    pytest.param(lambda d: d.update(validation=None), id="bisection without validation"),
])
def test_schema_rejects(document: dict, edit) -> None:
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken(document, edit), SCHEMA,
                            cls=jsonschema.Draft202012Validator)


def test_undeclared_statistic_is_caught(document: dict) -> None:
    """Validation outputs may carry more keys (validate.py grows), but not undocumented ones."""
    doc = broken(document, lambda d: d["validation"]["outputs"][0].update(median_abs=0.0))
    jsonschema.validate(doc, SCHEMA)
    assert undocumented(doc, SCHEMA) == ["$.validation.outputs[0].median_abs"]
