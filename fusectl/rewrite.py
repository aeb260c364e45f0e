"""Apply compiled rules to a model, to a fixed point, recording every application.

onnxscript's ``apply_to_model`` only returns a count; we drive matching
ourselves so that each application is recorded (matched nodes -> new nodes,
bytes before and after), new initializers get fresh names (a reused name
would silently replace a shared weight), each rule is capped per pass (no
runaway rewriting) and rules that cannot run on the model are reported as
skipped with the reason.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import onnx_ir as ir
from onnx_ir.passes.common import TopologicalSortPass

from . import traffic
from .compile import CompiledRule, NoRewrite, Rewrite
from .deadcode import remove_dead_producers, remove_unused
from .dedupe import merge_twins
from .names import FreshNames
from .shapeexpr import input_dim_names, is_minted
from .shapereads import ShapeReadMover
from .shapes import infer_node

RULE_TAG = "fusectl.rule"
MAX_PASSES = 16
MAX_REJECTIONS_PER_RULE = 20


@dataclass(frozen=True)
class Application:
    """One rule application: what was matched, what replaced it, and the bytes it moved."""

    rule_id: str
    graph: str
    matched: tuple[str, ...]
    matched_ops: tuple[str, ...]
    created: tuple[str, ...]
    created_ops: tuple[str, ...]
    initializers: tuple[str, ...]
    bytes_before: int
    bytes_after: int
    pass_number: int

    @property
    def bytes_saved(self) -> int:
        return self.bytes_before - self.bytes_after

    def to_dict(self) -> dict[str, Any]:
        """As in the reports' ``applications[]`` (schemas/optimize.schema.json)."""
        return {
            "rule": self.rule_id,
            "graph": self.graph,
            "matched": list(self.matched),
            "matched_ops": list(self.matched_ops),
            "created": list(self.created),
            "created_ops": list(self.created_ops),
            "initializers": list(self.initializers),
            "bytes_before": self.bytes_before,
            "bytes_after": self.bytes_after,
            "bytes_saved": self.bytes_saved,
        }


@dataclass(frozen=True)
class Rejection:
    """A structural match that a rule's condition refused (the 'why not' of a rule)."""

    rule_id: str
    node: str
    reason: str


@dataclass(frozen=True)
class RewriteResult:
    """Everything the rewrite stage did, for the report and for bisection."""

    applications: tuple[Application, ...]
    skipped: tuple[tuple[str, str], ...] = ()
    rejections: tuple[Rejection, ...] = ()
    capped: tuple[str, ...] = ()
    passes: int = 0
    converged: bool = True
    """False when the pass limit stopped rules that were still firing."""
    rules_run: tuple[str, ...] = field(default=())

    def counts(self) -> dict[str, int]:
        """Applications per rule id, in first-application order."""
        return dict(Counter(a.rule_id for a in self.applications))

    def saved_by_rule(self) -> dict[str, int]:
        saved: dict[str, int] = {}
        for app in self.applications:
            saved[app.rule_id] = saved.get(app.rule_id, 0) + app.bytes_saved
        return saved


def _graphs(model: ir.Model) -> Iterator[ir.Graph]:
    """The main graph and every control-flow subgraph, outermost first."""
    stack = [model.graph]
    while stack:
        graph = stack.pop(0)
        yield graph
        for node in graph:
            for attr in node.attributes.values():
                if attr.type == ir.AttributeType.GRAPH:
                    stack.append(attr.value)
                elif attr.type == ir.AttributeType.GRAPHS:
                    stack.extend(attr.value)


