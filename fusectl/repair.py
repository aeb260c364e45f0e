"""Repairs of models that onnxruntime runs but onnx's checker refuses, made before the check.

onnxruntime's own tests and tools write such models: nodes out of topological order
(onnxruntime sorts a graph when it loads it) and contrib ops of ``com.microsoft`` without an
import of that domain (onnxruntime has only version 1 of it). Both repairs are unambiguous and
change nothing the model computes; each is reported as a note. Anything else the checker says
stays bad input.
"""

from __future__ import annotations

import heapq

import onnx

CONTRIB_DOMAIN = "com.microsoft"


def repair_for_checker(proto: onnx.ModelProto, message: str) -> str | None:
    """Apply the repair that answers the checker's ``message`` to ``proto`` (in place) and
    return a note saying what was done, or None when no repair applies."""
    if f"No opset import for domain '{CONTRIB_DOMAIN}'" in message:
        if any(o.domain == CONTRIB_DOMAIN for o in proto.opset_import):
            return None
        proto.opset_import.add(domain=CONTRIB_DOMAIN, version=1)
        return (f"the model uses {CONTRIB_DOMAIN} ops without importing that domain; "
                "imported it at version 1, as onnxruntime does")
    if "must be topologically sorted" in message:
        if not sort_nodes(proto.graph):
            return None
        return "the model's nodes were not in topological order; sorted them, as onnxruntime does"
    return None


def sort_nodes(graph: onnx.GraphProto) -> bool:
    """Reorder ``graph``'s nodes so that every node follows the producers of what it reads
    (also inside its subgraphs), moving as little as it can (of the nodes ready, the first
    given goes first: a sorted graph keeps its order); False, and the graph untouched, when
    the nodes form a cycle."""
    nodes = list(graph.node)
    producer = {name: i for i, node in enumerate(nodes) for name in node.output if name}
    waiting_on = [0] * len(nodes)
    readers: list[list[int]] = [[] for _ in nodes]
    for i, node in enumerate(nodes):
        needed = {producer[name] for name in _reads(node) if name in producer}
        needed.discard(i)
        waiting_on[i] = len(needed)
        for j in needed:
            readers[j].append(i)
    ready = [i for i, count in enumerate(waiting_on) if count == 0]
    order: list[int] = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for j in readers[i]:
            waiting_on[j] -= 1
            if waiting_on[j] == 0:
                heapq.heappush(ready, j)
    if len(order) != len(nodes):
        return False
    sorted_nodes = [nodes[i] for i in order]
    del graph.node[:]
    graph.node.extend(sorted_nodes)
    return True


def _reads(node: onnx.NodeProto) -> set[str]:
    """Names a node reads: its inputs and the outer values its subgraphs read."""
    names = set(node.input)
    for attr in node.attribute:
        for sub in (*([attr.g] if attr.HasField("g") else []), *attr.graphs):
            names |= _outer_reads(sub)
    return names


def _outer_reads(graph: onnx.GraphProto) -> set[str]:
    defined = {v.name for v in graph.input} | {t.name for t in graph.initializer}
    defined |= {t.values.name for t in graph.sparse_initializer}
    defined |= {name for node in graph.node for name in node.output}
    read: set[str] = set()
    for node in graph.node:
        read |= _reads(node)
    read |= {v.name for v in graph.output}
    return read - defined
