"""CI gates on an optimize run: minimum traffic saving, minimum number of rule
applications, rules that must have fired. A gate is policy, not correctness: it
only turns a verified run into exit code 1 with a message that says by how much
the run missed.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from .api import OptimizeResult
from .errors import BadInputError


@dataclass(frozen=True)
class Gates:
    """What a pipeline requires; ``None``/empty means no requirement."""

    min_saved_percent: float | None = None
    min_fusions: int | None = None
    required_rules: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return (self.min_saved_percent is not None or self.min_fusions is not None
                or bool(self.required_rules))

    def check_rules_exist(self, rule_ids: Iterable[str]) -> None:
        """A ``--require-rule`` glob that names no loaded rule is a typo: exit 2 up front."""
        ids = list(rule_ids)
        for pattern in self.required_rules:
            if not any(fnmatch.fnmatchcase(i, pattern) for i in ids):
                raise BadInputError(f"--require-rule {pattern!r} matches no rule in the rule set")


@dataclass(frozen=True)
class GateResult:
    """One gate's verdict; ``message`` names the option and the shortfall."""

    gate: str
    threshold: str
    actual: str
    passed: bool
    message: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def saved_percent(result: OptimizeResult) -> float:
    before = result.traffic_before.total_bytes
    return 100.0 * result.bytes_saved / before if before else 0.0


def evaluate(gates: Gates, result: OptimizeResult) -> list[GateResult]:
    """Every requested gate, in option order, passed or not."""
    verdicts = []
    if gates.min_saved_percent is not None:
        want, have = gates.min_saved_percent, saved_percent(result)
        ok = have >= want
        gate = f"--fail-under-saved {want:g}"
        verdicts.append(GateResult(
            gate, f"{want:g}%", f"{have:.2f}%", ok,
            f"{gate}: {have:.2f}% of memory traffic saved"
            + (f" (>= {want:g}%)" if ok else f", {want - have:.2f} points short")))
    if gates.min_fusions is not None:
        want_n, have_n = gates.min_fusions, len(result.rewrite.applications)
        ok = have_n >= want_n
        gate = f"--fail-under-fusions {want_n}"
        verdicts.append(GateResult(
            gate, str(want_n), str(have_n), ok,
            f"{gate}: {have_n} rule applications"
            + (f" (>= {want_n})" if ok else f", {want_n - have_n} short")))
    counts = result.rewrite.counts()
    for pattern in gates.required_rules:
        fired = sorted(r for r in counts if fnmatch.fnmatchcase(r, pattern))
        total = sum(counts[r] for r in fired)
        gate = f"--require-rule {pattern}"
        verdicts.append(GateResult(
            gate, "fires", f"{total} applications", bool(fired),
            f"{gate}: " + (f"fired {total} times ({', '.join(fired)})" if fired
                           else "no matching rule fired on this model")))
    return verdicts


def failures(verdicts: Sequence[GateResult]) -> list[GateResult]:
    return [v for v in verdicts if not v.passed]
