"""The ``fusectl`` command: a thin click shell over the API.

Exit codes (every command): 0 success; 1 a check failed (outputs differ, a
rule test failed); 2 bad usage or bad input (one clear line, no traceback);
3 internal error (message plus a request to report it).
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import click
from rich.console import Console
from rich.text import Text

from . import __version__
from .errors import BadInputError, CheckFailedError, FusectlError, RuleFileError
from .gcpolicy import fewer_collections

if TYPE_CHECKING:
    from .validate import ValidationOptions

_stdout = Console(highlight=False)
_stderr = Console(stderr=True, highlight=False)


def _error(message: str) -> None:
    """One message to stderr, never wrapped (a wrapped line is several lines to a CI log)."""
    _stderr.print(message, markup=False, highlight=False, soft_wrap=True)


def _parse_dims(values: Sequence[str]) -> dict[str, int]:
    dims = {}
    for item in values:
        name, sep, number = item.partition("=")
        if not sep or not name or not number.strip().lstrip("-").isdigit() or int(number) < 1:
            raise BadInputError(f"--dim {item!r}: expected NAME=VALUE with a positive integer")
        dims[name.strip()] = int(number)
    return dims


def _parse_shapes(values: Sequence[str]) -> dict[str, tuple[int, ...]]:
    """``NAME=1,512`` (or ``1x512``): a generated input's whole shape."""
    shapes = {}
    for item in values:
        name, sep, text = item.partition("=")
        sizes = [s.strip() for s in text.replace("x", ",").split(",")]
        if not sep or not name or not all(s.isascii() and s.isdigit() for s in sizes):
            raise BadInputError(f"--input-shape {item!r}: expected NAME=D0,D1,... with "
                                "non-negative integers")
        if name in shapes:
            raise BadInputError(f"--input-shape: input {name!r} is given twice")
        shapes[name] = tuple(int(s) for s in sizes)
    return shapes


def _parse_ranges(values: Sequence[str]) -> dict[str, tuple[float, float]]:
    ranges = {}
    for item in values:
        name, sep, span = item.partition("=")
        lo, colon, hi = span.partition(":")
        try:
            bounds = (float(lo), float(hi))
        except ValueError:
            bounds = None
        if not sep or not colon or bounds is None or bounds[0] >= bounds[1]:
            raise BadInputError(f"--input-range {item!r}: expected NAME=LO:HI with LO < HI")
        ranges[name] = bounds
    return ranges


def default_output(model: Path) -> Path:
    """``model.onnx`` -> ``model.opt.onnx`` beside it."""
    stem = model.name[:-5] if model.name.endswith(".onnx") else model.name
    return model.with_name(stem + ".opt.onnx")


@contextlib.contextmanager
def _status(quiet: bool) -> Iterator[object]:
    """A spinner naming the current stage, on a terminal only."""
    if quiet or not _stderr.is_terminal:
        yield lambda _message: None
        return
    with _stderr.status("starting") as status:
        yield lambda message: status.update(message)


def _with_options(options: list):
    """Apply a shared list of click options to a command."""
    def apply(function):
        for option in reversed(options):
            function = option(function)
        return function
    return apply


_RULE_SELECTION = [
    click.option("--rules", "rule_paths", multiple=True, type=click.Path(path_type=Path),
                 help="Rule file or folder, added to the built-in library (repeatable)."),
    click.option("--no-builtin-rules", is_flag=True, help="Use only the --rules files."),
    click.option("--rule", "include", multiple=True, metavar="ID",
                 help="Only rules whose id matches this glob (repeatable)."),
    click.option("--skip-rule", "exclude", multiple=True, metavar="ID",
                 help="Skip rules whose id matches this glob (repeatable)."),
    click.option("--opt-in", "also_opt_in", multiple=True, metavar="ID",
                 help="Also run the opt-in rules whose id matches this glob (repeatable)."),
]
"""Which rules run: optimize and report take the same options."""

