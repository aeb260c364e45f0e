"""Layers of an optimize run: the graph, node by node in order, with each fused region
(the nodes some rule applications consumed and the nodes they left) as one layer.

This is what the HTML chart draws: one slot per layer, its traffic before and after.
It is derived from the JSON document alone (``node_traffic`` and ``applications``):
applications name the nodes they matched and created, and a rewrite keeps the name of
a node it replaces one-for-one, so chains (Conv+Mul, then that Conv+Add) join into one
region by name. Unnamed nodes cannot be linked this way; they show as separate layers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

Row = Mapping[str, Any]


@dataclass
class Layer:
    """One slot of the chart: nodes before, nodes after, and the rules that fused them."""

    before: list[Row] = field(default_factory=list)
    after: list[Row] = field(default_factory=list)
    rules: list[str] = field(default_factory=list)
    order: tuple[int, int] = (0, 0)

    @property
    def fused(self) -> bool:
        return bool(self.rules)

    @property
    def bytes_before(self) -> int:
        return sum(_bytes(n) for n in self.before)

    @property
    def bytes_after(self) -> int:
        return sum(_bytes(n) for n in self.after)

    @property
    def label(self) -> str:
        nodes = self.before or self.after
        if not nodes:
            return "?"
        first = str(nodes[0].get("name", "?"))
        return first if len(nodes) == 1 else f"{first} +{len(nodes) - 1}"


def _bytes(row: Row) -> int:
    return int(row.get("bytes_read", 0)) + int(row.get("bytes_written", 0))


class _Union:
    """Union-find over node names."""

    def __init__(self) -> None:
        self.parent: dict[str, str] = {}

    def find(self, name: str) -> str:
        root = self.parent.setdefault(name, name)
        while root != self.parent[root]:
            root = self.parent[root]
        while name != root:  # path compression keeps long chains linear
            self.parent[name], name = root, self.parent[name]
        return root

    def union(self, names: Sequence[str]) -> None:
        roots = [self.find(n) for n in names]
        for root in roots[1:]:
            self.parent[root] = roots[0]


def node_rows(doc: Mapping[str, Any]) -> tuple[list[Row], list[Row]]:
    """Per-node rows before and after: ``node_traffic`` of an optimize document,
    ``nodes``/``nodes_after`` of a report (dry run) document."""
    if "node_traffic" in doc:
        traffic = doc.get("node_traffic") or {}
        return list(traffic.get("before") or []), list(traffic.get("after") or [])
    return list(doc.get("nodes") or []), list(doc.get("nodes_after") or [])


def layers(doc: Mapping[str, Any]) -> list[Layer]:
    """The layers of an optimize or report document in graph order (empty when it has
    no per-node rows, e.g. a document written by an older fusectl)."""
    before, after = node_rows(doc)
    groups = _Union()
    fired: list[tuple[str, str]] = []  # (a node of the application, its rule), in order
    touched: set[str] = set()
    for app in doc.get("applications") or []:
        names = [str(n) for n in (*app.get("matched", ()), *app.get("created", ())) if n]
        if not names:
            continue
        touched.update(names)
        groups.union(names)
        fired.append((names[0], str(app.get("rule", "?"))))

    by_key: dict[str, Layer] = {}
    result: list[Layer] = []

    def layer_for(key: str, order: tuple[int, int]) -> Layer:
        if key not in by_key:
            by_key[key] = Layer(order=order)
            result.append(by_key[key])
        return by_key[key]

    for index, row in enumerate(before):
        name = str(row.get("name", ""))
        key = f"r:{groups.find(name)}" if name in touched else f"n:{name}:{index}"
        layer_for(key, (index, 0)).before.append(row)
    unchanged = {str(r.get("name", "")): by_key[f"n:{r.get('name', '')}:{i}"]
                 for i, r in enumerate(before) if str(r.get("name", "")) not in touched}
    anchor = -1  # layers only the optimized graph has go after the previous one shown
    for index, row in enumerate(after):
        name = str(row.get("name", ""))
        here = (anchor, index + 1)
        if name in touched:
            layer = layer_for(f"r:{groups.find(name)}", here)
        elif name in unchanged and not unchanged[name].after:
            layer = unchanged[name]
        else:  # a node the applications do not explain: its own layer, where it sits
            layer = layer_for(f"a:{name}:{index}", here)
        layer.after.append(row)
        anchor = layer.order[0]

    for name, rule_id in fired:
        layer = by_key.get(f"r:{groups.find(name)}")
        if layer is not None and rule_id not in layer.rules:
            layer.rules.append(rule_id)
    result.sort(key=lambda layer: layer.order)
    return result
