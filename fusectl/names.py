"""Fresh names for the nodes and values a rewrite or preparation step creates."""

from __future__ import annotations

import itertools

import onnx_ir as ir


class FreshNames:
    """Model-wide unique names: every name in the model (all graphs) is taken."""

    def __init__(self, model: ir.Model) -> None:
        self.used: set[str] = set()
        for graph in model.graphs():
            for value in itertools.chain(graph.inputs, graph.initializers.values()):
                if value.name:
                    self.used.add(value.name)
            for node in graph:
                if node.name:
                    self.used.add(node.name)
                self.used.update(v.name for v in node.outputs if v.name)
        self.counter = 0

    def fresh(self, base: str) -> str:
        """``base`` itself when free, else ``base_N`` for the next free N."""
        base = base or "fusectl"
        if base not in self.used:
            self.used.add(base)
            return base
        while True:
            self.counter += 1
            name = f"{base}_{self.counter}"
            if name not in self.used:
                self.used.add(name)
                return name