_INPUT_OPTIONS = [
    click.option("--input", "input_files", multiple=True, metavar="NAME=FILE.npy",
                 help="Validation input from a .npy file (repeatable)."),
    click.option("--inputs", "inputs_npz", type=click.Path(exists=True),
                 metavar="FILE.npz|DIR",
                 help="Validation inputs from an .npz file or a folder of input_<N>.pb "
                      "TensorProtos (onnx test_data_set layout)."),
    click.option("--input-shape", "input_shapes", multiple=True, metavar="NAME=D0,D1,...",
                 help="Shape of a generated input, anonymous dims included (repeatable)."),
    click.option("--input-range", "input_ranges", multiple=True, metavar="NAME=LO:HI",
                 help="Range for a generated input."),
    click.option("--seed", default=0, show_default=True, help="Seed of generated inputs."),
    click.option("--samples", default=1, show_default=True, type=click.IntRange(1, 1000),
                 help="Number of input sets to compare on."),
    click.option("--atol", type=click.FloatRange(0), help="Absolute tolerance (all outputs)."),
    click.option("--rtol", type=click.FloatRange(0), help="Relative tolerance (all outputs)."),
]
"""The inputs and tolerances of a comparison on onnxruntime: optimize and diff."""


def _validation_options(input_files: tuple[str, ...], inputs_npz: str | None,
                        dims: dict[str, int], seed: int, samples: int,
                        ranges: dict, rtol: float | None, atol: float | None,
                        input_shapes: Sequence[str] = ()) -> ValidationOptions:
    """The comparison settings from the command line (fusectl.validate is imported late:
    it loads onnxruntime)."""
    from .validate import ValidationOptions, load_input_files

    given = load_input_files(input_files, inputs_npz) if (input_files or inputs_npz) else None
    return ValidationOptions(inputs=given, dims=dims, shapes=_parse_shapes(input_shapes),
                             seed=seed, samples=samples, input_ranges=ranges, rtol=rtol,
                             atol=atol)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="fusectl")
def cli() -> None:
    """Declarative ONNX fusion rules, verified on onnxruntime, with the memory traffic saved."""


@cli.command()
@click.argument("model", type=click.Path(dir_okay=False, path_type=Path))
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path),
              help="Where to write the optimized model [default: MODEL.opt.onnx].")
@_with_options(_RULE_SELECTION)
@click.option("--target", default="onnx", show_default=True, metavar="onnx|onnxruntime|FILE",
              help="onnx: standard ops only; onnxruntime: may emit its contrib ops; "
                   "FILE.yaml: a target file whose rules emit its fused kernels.")
@click.option("--opset", type=click.IntRange(1, 99), help="Upgrade the model to this opset first.")
@click.option("--dim", "dims", multiple=True, metavar="NAME=VALUE",
              help="Bind a symbolic dimension (traffic model and generated inputs).")
@_with_options(_INPUT_OPTIONS)
@click.option("--no-validate", is_flag=True, help="Do not run the models on onnxruntime.")
@click.option("--force", is_flag=True, help="Write the model even if validation fails.")
@click.option("--allow-revert", is_flag=True,
              help="Exit 0 (with a warning) when the rule applications that changed outputs "
                   "were found and reverted.")
@click.option("--check-intermediates", is_flag=True,
              help="Also compare the values at every rewrite boundary, to localise drift.")
@click.option("--no-fold", is_flag=True, help="Do not fold constant subgraphs first.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False),
              help="Write the report as JSON (schema fusectl.optimize/1).")
@click.option("--markdown", "markdown_path", type=click.Path(dir_okay=False),
              help="Write a Markdown summary (pull-request comment, $GITHUB_STEP_SUMMARY).")
@click.option("--junit", "junit_path", type=click.Path(dir_okay=False),
              help="Write JUnit XML: a test case per output compared and per gate.")
@click.option("--html", "html_path", type=click.Path(dir_okay=False),
              help="Write a self-contained HTML page: traffic per layer, fused regions.")
@click.option("--fail-under-saved", type=click.FloatRange(0, 100), metavar="PCT",
              help="Exit 1 when less than PCT % of the memory traffic is saved.")
@click.option("--fail-under-fusions", type=click.IntRange(0), metavar="N",
              help="Exit 1 when fewer than N rule applications happen.")
@click.option("--require-rule", "required_rules", multiple=True, metavar="ID",
              help="Exit 1 unless a rule matching this glob fires (repeatable).")
@click.option("--check-only", is_flag=True,
              help="Run, validate, report and apply the gates, but write no model.")
@click.option("--in-place", is_flag=True, help="Replace MODEL (atomically).")
@click.option("--backup", is_flag=True,
              help="With --in-place: keep the original as MODEL.bak (and DATA.bak for its "
                   "external data).")
@click.option("-q", "--quiet", is_flag=True, help="Print nothing but errors.")
@click.option("-v", "--verbose", is_flag=True, help="Also list skipped rules, refused "
              "matches and the top nodes by traffic.")