def apply_rules(
    model: ir.Model,
    rules: Sequence[CompiledRule],
    *,
    target: str | Sequence[str] = "onnx",
    max_passes: int = MAX_PASSES,
    dims: Mapping[str, int] | None = None,
    accept: Callable[[str, tuple[str, ...]], bool] | None = None,
    incremental: bool = True,
    bound: Mapping[str, tuple[int, ...]] | None = None,
) -> RewriteResult:
    """Apply ``rules`` in order, pass after pass, until nothing changes.

    Each pass runs every rule over every graph in order; a pass in which no rule
    fired ends the loop. A rule may fire at most once per node present when the
    pass started (plus one), which bounds a rule that would rewrite its own output.
    ``accept(rule_id, matched node names)``, when given, may refuse an application
    before it is committed (bisection replays a rewrite without chosen applications).

    After its first run a rule is re-tried only at nodes near which the graph changed
    since (``CompiledRule.reach``): elsewhere it would find what it found before.
    ``incremental=False`` re-tries every node on every pass (the same result, slower).
    ``bound`` (:func:`fusectl.boundshapes.bound_shapes`) costs the values whose dims inference
    could not name, as the traffic report does.
    """
    active: list[CompiledRule] = []
    skipped: list[tuple[str, str]] = []
    for rule in rules:
        reason = rule.skip_reason(model, target)
        if reason:
            skipped.append((rule.id, reason))
        else:
            active.append(rule)
    names = FreshNames(model)
    applications: list[Application] = []
    rejections: dict[str, list[Rejection]] = {}
    capped: set[str] = set()
    passes = 0
    converged = False
    touched = _Touched()
    meter = traffic.Meter(dims=dims, bound=bound, named=input_dim_names(model.graph))
    shape_reads = ShapeReadMover(model, names)
    last_run: dict[tuple[int, int], int] = {}  # (rule, graph) -> number of its last run
    run = 0

    def commit(rewrite: Rewrite, graph: ir.Graph, pass_number: int) -> None:
        """Apply, record it, and remember where the graph changed and what ops it has."""
        read = touched.read_by(rewrite)
        application, unread = _apply(model, graph, rewrite, names, pass_number, meter)
        applications.append(application)
        touched.record(rewrite, read, run)
        # at once, not in the final cleanup: a dead reader of a value (the Shape that
        # computed a replaced Reshape's target) keeps patterns through it from matching
        touched.readers_changed(remove_dead_producers(graph, read) + unread, run)
        # a read of named dims the rewrite wrote reads the graph input instead, so a later
        # fusion through the value it read can remove it
        moved = shape_reads.move(rewrite.new_nodes)
        if moved:
            touched.readers_changed(remove_dead_producers(graph, moved) + moved, run)
        typed = _type_readers(rewrite.new_nodes, model)
        meter.forget(out for node in typed for out in node.outputs)
        touched.stamp(typed, run)
        present[id(graph)].update((n.domain, n.op_type) for n in rewrite.new_nodes)
        indexes[id(graph)].invalidate()

    for pass_number in range(1, max_passes + 1):
        passes = pass_number
        fired = 0
        graphs = list(_graphs(model))  # no rule creates or removes control flow
        # Ops present per graph (only grows): a rule none of whose root ops is present is
        # not run over the graph at all, so cost is not rules x nodes.
        present = {id(g): {(n.domain, n.op_type) for n in g} for g in graphs}
        indexes = {id(g): _OpIndex(g) for g in graphs}
        for rule in active:
            roots = rule.root_ops
            for graph in graphs:
                if present[id(graph)].isdisjoint(roots):
                    continue
                run += 1
                since = last_run.get((id(rule), id(graph))) if incremental else None
                last_run[(id(rule), id(graph))] = run
                reach = rule.reach if since is not None else None
                if rule.rule.group is not None:
                    def reject(node: ir.Node, reason: str, rule: CompiledRule = rule) -> None:
                        _reject(rejections, rule.id, node, reason)
                    near = None if reach is None else (
                        lambda node, reach=reach, since=since: touched.near(node, reach, since))
                    for rewrite in rule.find_groups(model, graph, reject, near):
                        more = _costs_traffic(rewrite, model, meter)
                        if more and rule.rule.group.require_saving:
                            reject(rewrite.root, more)
                            continue
                        if accept and not accept(rewrite.rule_id, _matched_names(rewrite)):
                            continue
                        commit(rewrite, graph, pass_number)
                        fired += 1
                    continue
                cap = len(graph) + 1
                count = 0
                candidates = indexes[id(graph)].nodes_of(roots)
                for node in candidates:
                    if node.graph is not graph:  # removed by an earlier application
                        continue
                    if count >= cap:
                        capped.add(rule.id)
                        del last_run[(id(rule), id(graph))]  # nodes left unvisited
                        break
                    if reach is not None and not (rule.could_match(node)
                                                  and touched.near(node, reach, since)):
                        continue
                    try:
                        rewrite = rule.find(model, graph, node)
                    except NoRewrite as exc:
                        _reject(rejections, rule.id, node, str(exc))
                        continue
                    if rewrite is None:
                        continue
                    if accept and not accept(rewrite.rule_id, _matched_names(rewrite)):
                        continue
                    commit(rewrite, graph, pass_number)
                    # New nodes this rule may root at are visited in this pass too.
                    candidates.extend(n for n in rewrite.new_nodes
                                      if (n.domain, n.op_type) in roots)
                    count += 1
                    fired += 1
        if not fired:
            converged = True
            break
    if applications:
        _cleanup(model)
    return RewriteResult(
        tuple(applications),
        tuple(skipped),
        tuple(r for rs in rejections.values() for r in rs),
        tuple(sorted(capped)),
        passes,
        converged,
        tuple(r.id for r in active),
    )


