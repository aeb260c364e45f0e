"""Run the tests embedded in rules: build each model, apply the rule alone, check
the expectations, and check numerically on onnxruntime that the outputs did not change.

A test model is ONNX text. Initializers declared without data
(``<float[4,3,3,3] W>``) get seeded random values, which ``init:`` can shape
(``uniform(lo, hi)``, ``normal(mean, std)``, ``randint(lo, hi)``, a number or a list).
"""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from .compile import CompiledRule
from .errors import BadInputError, first_line_of
from .prepare import detach_legacy_initializer_inputs, prepare
from .rewrite import apply_rules
from .rulefile import RuleTest
from .symdims import forget_stand_ins
from .targets import set_aside_onnxruntime_ops

_DTYPES = {
    "float": np.float32,
    "float16": np.float16,
    "double": np.float64,
    "int64": np.int64,
    "int32": np.int32,
    "int16": np.int16,
    "int8": np.int8,
    "uint8": np.uint8,
    "bool": np.bool_,
}
_DECLARATION = re.compile(r"^\s*([a-z0-9]+)\s*(?:\[([^\]]*)\])?\s+([A-Za-z_][\w.]*)\s*$")


@dataclass(frozen=True)
class TestOutcome:
    """The result of one embedded test."""

    rule_id: str
    test: str
    passed: bool
    fires: int
    problems: tuple[str, ...]
    location: str
    seconds: float
    max_abs_error: float | None = None


class TestModelError(Exception):
    """The embedded model does not parse or does not check."""


def _matching(text: str, start: int, open_ch: str, close_ch: str) -> int:
    depth = 0
    for i in range(start, len(text)):
        if text[i] == open_ch:
            depth += 1
        elif text[i] == close_ch:
            depth -= 1
            if depth == 0:
                return i
    raise TestModelError(f"unbalanced {open_ch}{close_ch} in the test model")


def _split_declarations(text: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "{[(":
            depth += 1
        elif ch in "}])":
            depth -= 1
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [item for item in items if item.strip()]


Declared = tuple[str, Any, tuple[int | str, ...]]
"""A data-less declaration: name, numpy dtype, dims (a str is a symbolic dim)."""


def strip_dataless_initializers(text: str) -> tuple[str, list[Declared]]:
    """Remove ``<float[4] W>``-style declarations (onnx's parser drops them silently)
    and return them so that the caller can supply data, or declare the shape of a value
    a node computes (``<float[N,L,16] y>``: what exporters write as value_info)."""
    arrow = text.find("=>")
    if arrow < 0:
        return text, []
    open_paren = text.find("(", arrow)
    close_paren = _matching(text, open_paren, "(", ")")
    rest = text[close_paren + 1 :]
    stripped = rest.lstrip()
    if not stripped.startswith("<"):
        return text, []
    block_start = close_paren + 1 + (len(rest) - len(stripped))
    block_end = _matching(text, block_start, "<", ">")
    kept, declared = [], []
    for item in _split_declarations(text[block_start + 1 : block_end]):
        if "=" in item:
            kept.append(item.strip())
            continue
        m = _DECLARATION.match(item)
        if not m or m.group(1) not in _DTYPES:
            raise TestModelError(f"cannot read initializer declaration {item.strip()!r}")
        dims = tuple(_dim(d) for d in m.group(2).split(",") if d.strip()) if m.group(2) else ()
        declared.append((m.group(3), _DTYPES[m.group(1)], dims))
    block = f"<{', '.join(kept)}>" if kept else ""
    return text[:block_start] + block + text[block_end + 1 :], declared


def _dim(text: str) -> int | str:
    text = text.strip()
    if not text.lstrip("-").isdigit():
        return text
    if int(text) < 0:
        raise TestModelError(f"initializer dim {text} is negative")
    return int(text)


def _declare_value(proto: onnx.ModelProto, name: str, dtype: Any,
                   dims: tuple[int | str, ...]) -> None:
    proto.graph.value_info.append(onnx.helper.make_tensor_value_info(
        name, onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype)), list(dims)))