def optimize(model: Path, output: Path | None, rule_paths: tuple[Path, ...],
             no_builtin_rules: bool, include: tuple[str, ...], exclude: tuple[str, ...],
             also_opt_in: tuple[str, ...],
             target: str, opset: int | None, dims: tuple[str, ...],
             input_files: tuple[str, ...], inputs_npz: str | None,
             input_shapes: tuple[str, ...], input_ranges: tuple[str, ...], seed: int,
             samples: int, atol: float | None,
             rtol: float | None, no_validate: bool, force: bool, allow_revert: bool,
             check_intermediates: bool, no_fold: bool,
             json_path: str | None, markdown_path: str | None, junit_path: str | None,
             html_path: str | None, fail_under_saved: float | None,
             fail_under_fusions: int | None, required_rules: tuple[str, ...],
             check_only: bool, in_place: bool, backup: bool, quiet: bool,
             verbose: bool) -> None:
    """Apply the rule set to MODEL, validate on onnxruntime, report and save."""
    from . import api, formats, modelio, report
    from .gates import Gates
    from .gates import evaluate as evaluate_gates
    from .targets import resolve_target

    if in_place and output is not None:
        raise BadInputError("--in-place and -o/--output exclude each other")
    if backup and not in_place:
        raise BadInputError("--backup only applies to --in-place")
    if check_only and (in_place or output is not None):
        raise BadInputError("--check-only writes no model; drop -o/--output and --in-place")
    if no_builtin_rules and not rule_paths:
        raise BadInputError("--no-builtin-rules needs at least one --rules PATH")
    bound = _parse_dims(dims)
    ranges = _parse_ranges(input_ranges)
    target_path = model if in_place else (output or default_output(model))
    report_paths = {"json": json_path, "markdown": markdown_path, "junit": junit_path,
                    "html": html_path}
    formats.check_paths(((f"--{kind}", path) for kind, path in report_paths.items()),
                        protected=(model, None if check_only else target_path))
    gates = Gates(fail_under_saved, fail_under_fusions, required_rules)
    active = resolve_target(target)
    rules = api.load_rule_set(rule_paths, builtin=not no_builtin_rules, include=include,
                              exclude=exclude, also_opt_in=also_opt_in,
                              target=active)
    gates.check_rules_exist(r.id for r in rules)
    options = _validation_options(input_files, inputs_npz, bound, seed, samples, ranges,
                                  rtol, atol, input_shapes)
    with report.validation_progress(_stderr, enabled=not quiet and _stderr.is_terminal) as say:
        result = api.optimize(model, rules=rules, target=active, opset=opset, dims=bound,
                              check=not no_validate, validation=options,
                              fold_constants=not no_fold, progress=say,
                              intermediates=check_intermediates)
    write = (result.verified or force) and not check_only
    written = None
    if write:
        protect = None if in_place else model
        if backup:
            modelio.backup_model(model, result.model)
        modelio.save_model(result.model, target_path, overwrite_protect=protect)
        written = str(target_path)
    verdicts = evaluate_gates(gates, result)
    document = report.optimize_json(result, output=written, gates=verdicts)
    for kind, path in report_paths.items():
        if path:
            formats.write(document, path, kind)
    if not quiet:
        report.print_optimize(result, _stdout, verbose=verbose, output=written)
        for verdict in verdicts:
            mark = "[green]met[/green]" if verdict.passed else "[red]NOT MET[/red]"
            _stdout.print(f"gate {mark}: ", Text(verdict.message), sep="", soft_wrap=True)
    problems = [v.message for v in verdicts if not v.passed]
    reverted = result.bisection.reverted if result.bisection and result.verified else ()
    if reverted:
        listed = "; ".join(f"{a.rule_id} on {', '.join(a.matched)}" for a in reverted)
        if allow_revert:
            _error(f"warning: reverted {len(reverted)} rule application(s) that changed "
                   f"outputs: {listed}")
        else:
            kept = f"wrote {written}" if written else "model NOT written"
            problems.insert(0, f"{len(reverted)} rule application(s) changed outputs and were "
                               f"reverted ({listed}); {kept} with every verified fusion "
                               "(--allow-revert accepts this)")
    elif not result.passed:
        hint = "model written anyway (--force)" if written else "optimized model NOT written"
        problems.insert(0, f"optimized model computes different outputs; {hint}")
    if problems:
        raise CheckFailedError("; ".join(problems))