class _Touched:
    """Where the graph changed, and during which rule run: the nodes an application
    created, the producers of every value its nodes read (their readers changed), and the
    readers of such values that no node produces (initializers, graph inputs)."""

    MAX_READERS = 64
    """Readers of one changed initializer stamped one by one; past this (a scalar constant
    shared across the model), the run counts as having changed everything."""
    MAX_NEAR = 256
    """Nodes ``near`` visits before answering yes rather than looking further."""

    def __init__(self) -> None:
        self.stamps: dict[int, tuple[ir.Node, int]] = {}
        self.everything = -1

    @staticmethod
    def read_by(rewrite: Rewrite) -> list[ir.Value]:
        """The values the matched and the new nodes read; taken before the application,
        which detaches the matched nodes from their inputs."""
        return [value for node in itertools.chain(rewrite.matched_nodes, rewrite.new_nodes)
                for value in node.inputs if value is not None]

    def record(self, rewrite: Rewrite, read: list[ir.Value], run: int) -> None:
        """Stamp what an application changed (``read``: ``read_by`` before it)."""
        stamps = self.stamps
        for node in rewrite.new_nodes:
            stamps[id(node)] = (node, run)
        self.readers_changed(read, run)

    def readers_changed(self, values: list[ir.Value], run: int) -> None:
        """Stamp the producers of values whose readers changed (or, for a value nobody
        produces, its readers)."""
        stamps = self.stamps
        for value in values:
            producer = value.producer()
            if producer is not None:
                stamps[id(producer)] = (producer, run)
                continue
            uses = value.uses()
            if len(uses) > self.MAX_READERS:
                self.everything = run
                continue
            for use in uses:
                stamps[id(use.node)] = (use.node, run)

    def stamp(self, nodes: Iterable[ir.Node], run: int) -> None:
        """Stamp nodes changed otherwise (readers typed after an application)."""
        for node in nodes:
            self.stamps[id(node)] = (node, run)

    def near(self, node: ir.Node, reach: int, since: int) -> bool:
        """Whether a node at most ``reach`` producer hops above ``node`` (or ``node``) was
        stamped during run ``since`` or later."""
        if self.everything >= since:
            return True
        stamps = self.stamps
        frontier = [node]
        seen = {id(node)}
        for hop in range(reach + 1):
            following = []
            for current in frontier:
                stamp = stamps.get(id(current))
                if stamp is not None and stamp[0] is current and stamp[1] >= since:
                    return True
                if hop == reach:
                    continue
                for value in current.inputs:
                    producer = value.producer() if value is not None else None
                    if producer is not None and id(producer) not in seen:
                        seen.add(id(producer))
                        following.append(producer)
            if len(seen) > self.MAX_NEAR:
                return True
            frontier = following
        return False


