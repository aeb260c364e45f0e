"""CI gates of ``fusectl optimize`` (exit codes and messages), --check-only, the
pre-commit hook and the GitHub Actions example.

The traffic of samples/cnn.onnx is worked out by hand below (fp32, batch 1; shapes from
samples/build_samples.py), so the gate thresholds sit on either side of a known number.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fusectl.cli import main
from fusectl.precommit import main as precommit_main
from fusectl.precommit import split_arguments

ROOT = Path(__file__).parent.parent
SAMPLES = ROOT / "samples"
DATA = Path(__file__).parent / "data"
F32 = 4

# Every node reads its inputs (weights included) and writes its outputs once.
BEFORE = F32 * sum([
    3 * 32 * 32 + 16 * 3 * 3 * 3 + 16 + 16 * 32 * 32,     # conv1
    16 * 32 * 32 + 4 * 16 + 16 * 32 * 32,                 # bn1
    2 * 16 * 32 * 32,                                     # relu1
    16 * 32 * 32 + 16 * 16 * 16,                          # pool1
    16 * 16 * 16 + 32 * 16 * 3 * 3 + 32 + 32 * 16 * 16,   # conv2
    2 * (32 * 16 * 16 + 32 + 32 * 16 * 16),               # scale2 (Mul), shift2 (Add)
    2 * 32 * 16 * 16,                                     # relu2
    32 * 16 * 16 + 32 * 32 * 3 * 3 + 32 * 16 * 16,        # conv3
    32 * 16 * 16 + 4 * 32 + 32 * 16 * 16,                 # bn3
    2 * 32 * 16 * 16,                                     # relu3
    32 * 16 * 16 + 32,                                    # gap; flatten moves nothing
    32 + 10 * 32 + 10 + 10,                               # fc
])
# Folding removes BN/Mul/Add passes entirely; conv3 gains a 32-float bias read.
SAVED = F32 * ((16 * 32 * 32 + 4 * 16 + 16 * 32 * 32)
               + 2 * (32 * 16 * 16 + 32 + 32 * 16 * 16)
               + (32 * 16 * 16 + 4 * 32 + 32 * 16 * 16) - 32)
PCT = 100 * SAVED / BEFORE  # 34.34%
FUSIONS = 4  # conv-bn-fold twice, conv-mul-fold, conv-add-fold


@pytest.fixture
def cnn(tmp_path: Path) -> Path:
    target = tmp_path / "cnn.onnx"
    shutil.copy(SAMPLES / "cnn.onnx", target)
    return target


def run(capsys, *args: object) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def test_gates_met_exit_0_check_only_writes_nothing(capsys, cnn: Path, tmp_path: Path):
    report = tmp_path / "r.json"
    before = sorted(p.name for p in tmp_path.iterdir())
    code, out, err = run(capsys, "optimize", cnn, "--check-only", "--json", report,
                         "--fail-under-saved", "34", "--fail-under-fusions", FUSIONS,
                         "--require-rule", "conv-*-fold")
    assert (code, err) == (0, "")
    assert out.count("gate met") == 3
    doc = json.loads(report.read_text())
    assert (doc["traffic"]["bytes_before"], doc["traffic"]["bytes_saved"]) == (BEFORE, SAVED)
    assert [g["passed"] for g in doc["gates"]] == [True, True, True]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*before, "r.json"])


def test_gates_not_met_exit_1_each_says_by_how_much(capsys, cnn: Path, tmp_path: Path):
    out_path, report = tmp_path / "o.onnx", tmp_path / "r.json"
    code, out, err = run(capsys, "optimize", cnn, "-o", out_path, "--json", report,
                         "--fail-under-saved", "35", "--fail-under-fusions", FUSIONS + 1,
                         "--require-rule", "matmul-add-to-gemm", "--require-rule", "conv-bn-*")
    assert code == 1
    assert err == (
        "check failed: "
        f"--fail-under-saved 35: {PCT:.2f}% of memory traffic saved, {35 - PCT:.2f} points "
        f"short; --fail-under-fusions {FUSIONS + 1}: {FUSIONS} rule applications, 1 short; "
        "--require-rule matmul-add-to-gemm: no matching rule fired on this model\n")
    assert out.count("gate NOT MET") == 3 and out.count("gate met") == 1
    assert out_path.exists(), "a gate is policy: the verified model is still written"
    gates = json.loads(report.read_text())["gates"]
    assert [(g["gate"], g["passed"], g["actual"]) for g in gates] == [
        ("--fail-under-saved 35", False, f"{PCT:.2f}%"),
        (f"--fail-under-fusions {FUSIONS + 1}", False, str(FUSIONS)),
        ("--require-rule matmul-add-to-gemm", False, "0 applications"),
        ("--require-rule conv-bn-*", True, "2 applications")]


@pytest.mark.parametrize(("args", "needle"), [
    (["--fail-under-saved", "101"], "--fail-under-saved"),
    (["--fail-under-saved", "x"], "--fail-under-saved"),
    (["--fail-under-fusions", "-1"], "--fail-under-fusions"),
    (["--require-rule", "no-such-rule-*"], "'no-such-rule-*' matches no rule"),
    (["--check-only", "-o", "x.onnx"], "--check-only writes no model"),
    (["--check-only", "--in-place"], "--check-only writes no model"),
])
def test_bad_gate_usage_exits_2(capsys, cnn: Path, args, needle):
    code, _, err = run(capsys, "optimize", cnn, *args)
    assert code == 2 and needle in err and err.count("\n") == 1


def test_mismatch_and_gate_both_named(capsys, cnn: Path):
    code, _, err = run(capsys, "optimize", cnn, "--check-only", "--no-builtin-rules",
                       "--rules", DATA / "wrong_bn_fold.yaml", "--fail-under-fusions", "5")
    assert code == 1
    # both wrong folds are reverted, so no application is left to count
    assert "changed outputs and were reverted" in err
    assert "--fail-under-fusions 5: 0 rule applications, 5 short" in err


# -------------------------------------------------------------------- pre-commit


def test_precommit_hook_definition_runs_on_several_models(capsys, tmp_path: Path, cnn: Path):
    hooks = yaml.safe_load((ROOT / ".pre-commit-hooks.yaml").read_text())
    hook = next(h for h in hooks if h["id"] == "fusectl-optimize")
    assert hook["language"] == "python" and hook["files"] == r"\.onnx$"
    entry = shlex.split(hook["entry"])
    assert entry[:3] == ["python", "-m", "fusectl.precommit"]
    second = tmp_path / "second.onnx"
    shutil.copy(SAMPLES / "mlp.onnx", second)
    before = sorted(p.name for p in tmp_path.iterdir())
    # as pre-commit runs it: entry, the hook's args, then a batch of file names
    done = subprocess.run([sys.executable, *entry[1:], "--fail-under-fusions", "1", "-q",
                           str(cnn)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before, "the hook must write nothing"
    code = precommit_main(["--fail-under-saved", "90", "-q", str(cnn), str(second)])
    err = capsys.readouterr().err
    assert code == 1
    assert f"fusectl: {cnn}: exit code 1" in err and f"fusectl: {second}: exit code 1" in err


def test_precommit_argument_split():
    assert split_arguments(["--rules", "r.yaml", "-q", "a.onnx", "b/C.ONNX"]) == (
        ["--rules", "r.yaml", "-q"], ["a.onnx", "b/C.ONNX"])
    assert split_arguments(["--fail-under-saved", "5"]) == (["--fail-under-saved", "5"], [])


# ---------------------------------------------------------------- GitHub Actions


def test_github_action_example_is_in_readme_and_its_steps_run(
        capsys, tmp_path: Path, monkeypatch):
    text = (SAMPLES / "github-action.yml").read_text()
    assert text in (ROOT / "README.md").read_text(), "README must show the sample verbatim"
    steps = yaml.safe_load(text)["jobs"]["optimize"]["steps"]
    commands = [s["run"] for s in steps if "run" in s and s["run"].startswith("fusectl ")]
    assert len(commands) == 1
    (tmp_path / "samples").mkdir()
    shutil.copy(SAMPLES / "cnn.onnx", tmp_path / "samples" / "cnn.onnx")
    monkeypatch.chdir(tmp_path)
    argv = shlex.split(commands[0])
    code = main(argv[1:])
    capsys.readouterr()
    assert code == 0
    for name in ("fusectl.json", "fusectl.md", "fusectl.xml", "fusectl.html", "cnn.opt.onnx"):
        assert (tmp_path / name).stat().st_size > 0, name
    summary_step = next(s["run"] for s in steps if "GITHUB_STEP_SUMMARY" in s.get("run", ""))
    summary = tmp_path / "summary.md"
    subprocess.run(["bash", "-c", summary_step], check=True, cwd=tmp_path,
                   env={"GITHUB_STEP_SUMMARY": str(summary), "PATH": "/usr/bin:/bin"})
    assert summary.read_text().startswith("## fusectl optimize `samples/cnn.onnx`")