def _report_options(schema: str) -> list:
    """--json/--markdown/--junit/--html for the report and diff commands."""
    return [
        click.option("--json", "json_path", type=click.Path(dir_okay=False),
                     help=f"Write the result as JSON (schema {schema})."),
        click.option("--markdown", "markdown_path", type=click.Path(dir_okay=False),
                     help="Write a Markdown summary (pull-request comment, $GITHUB_STEP_SUMMARY)."),
        click.option("--junit", "junit_path", type=click.Path(dir_okay=False),
                     help="Write JUnit XML (where the format has test cases for it)."),
        click.option("--html", "html_path", type=click.Path(dir_okay=False),
                     help="Write a self-contained HTML page (where available)."),
    ]


def _write_reports(document: dict, paths: dict[str, str | None]) -> None:
    """Render every requested format first (an unsupported one is bad usage and nothing is
    written), then write each file atomically."""
    from . import formats

    wanted = {kind: path for kind, path in paths.items() if path}
    for kind in wanted:
        try:
            formats.render(document, kind)
        except formats.UnsupportedDocument as exc:
            raise BadInputError(f"--{kind}: {exc}") from None
    for kind, path in wanted.items():
        formats.write(document, path, kind)


@cli.command("report", short_help="Traffic, FLOPs and roofline of a model; rules dry run.")
@click.argument("model", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--device", default="cpu", show_default=True, metavar="cpu|a100|h100|FILE",
              help="Device profile for the roofline: a built-in name or a YAML file with "
                   "bandwidth_gb_s and peak_gflop_s.")
@click.option("--conv-algo", type=click.Choice(["direct", "im2col", "indirect"]),
              default="direct", show_default=True,
              help="Convolution algorithm of the traffic model (im2col/indirect add their "
                   "work buffers).")
@_with_options(_RULE_SELECTION)
@click.option("--target", default="onnx", show_default=True, metavar="onnx|onnxruntime|FILE",
              help="Target of the dry run, as for optimize.")
@click.option("--opset", type=click.IntRange(1, 99), help="Upgrade the model to this opset first.")
@click.option("--dim", "dims", multiple=True, metavar="NAME=VALUE",
              help="Bind a symbolic dimension (unbound ones count as 1).")
@click.option("--top", default=10, show_default=True, type=click.IntRange(0),
              help="How many of the heaviest kernels to list.")
@_with_options(_report_options("fusectl.report/1"))
@click.option("-q", "--quiet", is_flag=True, help="Print nothing but errors.")
@click.option("-v", "--verbose", is_flag=True, help="Also list every kernel and skipped rules.")
def report_command(model: Path, device: str, conv_algo: str, rule_paths: tuple[Path, ...],
                   no_builtin_rules: bool, include: tuple[str, ...], exclude: tuple[str, ...],
                   also_opt_in: tuple[str, ...],
                   target: str, opset: int | None, dims: tuple[str, ...], top: int,
                   json_path: str | None, markdown_path: str | None, junit_path: str | None,
                   html_path: str | None, quiet: bool, verbose: bool) -> None:
    """Memory traffic, FLOPs and roofline of MODEL, and what the rules would save (dry run;
    nothing is written but --json)."""
    from . import api, formats
    from .analysis import report_document, report_model
    from .report_views import print_report
    from .roofline import load_device
    from .targets import resolve_target

    if no_builtin_rules and not rule_paths:
        raise BadInputError("--no-builtin-rules needs at least one --rules PATH")
    bound = _parse_dims(dims)
    paths = {"json": json_path, "markdown": markdown_path, "junit": junit_path,
             "html": html_path}
    formats.check_paths(((f"--{kind}", path) for kind, path in paths.items()),
                        protected=(model,))
    profile = load_device(device)
    active = resolve_target(target)
    # compiled once: the selection is a subset of the rule set with the opt-in rules
    # (--skip-rule applies in select_rules, after --rule names a rule, as in optimize)
    every = api.load_rule_set(rule_paths, builtin=not no_builtin_rules, target=active,
                              opt_in=True)
    chosen = {r.id for r in api.select_rules([c.rule for c in every], include, exclude,
                                             also_opt_in=also_opt_in)}
    rules = [r for r in every if r.id in chosen]
    with_opt_in = [] if include else [
        r for r in every if not any(fnmatch.fnmatchcase(r.id, g) for g in exclude)]
    with _status(quiet) as say:
        say("measuring and dry-running the rules")
        result = report_model(model, rules=rules, with_opt_in=with_opt_in, target=active,
                              opset=opset, dims=bound,
                              device=profile, conv_algo=conv_algo, top=top)
    _write_reports(report_document(result), paths)
    if not quiet:
        print_report(result, _stdout, verbose=verbose)