class _OpIndex:
    """The nodes of one graph by (domain, op_type), in graph order: a rule visits only the
    nodes it can be rooted at instead of scanning the whole graph (260 rules over a
    100k-node graph). Rebuilt on first use after an application changed the graph."""

    def __init__(self, graph: ir.Graph | ir.Function) -> None:
        self.graph = graph
        self._by_op: dict[tuple[str, str], list[ir.Node]] | None = None
        self._position: dict[int, int] = {}

    def invalidate(self) -> None:
        self._by_op = None

    def nodes_of(self, ops: frozenset[tuple[str, str]]) -> list[ir.Node]:
        """A fresh list of the nodes with one of ``ops``, in graph order."""
        if self._by_op is None:
            by_op: dict[tuple[str, str], list[ir.Node]] = {}
            for node in self.graph:
                by_op.setdefault((node.domain, node.op_type), []).append(node)
            self._by_op = by_op
            self._position = {}
        lists = [self._by_op[op] for op in ops if op in self._by_op]
        if len(lists) <= 1:
            return list(lists[0]) if lists else []
        if not self._position:
            self._position = {id(n): i for i, n in enumerate(self.graph)}
        position = self._position
        return sorted(itertools.chain.from_iterable(lists), key=lambda n: position[id(n)])


def _reject(rejections: dict[str, list[Rejection]], rule_id: str, node: ir.Node,
            reason: str) -> None:
    seen = rejections.setdefault(rule_id, [])
    if len(seen) < MAX_REJECTIONS_PER_RULE:
        seen.append(Rejection(rule_id, node.name or node.op_type, reason))


def _bytes(nodes: Sequence[ir.Node], meter: traffic.Meter) -> int:
    return sum(meter.bytes(n) for n in nodes)


def _apply(model: ir.Model, graph: ir.Graph, rewrite: Rewrite, names: FreshNames,
           pass_number: int, meter: traffic.Meter) -> tuple[Application, list[ir.Value]]:
    """Put a rewrite into the graph: fresh names, rewiring, insertion, removal. Also
    returns the values whose readers the removal of unread new nodes took."""
    bytes_before = _bytes(rewrite.matched_nodes, meter)
    matched = _matched_names(rewrite)
    matched_ops = tuple(n.op_type for n in rewrite.matched_nodes)
    root_name = rewrite.root.name or rewrite.root.op_type
    init_names = []
    for init in rewrite.new_initializers:
        init.name = names.fresh(f"{root_name}.{init.name or 'const'}")
        init_names.append(init.name)
        graph.register_initializer(init)
    for node in rewrite.new_nodes:
        node.metadata_props[RULE_TAG] = rewrite.rule_id
    for function in rewrite.functions:
        model.functions[function.identifier()] = function
    old_names = {n.name for n in rewrite.matched_nodes if n.name}
    for index, node in enumerate(rewrite.new_nodes):
        hint = rewrite.name_hints.get(index) or root_name
        if hint in old_names:
            names.used.discard(hint)
            old_names.discard(hint)
        node.name = names.fresh(hint)
    for index, (old, new) in enumerate(zip(rewrite.old_outputs, rewrite.new_outputs, strict=True)):
        if rewrite.aliases.get(index):
            ir.convenience.replace_all_uses_with(old, new)
            continue
        if old.type is not None:
            new.type = old.type
        if old.shape is not None:
            new.shape = old.shape
        new.name = old.name
        old.name = None
        ir.convenience.replace_all_uses_with(old, new, replace_graph_outputs=True)
    for node in rewrite.new_nodes:
        for value in node.outputs:
            if value.name is None:
                value.name = names.fresh(f"{node.name}_out")
    graph.insert_after(rewrite.root, rewrite.new_nodes)
    graph.remove(rewrite.matched_nodes, safe=True)
    # A kept intermediate nobody outside reads is built all the same (with its readers in
    # the replacement): gone now, it cannot count as a second reader of the match's inputs
    # that keeps the next rule from matching (a Transpose pair from composing).
    unread = remove_dead_producers(graph, [v for n in rewrite.new_nodes for v in n.outputs])
    # A new intermediate that computes what the graph already does (the rotary table a query
    # and a key fusion each slice) is merged now: patterns through its input then see one
    # reader. Outputs stay, named as the values they replace (rewrite boundaries).
    outputs = {id(v) for v in rewrite.new_outputs}
    unread += merge_twins(graph, [n for n in rewrite.new_nodes
                                  if not any(id(v) in outputs for v in n.outputs)])
    new_nodes = [n for n in rewrite.new_nodes if n.graph is graph]
    for domain, version in rewrite.opsets.items():
        if domain not in model.opset_imports:
            model.opset_imports[domain] = version
    _infer_new_shapes(new_nodes, model)
    bytes_after = _bytes(new_nodes, meter)
    return Application(
        rewrite.rule_id,
        graph.name or "",
        matched,
        matched_ops,
        tuple(n.name or "" for n in new_nodes),
        tuple(n.op_type for n in new_nodes),
        tuple(init_names),
        bytes_before,
        bytes_after,
        pass_number,
    ), unread


