"""Find the rule applications that make an optimized model compute different outputs.

Pure search logic: it knows nothing about ONNX. The caller numbers the recorded
applications ``0..n-1`` (in the order they happened), names the group (rule id) of
each, and supplies an oracle: "with these applications vetoed, does the model
validate?". Vetoing every application gives the prepared model, which must
validate (else no application is to blame).

The search is adaptive group testing, first over rules, then inside each guilty rule.
``_split(context, units)`` is called when keeping ``context`` validates and keeping
``context + units`` does not; it halves ``units``, keeps the half that validates and
recurses into the half that does not. Every set it reports as safe to keep was
validated as such by the oracle, so the result is correct whatever the oracle does,
as long as it is deterministic. One guilty application among ``n`` costs about
``log2(n) + 1`` oracle calls; ``k`` of them about ``2 k log2(n / k)``.

Limits, by design:

* Applications that are wrong only in combination (each validates alone) are
  resolved by reverting one of them: the one whose addition broke the model.
* When the budget of oracle calls runs out, the unresolved applications are all
  reverted (``unverified``): still a validated model, only with fewer fusions. Rules
  found innocent in the first phase keep all their applications.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass

__all__ = ["DEFAULT_BUDGET", "BisectOutcome", "Oracle", "bisect"]

DEFAULT_BUDGET = 32
"""Oracle calls (validations of a candidate) one bisection may spend."""

Oracle = Callable[[frozenset[int]], bool]
"""Vetoed item indices -> does the model built without them validate?"""


@dataclass(frozen=True)
class BisectOutcome:
    """What to revert: ``guilty`` item indices (sorted) whose veto makes the model validate.

    ``unverified`` is the subset reverted without proof because the budget ran out.
    ``explained`` is False when even vetoing every item does not validate: no
    application is to blame, and ``guilty`` is empty. ``calls`` counts oracle calls.
    """

    guilty: tuple[int, ...]
    unverified: tuple[int, ...]
    explained: bool
    calls: int


class _Budget(Exception):
    """The oracle budget ran out."""


def bisect(
    groups: Sequence[Hashable], oracle: Oracle, *, budget: int = DEFAULT_BUDGET
) -> BisectOutcome:
    """Find items whose veto makes the model validate, keeping every other item.

    ``groups[i]`` is the group (rule id) of item ``i``; items are in the order they
    were recorded. The caller already knows that keeping every item fails. Two phases:
    which groups are guilty (each group kept or dropped whole), then which items inside
    each guilty group, with every innocent group kept -- so a budget that runs out while
    narrowing a rule with many wrong applications costs fusions of that rule only.
    """
    if budget < 1:
        raise ValueError(f"budget must be at least 1, got {budget}")
    everything = frozenset(range(len(groups)))
    members: dict[Hashable, list[int]] = {}
    for i, group in enumerate(groups):
        members.setdefault(group, []).append(i)
    order = list(members)
    calls = 0

    def keeps(kept: frozenset[int]) -> bool:
        nonlocal calls
        if calls >= budget:
            raise _Budget
        calls += 1
        return oracle(everything - kept)

    def items_of(group_indices: Iterable[int]) -> frozenset[int]:
        return frozenset(i for g in group_indices for i in members[order[g]])

    calls = 1
    if not oracle(everything):
        return BisectOutcome((), (), explained=False, calls=calls)
    if not everything:
        return BisectOutcome((), (), explained=True, calls=calls)

    guilty_groups, unverified_groups = _split(
        frozenset(), list(range(len(order))), lambda kept: keeps(items_of(kept))
    )
    innocent = [g for g in range(len(order)) if g not in set(guilty_groups)]
    context = items_of(innocent)  # validated: the split's invariant
    guilty: list[int] = []
    unverified = sorted(items_of(unverified_groups))
    for g in guilty_groups:
        items = members[order[g]]
        if g in unverified_groups or len(items) == 1:
            guilty += items  # one item: the group's verdict is the item's
            continue
        # The first phase saw this group fail beside fewer innocent groups; it is not tested
        # again whole (a group wrong only beside a guilty one loses one item needlessly).
        dropped, not_proven = _split(context, items, keeps)
        guilty += dropped
        unverified += not_proven
        context |= set(items) - set(dropped)
    return BisectOutcome(tuple(sorted(guilty)), tuple(sorted(unverified)), True, calls)


def _split(
    context: frozenset[int], units: list[int], keeps: Callable[[frozenset[int]], bool]
) -> tuple[list[int], list[int]]:
    """Drop some ``units`` so that ``context`` + the rest validates: (dropped, unverified).

    Called when keeping ``context`` validates and keeping ``context`` + ``units`` does not.
    Units left unresolved when the budget runs out are dropped, unverified.
    """
    if len(units) == 1:
        return units, []
    middle = len(units) // 2
    first, second = units[:middle], units[middle:]
    try:
        if keeps(context | set(first)):
            return _split(context | set(first), second, keeps)
    except _Budget:
        return units, units
    dropped, unverified = _split(context, first, keeps)
    context = context | (set(first) - set(dropped))
    try:
        if keeps(context | set(second)):
            return dropped, unverified
    except _Budget:
        return dropped + second, unverified + second
    more, more_unverified = _split(context, second, keeps)
    return dropped + more, unverified + more_unverified
