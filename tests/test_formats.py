"""Markdown, JUnit and HTML reports from real optimize runs on samples/cnn.onnx.

The numbers checked are worked out by hand from the sample's shapes (see
samples/build_samples.py: image 1x3x32x32 fp32, conv1 16x3x3x3 with bias, pool to 16x16,
conv2 32x16x3x3 with bias, per-channel Mul/Add, conv3 32x32x3x3 without bias), not
copied from the code's output.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from pathlib import Path

import onnx
import pytest

import fusectl
from fusectl import formats
from fusectl.cli import main
from fusectl.formats import html as html_format
from fusectl.formats import junit, markdown
from fusectl.formats.regions import layers
from fusectl.report import optimize_json

DATA = Path(__file__).parent / "data"
SAMPLES = Path(__file__).parent.parent / "samples"
F32 = 4
KIB = 1024

# conv1 + bn1 -> one Conv. Conv reads image, W, B and writes 16x32x32; BN reads that and its
# four 16-vectors and writes 16x32x32 again; the folded Conv reads image, W2, B2.
CONV1 = F32 * (3 * 32 * 32 + 16 * 3 * 3 * 3 + 16 + 16 * 32 * 32)
BN1 = F32 * (16 * 32 * 32 + 4 * 16 + 16 * 32 * 32)
# conv2 -> Mul -> Add (per-channel 32x1x1 constants) -> one Conv, on 16x16 maps.
CONV2 = F32 * (16 * 16 * 16 + 32 * 16 * 3 * 3 + 32 + 32 * 16 * 16)
MUL2 = ADD2 = F32 * (32 * 16 * 16 + 32 + 32 * 16 * 16)
# conv3 (no bias) + bn3 -> a Conv that now has a bias.
CONV3 = F32 * (32 * 16 * 16 + 32 * 32 * 3 * 3 + 32 * 16 * 16)
BN3 = F32 * (32 * 16 * 16 + 4 * 32 + 32 * 16 * 16)
CONV3_FOLDED = CONV3 + F32 * 32
HOSTILE = "<script>alert(1)</script>"


@pytest.fixture(scope="module")
def cnn_doc() -> dict:
    return optimize_json(fusectl.optimize(SAMPLES / "cnn.onnx"), output="cnn.opt.onnx")


@pytest.fixture(scope="module")
def hostile_doc(tmp_path_factory) -> dict:
    """cnn.onnx with hostile names on a node every report shows (relu1, untouched and
    the top node by traffic) and on a node that gets fused (conv1)."""
    model = onnx.load(str(SAMPLES / "cnn.onnx"))
    names = {"relu1": HOSTILE + "|x\n*y*\x01", "conv1": 'c"<b>&amp;'}
    for node in model.graph.node:
        node.name = names.get(node.name, node.name)
    path = tmp_path_factory.mktemp("hostile") / "hostile.onnx"
    onnx.save(model, path)
    return optimize_json(fusectl.optimize(path), output=None)


# ------------------------------------------------------------------------ regions


def test_layers_group_each_fused_region_with_hand_computed_bytes(cnn_doc):
    by_rules = {tuple(layer.rules): layer for layer in layers(cnn_doc) if layer.fused}
    assert len(layers(cnn_doc)) == 10  # 14 nodes, 3 regions of 2, 3 and 2 nodes
    bn = [layer for layer in layers(cnn_doc) if layer.rules == ["conv-bn-fold"]]
    assert [[n["name"] for n in layer.before] for layer in bn] == [["conv1", "bn1"],
                                                                  ["conv3", "bn3"]]
    assert bn[0].bytes_before == CONV1 + BN1
    assert bn[0].bytes_after == CONV1  # same reads and writes as the unfused Conv
    assert bn[1].bytes_before == CONV3 + BN3 and bn[1].bytes_after == CONV3_FOLDED
    affine = by_rules[("conv-mul-fold", "conv-add-fold")]
    assert [n["name"] for n in affine.before] == ["conv2", "scale2", "shift2"]
    assert [n["op"] for n in affine.after] == ["Conv"]
    assert affine.bytes_before == CONV2 + MUL2 + ADD2 and affine.bytes_after == CONV2
    relu1 = next(layer for layer in layers(cnn_doc) if layer.label == "relu1")
    assert not relu1.fused and relu1.bytes_before == relu1.bytes_after == 2 * F32 * 16 * 32 * 32


def test_optimize_json_lists_node_traffic_in_graph_order(cnn_doc):
    before = cnn_doc["node_traffic"]["before"]
    after = cnn_doc["node_traffic"]["after"]
    assert [n["name"] for n in before][:3] == ["conv1", "bn1", "relu1"]
    assert len(before) == 14 and len(after) == 10
    assert before[0]["bytes_read"] + before[0]["bytes_written"] == CONV1
    assert sum(n["bytes_read"] + n["bytes_written"] for n in before) == \
        cnn_doc["traffic"]["bytes_before"]
    assert cnn_doc["gates"] == []


# ----------------------------------------------------------------------- markdown


def test_markdown_headline_rules_validation_and_top_nodes(cnn_doc):
    text = markdown.render(cnn_doc)
    saved = CONV1 + BN1 - CONV1 + (MUL2 + ADD2) + (CONV3 + BN3 - CONV3_FOLDED)
    before = cnn_doc["traffic"]["bytes_before"]
    assert cnn_doc["traffic"]["bytes_saved"] == saved
    assert f"saved ({100 * saved / before:.1f}%)" in text
    assert "kernels 14 → 10" in text and "✅ outputs match" in text
    bn_saved = (BN1) + (CONV3 + BN3 - CONV3_FOLDED)
    assert f"| `conv-bn-fold` | 2 | {bn_saved / KIB:.1f} KiB |" in text
    assert f"| `conv-mul-fold` | 1 | {MUL2 / KIB:.1f} KiB |" in text
    assert re.search(r"\| `logits` \| float32 \| \\\[2, 10\\\] \|.*\| ✅ ok \|", text)
    # top node after: relu1 reads and writes 16x32x32 fp32 = 64 KiB each way
    top = text.split("### Top 10 nodes by traffic (after)")[1]
    assert top.splitlines()[4] == "| `relu1` | Relu | 64.0 KiB | 64.0 KiB |"


def _cells(line: str) -> int:
    """Number of cells of a Markdown table row (escaped pipes do not split)."""
    return len(re.split(r"(?<!\\)\|", line.strip())) - 2


def test_markdown_escapes_hostile_names(hostile_doc):
    text = markdown.render(hostile_doc)
    top = text.split("### Top")[1].splitlines()
    assert all(_cells(line) == 4 for line in top if line.startswith("|"))
    row = next(line for line in text.splitlines() if "alert" in line)
    assert row.startswith("| `<script>alert(1)</script>\\|x *y*\x01` | Relu |"), row
    assert _cells(row) == 4
    outside_code = re.sub(r"`[^`]*`", "", text)
    assert "<script" not in outside_code and "<b>" not in outside_code


def test_markdown_escape_and_code_helpers():
    assert markdown.escape("a|b\n[x](y) <i> *_~`") == r"a\|b \[x\](y) &lt;i&gt; \*\_\~\`"
    assert markdown.code("a`b") == "``a`b``"
    assert markdown.code("`x") == "`` `x ``"


# -------------------------------------------------------------------------- junit


def _junit(text: str) -> ET.Element:
    return ET.fromstring(text.encode())


def test_junit_one_passing_case_per_output(cnn_doc):
    root = _junit(junit.render(cnn_doc))
    suite = root.find("testsuite")
    cases = suite.findall("testcase")
    assert [(c.get("classname"), c.get("name")) for c in cases] == [
        ("fusectl.validation", "logits")]
    assert (root.get("tests"), root.get("failures"), root.get("errors")) == ("1", "0", "0")
    assert suite.find("testcase/failure") is None
    props = {p.get("name"): p.get("value") for p in suite.iter("property")}
    assert props["rule_applications"] == "4"  # 2 BN folds, the Mul fold, the Add fold


def test_junit_failure_carries_statistics_of_a_real_mismatch():
    rules = fusectl.load_rule_set([DATA / "wrong_bn_fold.yaml"], builtin=False)
    result = fusectl.optimize(SAMPLES / "cnn.onnx", rules=rules, bisect=False,
                              validation=fusectl.ValidationOptions(samples=2))
    root = _junit(junit.render(optimize_json(result)))
    cases = root.findall("testsuite/testcase")
    assert [c.get("name") for c in cases] == ["logits [sample 0]", "logits [sample 1]"]
    failure = cases[0].find("failure")
    assert failure is not None and cases[1].find("failure") is not None
    assert "max abs" in failure.get("message") and "cosine" in failure.text
    assert (root.get("tests"), root.get("failures")) == ("2", "2")


def test_junit_reverted_applications_and_gates_are_cases(tmp_path, capsys):
    report = tmp_path / "r.xml"
    code = main(["optimize", str(SAMPLES / "cnn.onnx"), "--no-builtin-rules", "--rules",
                 str(DATA / "wrong_bn_fold.yaml"), "--check-only", "--junit", str(report),
                 "--fail-under-fusions", "0", "-q"])
    capsys.readouterr()
    assert code == 1
    root = _junit(report.read_text())
    cases = root.findall("testsuite/testcase")
    assert [(c.get("classname"), c.get("name")) for c in cases] == [
        ("fusectl.validation", "logits"),  # the kept model: every wrong fold reverted
        ("fusectl.revert", "wrong-conv-bn-fold on bn1, conv1"),
        ("fusectl.revert", "wrong-conv-bn-fold on bn3, conv3"),
        ("fusectl.gate", "--fail-under-fusions 0")]
    assert [c.find("failure") is not None for c in cases] == [False, True, True, False]
    assert "out of tolerance" in cases[1].find("failure").text
    assert (root.get("tests"), root.get("failures")) == ("4", "2")


def test_junit_rule_tests_one_case_per_test(tmp_path, capsys):
    report = tmp_path / "rules.xml"
    code = main(["rules", "test", str(DATA / "wrong_bn_fold.yaml"), "--junit", str(report)])
    capsys.readouterr()
    assert code == 1
    root = _junit(report.read_text())
    cases = root.findall("testsuite/testcase")
    assert [(c.get("classname"), c.get("name")) for c in cases] == [
        ("wrong-conv-bn-fold", "fires"), ("wrong-conv-bn-fold", "silent")]
    assert cases[0].find("failure") is not None and cases[1].find("failure") is None
    assert cases[0].get("file").endswith("wrong_bn_fold.yaml") and cases[0].get("line").isdigit()
    assert (root.get("tests"), root.get("failures")) == ("2", "1")


def test_junit_hostile_names_parse(hostile_doc):
    doc = dict(hostile_doc, model=HOSTILE + "\x00\x1b")
    root = _junit(junit.render(doc))  # control characters would make this raise
    assert root.find("testsuite").get("name") == "fusectl optimize " + HOSTILE + "\\x00\\x1b"


def test_junit_without_validation_is_one_skipped_case(cnn_doc):
    root = _junit(junit.render(dict(cnn_doc, validation=None)))
    assert (root.get("tests"), root.get("skipped"), root.get("failures")) == ("1", "1", "0")


# --------------------------------------------------------------------------- html


def test_html_is_self_contained_with_chart_and_tables(cnn_doc):
    page = html_format.render(cnn_doc)
    assert page.startswith("<!DOCTYPE html>")
    assert not re.search(r"(src|href)\s*=\s*[\"']?(https?:)?//", page), "no external fetch"
    assert "default-src 'none'" in page
    assert page.count('<g class="slot"') == 10
    colours = html_format.rule_colours(cnn_doc)
    assert page.count(f'fill="{colours["conv-bn-fold"]}" fill-opacity') == 2  # 2 BN regions
    assert f"{(CONV1 + BN1) / KIB:.1f} KiB" in page  # region before, in the regions table
    assert f"{CONV1 / KIB:.1f} KiB" in page
    assert "Fused regions (3)" in page
    assert page.count("<script") == 2


def test_html_escapes_every_hostile_string(hostile_doc):
    page = html_format.render(dict(hostile_doc, model=HOSTILE))
    assert HOSTILE not in page
    assert page.count("<script") == 2  # the JSON data and the page's own script
    assert "<b>" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    blob = page.split('id="fusectl-layers">')[1].split("</script>")[0]
    assert "<" not in blob and ">" not in blob and "\\u003cscript\\u003e" in blob


def test_html_bins_big_graphs(cnn_doc):
    many = [dict(n, name=f"n{i}") for i, n in enumerate(cnn_doc["node_traffic"]["before"] * 50)]
    doc = dict(cnn_doc, applications=[], node_traffic={"before": many, "after": many})
    page = html_format.render(doc)
    # 700 layers, at most 300 slots: bins of 3 layers, 234 slots (the last holds 1)
    assert html_format.MAX_SLOTS == 300
    assert page.count('<g class="slot"') == 234
    assert "Each bar is a bin of about 3 consecutive layers" in page


# ------------------------------------------------------------------ write and cli


def test_write_is_atomic_and_cli_writes_every_format(tmp_path, capsys):
    paths = {kind: tmp_path / f"r.{kind}" for kind in ("json", "markdown", "junit", "html")}
    code = main(["optimize", str(SAMPLES / "cnn.onnx"), "--check-only", "-q",
                 *[arg for kind, path in paths.items() for arg in (f"--{kind}", str(path))]])
    capsys.readouterr()
    assert code == 0
    assert all(p.stat().st_size > 200 for p in paths.values())
    assert not list(tmp_path.glob(".*.tmp")), "temp files left behind"
    assert not (SAMPLES / "cnn.opt.onnx").exists()


@pytest.mark.parametrize("option", ["--markdown", "--junit", "--html", "--json"])
def test_bad_report_path_exits_2_before_any_work(tmp_path, capsys, option):
    out = tmp_path / "o.onnx"
    code = main(["optimize", str(SAMPLES / "cnn.onnx"), "-o", str(out),
                 option, str(tmp_path / "missing" / "r.txt")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and option in err
    assert not out.exists()


def test_report_path_may_not_overwrite_the_model(tmp_path, capsys):
    model = tmp_path / "m.onnx"
    model.write_bytes((SAMPLES / "cnn.onnx").read_bytes())
    code = main(["optimize", str(model), "--html", str(model)])
    assert code == 2 and "would overwrite" in capsys.readouterr().err
    assert model.read_bytes() == (SAMPLES / "cnn.onnx").read_bytes()


def test_unknown_schema_is_refused():
    with pytest.raises(formats.UnsupportedDocument):
        formats.render({"schema": "something/1"}, "html")
    with pytest.raises(formats.UnsupportedDocument):
        formats.render({"schema": "fusectl.optimize/2"}, "markdown")


# ------------------------------------------------------- report and diff documents


def test_report_markdown_and_html_of_the_dry_run(tmp_path, capsys):
    md, page = tmp_path / "r.md", tmp_path / "r.html"
    code = main(["report", str(SAMPLES / "cnn.onnx"), "--markdown", str(md), "--html",
                 str(page), "-q"])
    assert code == 0, capsys.readouterr().err
    text = md.read_text()
    saved = BN1 + (MUL2 + ADD2) + (CONV3 + BN3 - CONV3_FOLDED)
    assert f"the rules would save {saved / KIB:.1f} KiB" in text
    assert f"| `conv-bn-fold` | 2 | {(BN1 + CONV3 + BN3 - CONV3_FOLDED) / KIB:.1f} KiB | 2 |" \
        in text
    html_text = page.read_text()
    assert html_text.count('<g class="slot"') == 10  # the same 10 layers as optimize
    assert "Rules that would fire (dry run)" in html_text and html_text.count("<script") == 2


def test_diff_reports_of_a_perturbed_weight(tmp_path, capsys):
    model = onnx.load(str(SAMPLES / "cnn.onnx"))
    bias = next(t for t in model.graph.initializer if t.name == "fc.bias")
    values = onnx.numpy_helper.to_array(bias).copy()
    values[3] += 1.0  # logits[:, 3] moves by exactly 1
    bias.CopyFrom(onnx.numpy_helper.from_array(values, "fc.bias"))
    perturbed = tmp_path / "perturbed.onnx"
    onnx.save(model, perturbed)
    xml, md, page = tmp_path / "d.xml", tmp_path / "d.md", tmp_path / "d.html"
    code = main(["diff", str(SAMPLES / "cnn.onnx"), str(perturbed), "--junit", str(xml),
                 "--markdown", str(md), "--html", str(page), "-q"])
    capsys.readouterr()
    assert code == 1
    root = _junit(xml.read_text())
    cases = root.findall("testsuite/testcase")
    assert [c.get("name") for c in cases] == ["IO signature", "logits"]
    assert cases[0].find("failure") is None and cases[1].find("failure") is not None
    assert "max abs 1," in cases[1].find("failure").get("message")
    text = md.read_text()
    assert "❌ **outputs differ**" in text and "1 changed, 0 added, 0 removed." in text
    html_text = page.read_text()
    assert html_text.count('<g class="slot"') == 9  # op types of cnn.onnx, none changed
    assert 'fill-opacity' not in html_text  # no op count changed: no band