@cli.command("diff", short_help="Compare two models: structure, traffic, outputs.")
@click.argument("model_a", metavar="A", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("model_b", metavar="B", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--structural-only", is_flag=True, help="Compare structure only; run nothing.")
@click.option("--dim", "dims", multiple=True, metavar="NAME=VALUE",
              help="Bind a symbolic dimension (traffic model and generated inputs).")
@_with_options(_INPUT_OPTIONS)
@_with_options(_report_options("fusectl.diff/1"))
@click.option("-q", "--quiet", is_flag=True, help="Print nothing but errors.")
@click.option("-v", "--verbose", is_flag=True, help="List every changed node and initializer.")
def diff_command(model_a: Path, model_b: Path, structural_only: bool, dims: tuple[str, ...],
                 input_files: tuple[str, ...], inputs_npz: str | None,
                 input_shapes: tuple[str, ...], input_ranges: tuple[str, ...], seed: int,
                 samples: int, atol: float | None,
                 rtol: float | None, json_path: str | None, markdown_path: str | None,
                 junit_path: str | None, html_path: str | None, quiet: bool,
                 verbose: bool) -> None:
    """Compare model B with model A: IO signature, opsets, ops, nodes, initializers, traffic,
    and outputs on the same inputs. Exit 1 when the IO signature or the outputs differ."""
    from . import formats
    from .diff import diff_document, diff_models
    from .report_views import print_diff

    bound = _parse_dims(dims)
    ranges = _parse_ranges(input_ranges)
    paths = {"json": json_path, "markdown": markdown_path, "junit": junit_path,
             "html": html_path}
    formats.check_paths(((f"--{kind}", path) for kind, path in paths.items()),
                        protected=(model_a, model_b))
    options = _validation_options(input_files, inputs_npz, bound, seed, samples, ranges,
                                  rtol, atol, input_shapes)
    with _status(quiet) as say:
        result = diff_models(model_a, model_b, structural_only=structural_only,
                             validation=options, dims=bound, progress=say)
    _write_reports(diff_document(result), paths)
    if not quiet:
        print_diff(result, _stdout, verbose=verbose)
    problems = []
    if not result.io_same:
        problems.append("the IO signatures differ")
    if not result.numerics_passed:
        problems.append("the outputs differ beyond tolerance")
    if problems:
        raise CheckFailedError(" and ".join(problems))


@cli.group()
def rules() -> None:
    """Browse, check and test rules."""


def _rule_set(paths: Sequence[Path], builtin: bool) -> list:
    from .api import load_rule_set

    return load_rule_set(paths, builtin=builtin, opt_in=True)


@rules.command("list")
@click.option("--rules", "rule_paths", multiple=True, type=click.Path(path_type=Path))
@click.option("--no-builtin-rules", is_flag=True)
def rules_list(rule_paths: tuple[Path, ...], no_builtin_rules: bool) -> None:
    """List rules: id, opset range, target and summary (opt-in rules say why they are off)."""
    from rich.table import Table

    table = Table()
    for col in ("id", "opset", "target", "tests", "summary"):
        table.add_column(col)
    for rule in _rule_set(rule_paths, not no_builtin_rules):
        opsets = ", ".join(f"{d or 'ai.onnx'} {r.text}" for d, r in rule.rule.when.opsets)
        summary = rule.rule.summary
        if rule.rule.opt_in:
            summary = f"opt-in (--opt-in {rule.id}): {rule.rule.opt_in}. {summary}"
        table.add_row(*(Text(cell) for cell in (
            rule.id, opsets or "any", ", ".join(rule.rule.when.targets),
            str(len(rule.rule.tests)), summary)))
    _stdout.print(table)


@rules.command("show")
@click.argument("rule_id")
@click.option("--rules", "rule_paths", multiple=True, type=click.Path(path_type=Path))
def rules_show(rule_id: str, rule_paths: tuple[Path, ...]) -> None:
    """Show one rule: where it is defined, its pattern, conditions and replacement."""
    for compiled in _rule_set(rule_paths, True):
        rule = compiled.rule
        if rule.id != rule_id:
            continue
        def show(keyword: str, text: str) -> None:
            _stdout.print(Text.assemble((keyword, "bold"), text))

        show(rule.id, f"  ({rule.source})")
        _stdout.print(rule.summary, markup=False)
        if rule.opt_in:
            show("opt-in", f" (runs only when --opt-in or --rule names it): {rule.opt_in}")
        if rule.group is not None:
            show("group", f" shared={rule.group.shared} min={rule.group.min_size} key="
                          f"{[k.source for k in rule.group.key]}")
        show("match", "")
        for line in rule.match_text:
            show("", f"  {line}")
        for cond in rule.where:
            show("where ", cond.expression.source)
        for binding in rule.let:
            show("let ", f"{binding.name} = {binding.expression.source}")
        for binding in rule.merge:
            show("merge ", f"{binding.name} = {binding.expression.source}")
        if rule.fuse is not None:
            show("fuse ", f"{rule.fuse} (fused kernel: one node + a local function)")
        else:
            show("replace", "")
        for line in rule.replace_text:
            show("", f"  {line}")
        _stdout.print(f"{len(compiled.variants)} pattern variants; "
                      f"{len(rule.tests)} embedded tests")
        return
    raise BadInputError(f"no rule with id {rule_id!r} (fusectl rules list shows them)")


@rules.command("lint")
@click.argument("paths", nargs=-1, required=True, type=click.Path(path_type=Path))
def rules_lint(paths: tuple[Path, ...]) -> None:
    """Check rule files: schema, names, expressions, statements, tests present and parsing."""
    from .api import load_rule_set
    from .ruletest import lint_tests

    compiled = load_rule_set(paths, builtin=False, opt_in=True)
    problems = lint_tests(compiled)
    if problems:
        raise RuleFileError([(None, p) for p in problems])
    _stdout.print(f"{len(compiled)} rules OK")


@rules.command("test")
@click.argument("paths", nargs=-1, type=click.Path(path_type=Path))
@click.option("--rule", "include", multiple=True, metavar="ID", help="Only these rules (glob).")
@click.option("--seed", default=0, show_default=True)
@click.option("--junit", "junit_path", type=click.Path(dir_okay=False),
              help="Write JUnit XML: one test case per rule test.")
@click.option("--markdown", "markdown_path", type=click.Path(dir_okay=False),
              help="Write a Markdown summary (failures listed).")
def rules_test(paths: tuple[Path, ...], include: tuple[str, ...], seed: int,
               junit_path: str | None, markdown_path: str | None) -> None:
    """Run the embedded tests of rules (the built-in library when no PATH is given)."""
    from rich.progress import Progress

    from . import formats
    from .api import load_rule_set
    from .report import print_rule_tests
    from .ruletest import run_tests

    report_paths = {"junit": junit_path, "markdown": markdown_path}
    formats.check_paths(((f"--{kind}", path) for kind, path in report_paths.items()),
                        protected=paths)
    compiled = load_rule_set(paths, builtin=not paths, include=include, opt_in=True)
    total = sum(len(r.rule.tests) for r in compiled)
    with Progress(console=_stderr, transient=True, disable=not _stderr.is_terminal) as bar:
        task = bar.add_task("rule tests", total=total)
        outcomes = run_tests(compiled, seed=seed, on_result=lambda _o: bar.advance(task))
    print_rule_tests(outcomes, _stdout)
    document = formats.rule_tests_document(outcomes)
    for kind, path in report_paths.items():
        if path:
            formats.write(document, path, kind)
    if any(not o.passed for o in outcomes):
        raise CheckFailedError(f"{sum(not o.passed for o in outcomes)} rule tests failed")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: run click, map every error to its exit code and one clear message."""
    try:
        with fewer_collections(process_ends=True):
            cli.main(args=list(argv) if argv is not None else None, prog_name="fusectl",
                     standalone_mode=False)
    except click.exceptions.Exit as exc:
        return int(exc.exit_code or 0)
    except click.exceptions.Abort:
        _stderr.print("aborted")
        return 2
    except click.ClickException as exc:
        _error(f"error: {exc.format_message()}")
        return 2
    except CheckFailedError as exc:
        _error(f"check failed: {exc}")
        return exc.exit_code
    except FusectlError as exc:
        if exc.exit_code == 2:
            _error(f"error: {exc}")
        else:
            _error(f"internal error: {exc}\nplease report this at the fusectl issue tracker")
        return exc.exit_code
    except KeyboardInterrupt:
        _stderr.print("interrupted")
        return 130
    except Exception as exc:  # noqa: BLE001 - the last line of defence
        if os.environ.get("FUSECTL_DEBUG"):
            raise
        _error(f"internal error: {type(exc).__name__}: {exc}\n"
               "please report this (set FUSECTL_DEBUG=1 for a traceback)")
        return 3
    return 0


def entry() -> None:  # pragma: no cover - console script
    sys.exit(main())
