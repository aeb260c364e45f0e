"""What every report format shares: schema dispatch, number formatting, the validation
verdict of one output, and the document of a ``rules test`` run."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from .. import __version__
from ..report import human_bytes  # noqa: F401 - re-exported for the formats
from ..ruletest import TestOutcome

RULE_TESTS_SCHEMA = "fusectl.rules-test/1"

T = TypeVar("T")


class UnsupportedDocument(ValueError):
    """A document whose schema this format does not know how to render."""


def schema_name(doc: Mapping[str, Any]) -> str:
    """``"fusectl.optimize/1"`` -> ``"fusectl.optimize"``; only major version 1 is known."""
    schema = doc.get("schema")
    if not isinstance(schema, str) or "/" not in schema:
        raise UnsupportedDocument(f"not a fusectl report (schema {schema!r})")
    name, _, major = schema.partition("/")
    if major.split(".")[0] != "1":
        raise UnsupportedDocument(f"schema {schema!r}: only version 1 is supported")
    return name


def dispatch(doc: Mapping[str, Any], table: Mapping[str, Callable[[Mapping[str, Any]], T]],
             fmt: str) -> T:
    """Call the renderer of ``doc``'s schema from ``table`` (keyed by schema name)."""
    name = schema_name(doc)
    if name not in table:
        raise UnsupportedDocument(f"{fmt} cannot render {doc.get('schema')!r} documents")
    return table[name](doc)


def percent(part: float, whole: float) -> float:
    """``part`` as a percentage of ``whole``; 0 when ``whole`` is 0."""
    return 100.0 * part / whole if whole else 0.0


def fmt_float(value: Any) -> str:
    """Error statistics as the terminal shows them: 3 significant digits, '-' for none."""
    if value is None:
        return "-"
    if isinstance(value, str):  # "inf" / "-inf" in the JSON
        return value
    if isinstance(value, float) and math.isnan(value):
        return "-"
    return f"{value:.3g}"


def fmt_seconds(value: Any) -> str:
    """A roofline time estimate: 2.46e-05 -> '24.6 µs'."""
    if value is None:
        return "-"
    value = float(value)
    for scale, unit in ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs")):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value / 1e-9:.3g} ns"


def output_label(output: Mapping[str, Any], samples: int) -> str:
    """An output's name, with its input-set number when several sets were compared."""
    name = str(output.get("name", "?"))
    return f"{name} [sample {output.get('sample', 0)}]" if samples > 1 else name


def output_status(output: Mapping[str, Any]) -> str:
    """'ok', 'MISMATCH' or 'non-deterministic' (not held against the candidate)."""
    if output.get("nondeterministic"):
        return "non-deterministic"
    return "ok" if output.get("passed") else "MISMATCH"


def sample_count(outputs: Iterable[Mapping[str, Any]]) -> int:
    return len({o.get("sample", 0) for o in outputs})


def mismatch_summary(output: Mapping[str, Any]) -> str:
    """One line a CI log can show for a compared output."""
    parts = [f"max abs {fmt_float(output.get('max_abs'))}",
             f"max rel {fmt_float(output.get('max_rel'))}",
             f"mean abs {fmt_float(output.get('mean_abs'))}",
             f"cosine {fmt_float(output.get('cosine'))}",
             f"{fmt_float(output.get('pct_out_of_tol'))}% out of tolerance"]
    text = (", ".join(parts) + f" (rtol {fmt_float(output.get('rtol'))}, "
            f"atol {fmt_float(output.get('atol'))})")
    return f"{output['reason']}; {text}" if output.get("reason") else text


def rule_tests_document(outcomes: Iterable[TestOutcome]) -> dict[str, Any]:
    """The outcome of ``fusectl rules test`` as a document the formats can render."""
    tests = [
        {
            "rule": o.rule_id,
            "test": o.test,
            "passed": o.passed,
            "fires": o.fires,
            "problems": list(o.problems),
            "location": o.location,
            "seconds": round(o.seconds, 4),
            "max_abs_error": o.max_abs_error,
        }
        for o in outcomes
    ]
    return {
        "schema": RULE_TESTS_SCHEMA,
        "fusectl_version": __version__,
        "passed": all(t["passed"] for t in tests),
        "tests": tests,
    }
