"""Summaries of noisy samples: the machine is shared, so the benchmark reports medians with
their min–max, never a single run or a mean one outlier can drag."""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def spread(samples: Sequence[float]) -> dict | None:
    """``{"median", "min", "max", "n"}`` of the samples, or None when there are none."""
    if not samples:
        return None
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples),
            "n": len(samples)}


def ratio(mine: dict | None, theirs: dict | None) -> float | None:
    """``mine`` median over ``theirs`` median (below 1: ``mine`` is faster/smaller)."""
    if not mine or not theirs or not theirs["median"]:
        return None
    return mine["median"] / theirs["median"]


def fmt_spread(summary: dict | None, scale: float = 1.0, digits: int = 2) -> str:
    """``median (min–max)`` scaled, e.g. seconds to milliseconds with ``scale=1000``."""
    if not summary:
        return "—"
    med, lo, hi = (summary[k] * scale for k in ("median", "min", "max"))
    if summary["n"] == 1 or lo == hi:
        return f"{med:.{digits}f}"
    return f"{med:.{digits}f} ({lo:.{digits}f}–{hi:.{digits}f})"


def fmt_ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"