def _matched_names(rewrite: Rewrite) -> tuple[str, ...]:
    return tuple(n.name or n.op_type for n in rewrite.matched_nodes)


def _costs_traffic(rewrite: Rewrite, model: ir.Model, meter: traffic.Meter) -> str | None:
    """Why a merge would move more bytes than the nodes it replaces (e.g. the Split copy
    outweighs the reads of the shared input it saves), or None."""
    for old, new in zip(rewrite.old_outputs, rewrite.new_outputs, strict=True):
        if new.type is None and old.type is not None:
            new.type = old.type
        if new.shape is None and old.shape is not None:
            new.shape = old.shape
    _infer_new_shapes(rewrite.new_nodes, model)
    before, after = _bytes(rewrite.matched_nodes, meter), _bytes(rewrite.new_nodes, meter)
    if after > before:
        return (f"merging {len(rewrite.old_outputs)} outputs would move more bytes "
                f"({after:,} > {before:,}): the Split copy outweighs the saved reads")
    return None


def _infer_new_shapes(nodes: Sequence[ir.Node], model: ir.Model) -> None:
    """Give new intermediate values a shape so later rules and the traffic model see it."""
    for node in nodes:
        if any(v.type is None or v.shape is None or not v.shape.is_static()
               for v in node.outputs):
            infer_node(node, model.opset_imports, refine=True)


MAX_TYPED_READERS = 64
"""Readers typed downstream of one application at most (linear cost on long chains)."""


def _type_readers(nodes: Sequence[ir.Node], model: ir.Model) -> list[ir.Node]:
    """Type the untyped readers downstream of the new nodes, one by one: a Reshape given a
    constant target types the MatMul reading it, so MatMul + Add becomes a Gemm in the next
    pass rather than never (tidy's whole-model inference comes after the rules). Returns
    the readers typed (their output shapes changed: rules near them run again)."""
    queue = [v for n in nodes for v in n.outputs if v.shape is not None]
    typed: list[ir.Node] = []
    tried: set[int] = set()
    while queue and len(tried) < MAX_TYPED_READERS:
        value = queue.pop()
        for use in value.uses():
            reader = use.node
            if id(reader) in tried or not any(_open_shape(o) for o in reader.outputs):
                continue
            if any(v is not None and v.shape is None for v in reader.inputs):
                continue  # tried when its last input is typed (Div(x - m, Sqrt(v)) of a LayerNorm)
            tried.add(id(reader))
            before = [o.shape for o in reader.outputs]
            infer_node(reader, model.opset_imports, refine=True)
            outputs = [o for o, shape in zip(reader.outputs, before, strict=True)
                       if o.shape is not None and o.shape != shape]
            if outputs:
                typed.append(reader)
                queue.extend(outputs)
    return typed


def _open_shape(value: ir.Value) -> bool:
    """Whether inference may still tell more of a value's shape: none yet, or a dim onnx
    minted (``unk__21`` for a Reshape's -1 that a rewrite has since replaced by a product
    of named dims)."""
    return value.shape is None or any(
        not isinstance(d, int) and is_minted(d.value) for d in value.shape)


def _cleanup(model: ir.Model) -> None:
    """Drop what rewriting left unused (old weights, folded constants), keep order valid."""
    remove_unused(model)
    for graph in _graphs(model):
        if graph is model.graph:
            continue
        used = {id(v) for node in graph for v in node.inputs if v is not None}
        used |= {id(v) for v in graph.outputs}
        for name, value in list(graph.initializers.items()):
            if id(value) not in used and not value.uses() and not value.is_graph_output():
                del graph.initializers[name]
    TopologicalSortPass()(model)