def _sample(spec: Any, dtype: Any, dims: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    if isinstance(spec, (int, float)):
        return np.full(dims, spec, dtype=dtype)
    if isinstance(spec, list):
        return np.asarray(spec, dtype=dtype).reshape(dims)
    m = re.fullmatch(r"(uniform|normal|randint)\(\s*([-+.\deE]+)\s*,\s*([-+.\deE]+)\s*\)", spec)
    if not m:
        raise TestModelError(f"bad init spec {spec!r}")
    kind, a, b = m.group(1), float(m.group(2)), float(m.group(3))
    if kind == "uniform":
        return rng.uniform(a, b, dims).astype(dtype)
    if kind == "normal":
        return rng.normal(a, b, dims).astype(dtype)
    return rng.integers(int(a), int(b), dims).astype(dtype)


def build_test_model(test: RuleTest, seed: int = 0) -> onnx.ModelProto:
    """The test's model with every data-less initializer filled in, checked by onnx."""
    text, declared = strip_dataless_initializers(test.model)
    try:
        proto = onnx.parser.parse_model(text)
    except Exception as exc:  # noqa: BLE001 - the parser raises several types
        raise TestModelError(f"test model does not parse: {first_line_of(exc)}") from None
    rng = np.random.default_rng(seed)
    init = dict(test.init)
    computed = {out for node in proto.graph.node for out in node.output}
    for name, dtype, dims in declared:
        if name in computed:
            _declare_value(proto, name, dtype, dims)
            continue
        if not all(isinstance(d, int) for d in dims):
            raise TestModelError(f"initializer {name} has symbolic dims {list(dims)}")
        default = "uniform(-1, 1)" if np.dtype(dtype).kind == "f" else "randint(0, 4)"
        array = _sample(init.pop(name, default), dtype, dims, rng)
        proto.graph.initializer.append(onnx.numpy_helper.from_array(array, name))
    for existing in proto.graph.initializer:
        if existing.name in init:
            array = onnx.numpy_helper.to_array(existing)
            new = _sample(init.pop(existing.name), array.dtype, array.shape, rng)
            existing.CopyFrom(onnx.numpy_helper.from_array(new, existing.name))
    if init:
        raise TestModelError(f"init names unknown initializers: {', '.join(sorted(init))}")
    try:
        check_model(proto)
    except Exception as exc:  # noqa: BLE001
        raise TestModelError(f"test model fails onnx's checker: {first_line_of(exc)}"
                             ) from None
    return proto


def check_model(proto: onnx.ModelProto) -> None:
    """onnx's full check, with onnxruntime's default-domain contrib ops set aside (the rest
    of the model is still checked, and the original still runs on onnxruntime)."""
    onnx.checker.check_model(set_aside_onnxruntime_ops(proto), full_check=True)


def op_histogram(graph: ir.Graph) -> Counter[str]:
    """Ops of a graph keyed like rule expectations: ``Conv``, ``com.microsoft.FusedConv``."""
    return Counter(f"{n.domain}.{n.op_type}" if n.domain else n.op_type for n in graph)


def run_rule_test(rule: CompiledRule, test: RuleTest, *, seed: int = 0,
                  target: str | None = None) -> TestOutcome:
    """Apply ``rule`` alone to the test model and check expectations and numerics."""
    start = time.perf_counter()
    location = f"{rule.rule.file}:{test.line}"
    try:
        proto = build_test_model(test, seed)
    except TestModelError as exc:
        return TestOutcome(rule.id, test.name, False, 0, (str(exc),), location,
                           time.perf_counter() - start)
    model = ir.serde.deserialize_model(proto)
    detach_legacy_initializer_inputs(model)
    prepare(model, fold=test.fold)
    targets = [t for t in rule.rule.when.targets if t != "any"]
    result = apply_rules(model, [rule], target=target or (targets[0] if targets else "onnx"))
    forget_stand_ins(model)
    fires = len(result.applications)
    problems: list[str] = []
    expect = test.expect
    if expect.fires is not None and fires != expect.fires:
        why = ""
        if fires == 0:
            reasons = [r.reason for r in result.rejections] + [r for _, r in result.skipped]
            why = f" ({reasons[0]})" if reasons else " (no structural match)"
        problems.append(f"fired {fires} times, expected {expect.fires}{why}")
    ops = op_histogram(model.graph)
    for op, count in expect.ops:
        if ops.get(op, 0) != count:
            problems.append(f"{op}: {ops.get(op, 0)} nodes after rewriting, expected {count}")
    nodes = sum(ops.values())
    if expect.nodes is not None and nodes != expect.nodes:
        problems.append(f"{nodes} nodes after rewriting, expected {expect.nodes}")
    max_abs = None
    if fires:
        try:
            check_model(ir.to_proto(model))
        except Exception as exc:  # noqa: BLE001
            problems.append(f"rewritten model fails onnx's checker: {first_line_of(exc)}")
        numeric, max_abs = _numeric_check(proto, model, test, seed)
        problems += numeric
    return TestOutcome(rule.id, test.name, not problems, fires, tuple(problems), location,
                       time.perf_counter() - start, max_abs)


def _numeric_check(proto: onnx.ModelProto, model: ir.Model, test: RuleTest,
                   seed: int) -> tuple[list[str], float | None]:
    """Why the rewritten model does not compute what the test model does (none when it
    does), and the largest error. A test model onnxruntime cannot run (no bfloat16 kernels)
    is this test's failure, not the end of the whole run: it fired where it should not
    have, or it cannot be checked."""
    from .validate import ValidationOptions, validate

    options = ValidationOptions(seed=seed, rtol=test.rtol, atol=test.atol)
    try:
        outcome = validate(ir.serde.deserialize_model(proto), model, options)
    except BadInputError as exc:
        return [f"outputs not checked: {exc}"], None
    errors = [o.max_abs for o in outcome.outputs if o.max_abs == o.max_abs]
    max_abs = max(errors) if errors else None
    if outcome.passed:
        return [], max_abs
    detail = outcome.error or "; ".join(
        f"{o.name}: {o.reason or f'max abs error {o.max_abs:.3g}'}"
        for o in outcome.outputs if not o.passed
    )
    return [f"outputs changed: {detail}"], max_abs


def run_tests(rules: Iterable[CompiledRule], *, seed: int = 0,
              on_result: Callable[[TestOutcome], None] | None = None) -> list[TestOutcome]:
    """Every embedded test of every rule, in order."""
    outcomes = []
    for rule in rules:
        for test in rule.rule.tests:
            outcome = run_rule_test(rule, test, seed=seed)
            outcomes.append(outcome)
            if on_result:
                on_result(outcome)
    return outcomes


def lint_tests(rules: Iterable[CompiledRule]) -> list[str]:
    """Rules must prove both sides: a test that fires and a test that must not."""
    problems = []
    for rule in rules:
        fires = [t for t in rule.rule.tests if (t.expect.fires or 0) > 0]
        silent = [t for t in rule.rule.tests if t.expect.fires == 0]
        if not fires:
            problems.append(f"{rule.rule.source}: rule {rule.id} has no test that fires")
        if not silent:
            problems.append(f"{rule.rule.source}: rule {rule.id} has no test that must not fire")
        for test in rule.rule.tests:
            try:
                build_test_model(test)
            except TestModelError as exc:
                problems.append(f"{rule.rule.file}:{test.line}: test {test.name}: {exc}")
    return problems
