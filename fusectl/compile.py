"""Rule -> onnxscript pattern + our own condition and replacement logic.

This is the only module that imports onnxscript's rewriter, so an upgrade of
its (fast-moving) API touches one file. onnxscript does the structural
matching (ops, wiring, single-consumer intermediates). What ENGINE-NOTES says
we must own lives here: attributes are checked with their schema defaults,
float attributes compare with a tolerance, commuted operands and op
alternatives are expanded into pattern variants, and new initializers come
out unnamed so the driver can give them fresh names.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import math
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
from onnxscript.rewriter import pattern as orp
from onnxscript.rewriter._pattern_ir import GraphPattern

from . import expr
from .errors import RuleFileError
from .rulefile import Rule
from .shapes import infer_node
from .statements import EACH, Literal, NodeSpec, OpRef, Ref
from .targets import ONNXRUNTIME_DEFAULT_DOMAIN_OPS

COMMUTATIVE = frozenset(
    {"Add", "Mul", "Max", "Min", "Sum", "Mean", "And", "Or", "Xor", "Equal",
     "BitwiseAnd", "BitwiseOr", "BitwiseXor"}
)
MAX_VARIANTS = 256
OMITTED = "_"
"""A replace output named ``_`` is an omitted optional output (``z, _, _, s = Op(...)``)."""
LITERAL_RTOL = 1e-5
LITERAL_ATOL = 1e-7
OVERLOAD_IR_VERSION = 10
"""Function overloads (several bodies for one fused-kernel op) exist from IR version 10."""


class NoRewrite(Exception):  # noqa: N818 - a control-flow signal
    """A structural match that the rule's conditions reject; carries the reason."""


@dataclass
class Rewrite:
    """A verified match and the subgraph that replaces it (not yet in the graph)."""

    rule_id: str
    root: ir.Node
    matched_nodes: list[ir.Node]
    old_outputs: list[ir.Value]
    new_outputs: list[ir.Value]
    new_nodes: list[ir.Node]
    new_initializers: list[ir.Value]
    aliases: dict[int, bool] = field(default_factory=dict)
    """Indices of outputs replaced by an existing value (``y = x``), not a new one."""
    opsets: dict[str, int] = field(default_factory=dict)
    name_hints: dict[int, str] = field(default_factory=dict)
    """Index of new node -> name of the matched node whose place it takes."""
    functions: list[ir.Function] = field(default_factory=list)
    """Local functions the new nodes call (fused kernels)."""


@dataclass
class _Variant:
    rule: Rule
    specs: tuple[NodeSpec, ...]
    combo: tuple[tuple[OpRef, bool], ...]
    """The op each spec matches in this variant, and whether its operands are swapped."""
    root_op: OpRef
    expects: tuple[_Expect, ...] = ()
    """What the root's inputs must be produced by, down the whole pattern: checked before
    onnxscript's matcher, which costs fifty times more to say no."""
    paths: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Pattern input name -> input indices leading to it from the root (first path)."""
    aliases: tuple[tuple[str, str], ...] = ()
    """Names this variant reads as another value (bare-name alternatives, ``s = x``)."""
    _built: tuple[orp.Pattern, dict[int, Any], dict[str, float | int]] | None = None

    @property
    def pattern(self) -> orp.Pattern:
        """onnxscript's pattern, built on first use: most variants of a run never get
        past ``may_match``, and building costs more than everything else about them."""
        return self.build()[0]

    @property
    def node_of_spec(self) -> dict[int, Any]:
        """Spec index -> the pattern's NodePattern."""
        return self.build()[1]

    @property
    def literal_vars(self) -> dict[str, float | int]:
        """Internal var name -> the literal the pattern reads there."""
        return self.build()[2]

    def build(self) -> tuple[orp.Pattern, dict[int, Any], dict[str, float | int]]:
        if self._built is None:
            self._built = _onnxscript_pattern(self.rule, self.specs, self.combo)
        return self._built

    def may_match(self, node: ir.Node) -> bool:
        return _fits(node, self.expects)


@dataclass(frozen=True)
class _Expect:
    """A pattern node as seen from its consumer: the consumer's input ``index`` must be
    produced by ``domain::op_type`` whose own inputs meet ``inputs``. ``uses`` is how often
    the pattern reads that value: more readers outside make the match fail (its node could
    not be removed), unless the rule keeps intermediates (None)."""

    index: int
    domain: str
    op_type: str
    uses: int | None
    inputs: tuple[_Expect, ...]


def _fits(node: ir.Node, expects: tuple[_Expect, ...]) -> bool:
    """Whether ``node``'s producers have the ops (and at most the readers) the pattern
    needs: a necessary condition for onnxscript's match, at a fiftieth of its cost."""
    inputs = node.inputs
    for expect in expects:
        if expect.index >= len(inputs):
            return False
        value = inputs[expect.index]
        producer = value.producer() if value is not None else None
        if producer is None or producer.op_type != expect.op_type \
                or producer.domain != expect.domain:
            return False
        if expect.uses is not None and len(value.uses()) > expect.uses:  # type: ignore[union-attr]
            return False
        if expect.inputs and not _fits(producer, expect.inputs):
            return False
    return True


class CompiledRule:
    """A rule ready to match: pattern variants plus our checks and replacement."""

    def __init__(self, rule: Rule, *, lazy: bool = False) -> None:
        """``lazy`` builds the pattern variants on first use: a run over a CNN needs the
        conv rules, not the attention ones (the built-in library is tested, so nothing is
        left to report at load time)."""
        self.rule = rule
        self.root_ops: frozenset[tuple[str, str]] = _root_ops(rule)
        """(domain, op_type) of the nodes a match can be rooted at: the op producing the
        rule's outputs. The rewrite loop skips a rule whose root ops a graph lacks."""
        self._variants: list[_Variant] | None = None
        self._lazy = lazy
        if not lazy:
            _ = self.variants_by_root

    @property
    def variants(self) -> list[_Variant]:
        if self._variants is None:
            self._variants = _build_variants(self.rule, eager=not self._lazy)
        return self._variants

    @functools.cached_property
    def variants_by_root(self) -> dict[tuple[str, str], list[_Variant]]:
        by_root: dict[tuple[str, str], list[_Variant]] = {}
        for variant in self.variants:
            root = (variant.root_op.domain, variant.root_op.op_type)
            by_root.setdefault(root, []).append(variant)
        return by_root

    @functools.cached_property
    def reach(self) -> int | None:
        """How many producer hops above a root node a match and its checks read, or None
        when they may read further (a far-reaching function): the rewrite loop re-tries
        the rule at a node only when something this close to it changed. A pattern of n
        nodes is at most n - 1 hops deep; its inputs' producers (whose op, constness and
        readers conditions may read) are one hop more. A sibling group's shared value is
        one of those inputs: a sibling coming or going stamps its producer (or, when it
        has none, its readers)."""
        rule = self.rule
        expressions = [c.expression for c in rule.where] + [b.expression for b in rule.let]
        expressions += [b.expression for b in rule.merge]
        expressions += self.attr_expressions.values()
        if rule.group is not None:
            expressions += [*rule.group.key, *filter(None, [rule.group.order])]
        if any(e.may_call(expr.FAR_REACHING) for e in expressions):
            return None
        return max(len(specs) for specs in rule.match_variants or (rule.match,))

    @functools.cached_property
    def replace_options(self) -> dict[int, list[list[NodeSpec]]]:
        """Replace statement number -> the specs of each of its alternatives, in order."""
        options: dict[int, list[list[NodeSpec]]] = {}
        for spec in self.rule.replace:
            if spec.choice is not None:
                statement, option = spec.choice
                alternatives = options.setdefault(statement, [])
                if option == len(alternatives):
                    alternatives.append([])
                alternatives[option].append(spec)
        return options

    @functools.cached_property
    def attr_expressions(self) -> dict[tuple[int, str], expr.Expression]:
        # Names were checked when the rule file was loaded; parse each expression once.
        return {
            (spec.index, attr.name): expr.parse(attr.text, None)
            for spec in self.rule.replace for attr in spec.attrs
        }

    @property
    def id(self) -> str:
        return self.rule.id

    def skip_reason(self, model: ir.Model, target: str | Sequence[str]) -> str | None:
        """Why this rule cannot run on this model and target(s), or None.

        ``target`` may name several: a target file's own name and its base target.
        """
        active = (target,) if isinstance(target, str) else tuple(target)
        targets = self.rule.when.targets
        if "any" not in targets and not set(active) & set(targets):
            return f"rule is for target {', '.join(targets)}, not {' + '.join(active)}"
        for domain, opset_range in self.rule.when.opsets:
            version = model.opset_imports.get(domain)
            if version is None and domain == "":
                version = model.opset_imports.get("ai.onnx")
            if version is None:
                return f"model does not import domain {domain or 'ai.onnx'!r}"
            if not opset_range.allows(version):
                dom = domain or "ai.onnx"
                return f"needs {dom} opset {opset_range.text}, model has {version}"
        return None

    def find(self, model: ir.Model, graph: ir.Graph | ir.Function, node: ir.Node
             ) -> Rewrite | None:
        """Try every variant rooted at ``node``; raise NoRewrite if a condition said no."""
        reason: str | None = None
        for variant, match in self._structural_matches(model, graph, node):
            try:
                return self._rewrite(model, graph, node, variant, match)
            except NoRewrite as exc:
                reason = reason or str(exc)  # the variant as written, not a commuted one
        if reason is not None:
            raise NoRewrite(reason)
        return None

    def could_match(self, node: ir.Node) -> bool:
        """Whether some variant's op tree fits at ``node`` (cheap; ``find`` may still say
        no)."""
        return any(variant.may_match(node)
                   for variant in self.variants_by_root.get((node.domain, node.op_type), ()))

    def _structural_matches(self, model: ir.Model, graph: ir.Graph | ir.Function,
                            node: ir.Node) -> Iterator[tuple[_Variant, Any]]:
        """The variants rooted at ``node``'s op whose structure matches there."""
        kept = self.rule.kept
        for variant in self.variants_by_root.get((node.domain, node.op_type), ()):
            if not variant.may_match(node):
                continue
            match = variant.pattern.match(model, graph, node,
                                          check_nodes_are_removable=not kept)
            if match and (not kept or _only_kept_escape(match, self.rule)):
                yield variant, match

    # ----------------------------------------------------------- after a match
    def _rewrite(self, model: ir.Model, graph: ir.Graph | ir.Function, root: ir.Node,
                 variant: _Variant, match: Any) -> Rewrite:
        env, producer_of = self._bind(model, graph, variant, match)
        opsets = _opsets(model, graph)
        if self.rule.fuse is not None:
            return _build_fused(self, model, graph, root, match, env)
        return _build_replacement(self, model, graph, root, match, env, producer_of, opsets)

    def _bind(self, model: ir.Model, graph: ir.Graph | ir.Function, variant: _Variant,
              match: Any) -> tuple[dict[str, Any], dict[str, ir.Node]]:
        """Check attributes, literals, ``where``; evaluate ``let``. Raises NoRewrite."""
        rule = self.rule
        env: dict[str, Any] = {}
        opsets = _opsets(model, graph)
        producer_of: dict[str, ir.Node] = {}
        for spec in variant.specs:
            node = match.node_bindings[variant.node_of_spec[spec.index]]
            if len(spec.outputs) > 1 and len(node.outputs) != len(spec.outputs):
                # onnxscript matches outputs by position only: a three-way Split must not
                # match a two-output pattern (its third output would be left behind).
                raise NoRewrite(f"{node.op_type} has {len(node.outputs)} outputs, the rule "
                                f"names {len(spec.outputs)}")
            for out in spec.outputs:
                producer_of[out] = node
            version = opsets.get(node.domain, 1)
            for attr in spec.attrs:
                present, value = attribute_value(node, attr.name, version)
                if attr.is_capture:
                    value = None if value is NOT_IN_SCHEMA else value
                    if attr.text in env and not _same(env[attr.text], value):
                        raise NoRewrite(f"attribute capture {attr.text} differs between nodes")
                    env[attr.text] = value
                elif value is NOT_IN_SCHEMA:
                    continue  # e.g. training_mode on an opset-9 BatchNormalization
                elif not present or not _same(value, attr.literal):
                    raise NoRewrite(f"{node.op_type}.{attr.name} is {value!r}, "
                                    f"rule needs {attr.literal!r}")
        bindings = match.bindings  # (a property that checks the match each time)
        for name, literal in variant.literal_vars.items():
            value = bindings.get(name)
            if not _is_literal(value, literal):
                raise NoRewrite(f"an input is not the constant {literal}")
        matched = {id(node) for node in producer_of.values()}
        for name in rule.captures:
            value = bindings.get(name)
            if expr.is_value(value) and id(value.producer()) in matched:
                # Add(y, y) after y = MatMul(..): the capture b of Add(y, b) is y itself,
                # which the replacement removes while reading it.
                raise NoRewrite(f"{name} is a value the match itself produces")
        for name, value in bindings.items():
            if not name.startswith("_"):
                env.setdefault(name, value)
        for name, target in variant.aliases:
            env[name] = env.get(target)
        for name in rule.captures:
            env.setdefault(name, None)
        for condition in rule.where:
            try:
                ok = condition.expression.evaluate(env)
            except expr.NoMatch as exc:
                raise NoRewrite(f"{condition.message} ({exc})") from None
            if not expr._truth(ok):
                raise NoRewrite(condition.message)
        for binding in rule.let:
            try:
                value = binding.expression.evaluate(env)
            except expr.NoMatch as exc:
                raise NoRewrite(f"let {binding.name}: {exc}") from None
            env[binding.name] = _typed(value, binding.expression, env)
        return env, producer_of

    # ----------------------------------------------------------- sibling groups
    def find_groups(self, model: ir.Model, graph: ir.Graph | ir.Function,
                    rejected: Callable[[ir.Node, str], None] | None = None,
                    near: Callable[[ir.Node], bool] | None = None) -> list[Rewrite]:
        """Every group of sibling matches in ``graph``, as disjoint rewrites.

        One match attempt per node (linear): each match is a member, keyed by the
        shared value, the attributes of its nodes and the rule's key expressions.
        A node joins at most one member; groups smaller than ``min`` are dropped.
        ``near``, when given, says which nodes something changed near: only the groups
        around a shared value one of them reads are formed again.
        """
        group = self.rule.group
        assert group is not None
        members: dict[tuple[Any, ...], list[_Member]] = {}
        claimed: set[int] = set()
        candidates = [node for node in graph if (node.domain, node.op_type) in self.root_ops
                      and not self._no_siblings(node)]
        if near is not None:
            candidates = self._around_changes(candidates, near)
        for node in candidates:
            try:
                member = self._member(model, graph, node)
            except NoRewrite as exc:
                if rejected is not None:
                    rejected(node, str(exc))
                continue
            if member is None or any(id(n) in claimed for n in member.nodes):
                continue
            claimed.update(id(n) for n in member.nodes)
            members.setdefault(member.key, []).append(member)
        rewrites = []
        for group_members in members.values():
            if len(group_members) < group.min_size:
                continue
            if group.order is not None:
                group_members.sort(key=lambda m: tuple(np.ravel(np.asarray(m.order, float))))
            try:
                rewrites.append(_build_group(self, model, graph, group_members))
            except NoRewrite as exc:
                if rejected is not None:
                    rejected(group_members[0].root, str(exc))
        return rewrites

    def _shared_values(self, node: ir.Node) -> list[ir.Value | None]:
        """Where each variant rooted at ``node``'s op finds the shared value (None: not
        reachable without matching)."""
        group = self.rule.group
        assert group is not None
        paths = [variant.paths.get(group.shared)
                 for variant in self.variants_by_root.get((node.domain, node.op_type), ())]
        return [_follow(node, path) if path else None for path in paths]

    def _no_siblings(self, node: ir.Node) -> bool:
        """True when the shared value, where every variant rooted here finds it, is read
        by fewer nodes than a group needs: no member could ever join a group, so the
        costly match is skipped (a 100k-node chain has a Conv at every third node)."""
        group = self.rule.group
        assert group is not None
        return all(shared is not None and len(shared.uses()) < group.min_size
                   for shared in self._shared_values(node))

    def _around_changes(self, candidates: list[ir.Node],
                        near: Callable[[ir.Node], bool]) -> list[ir.Node]:
        """The candidates sharing a value with a candidate ``near`` a change: groups
        elsewhere are as they were when the rule last looked (and did not fire)."""
        shared_of = [self._shared_values(node) for node in candidates]
        if any(value is None for values in shared_of for value in values):
            return candidates  # a member whose shared value is unknown: look everywhere
        changed = {id(value) for node, values in zip(candidates, shared_of, strict=True)
                   if near(node) for value in values}
        return [node for node, values in zip(candidates, shared_of, strict=True)
                if any(id(value) in changed for value in values)]

    def _member(self, model: ir.Model, graph: ir.Graph | ir.Function, node: ir.Node
                ) -> _Member | None:
        group = self.rule.group
        assert group is not None
        reason: str | None = None
        for variant, match in self._structural_matches(model, graph, node):
            try:
                env, producer_of = self._bind(model, graph, variant, match)
            except NoRewrite as exc:
                reason = reason or str(exc)
                continue
            shared = env.get(group.shared)
            if not expr.is_value(shared):
                continue
            try:
                extra = tuple(_hashable(k.evaluate(env)) for k in group.key)
            except expr.NoMatch as exc:
                reason = reason or f"group key: {exc}"
                continue
            try:
                order = None if group.order is None else group.order.evaluate(env)
            except expr.NoMatch as exc:
                reason = reason or f"group order: {exc}"
                continue
            nodes = list(match.nodes)
            signature = tuple(sorted((n.domain, n.op_type, _attr_signature(n)) for n in nodes))
            key = (id(shared), signature, extra)
            return _Member(node, nodes, env, producer_of, match, key, order)
        if reason is not None:
            raise NoRewrite(reason)
        return None


def _only_kept_escape(match: Any, rule: Rule) -> bool:
    """Matched nodes are removable when the values leaving the match are its outputs and
    the intermediates ``replace`` produces again (onnxscript's own check allows only the
    outputs)."""
    inside = {id(n) for n in match.nodes}
    leaving = {id(match.bindings[name]) for name in (*rule.outputs, *rule.kept)}
    for node in match.nodes:
        for value in node.outputs:
            if id(value) in leaving:
                continue
            if value.is_graph_output() or any(id(use.node) not in inside
                                              for use in value.uses()):
                return False
    return True


@dataclass
class _Member:
    """One sibling match of a group rule, with its bindings."""

    root: ir.Node
    nodes: list[ir.Node]
    env: dict[str, Any]
    producer_of: dict[str, ir.Node]
    match: Any
    key: tuple[Any, ...]
    order: Any = None


def _hashable(value: Any) -> Any:
    if expr.is_value(value):
        return ("value", id(value))
    if isinstance(value, (np.ndarray, np.generic)):
        array = np.asarray(value)
        return ("array", array.dtype.str, array.shape, array.tobytes())
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(v) for v in value)
    return value


def _attr_signature(node: ir.Node) -> tuple[Any, ...]:
    items = []
    for name, attr in sorted(node.attributes.items()):
        value = attr.value
        if attr.type == ir.AttributeType.TENSOR:  # not isinstance: protocol checks are slow
            value = _hashable(value.numpy())
        elif isinstance(value, (list, tuple)):
            value = tuple(value)
        elif not isinstance(value, (int, float, str, bytes)):
            value = repr(value)
        items.append((name, value))
    return tuple(items)


# ------------------------------------------------------------------- attributes


NOT_IN_SCHEMA = object()
"""An attribute the op's schema (at the model's opset) does not have at all."""


@functools.lru_cache(maxsize=4096)
def _schema_default(domain: str, op_type: str, version: int, name: str) -> tuple[bool, Any]:
    try:
        schema = onnx.defs.get_schema(op_type, version, domain)
    except onnx.defs.SchemaError:
        if domain in ("", "ai.onnx") and op_type in ONNXRUNTIME_DEFAULT_DOMAIN_OPS:
            defaults = ONNXRUNTIME_DEFAULT_DOMAIN_OPS[op_type]
            return (True, defaults[name]) if name in defaults else (False, NOT_IN_SCHEMA)
        return False, None
    attr = schema.attributes.get(name)
    if attr is None:
        return False, NOT_IN_SCHEMA
    if not attr.default_value.name:
        return False, None
    value = onnx.helper.get_attribute_value(attr.default_value)
    return True, _freeze(_plain(value))


def _plain(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, onnx.TensorProto):
        return onnx.numpy_helper.to_array(value)
    return value


def _freeze(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def attribute_value(node: ir.Node, name: str, version: int) -> tuple[bool, Any]:
    """A node's attribute as a plain Python value, falling back to the schema default.

    Returns (known, value): known is False when the node lacks the attribute and
    its schema (at this opset) gives no default.
    """
    attr = node.attributes.get(name)
    if attr is None:
        known, value = _schema_default(node.domain, node.op_type, version, name)
        return known, list(value) if isinstance(value, tuple) else value
    if attr.is_ref():
        return False, None
    kind = attr.type
    if kind in (ir.AttributeType.INTS, ir.AttributeType.FLOATS, ir.AttributeType.STRINGS):
        return True, list(attr.value)
    if kind == ir.AttributeType.TENSOR:
        return True, attr.value.numpy()
    return True, attr.value


def _same(actual: Any, expected: Any) -> bool:
    if isinstance(expected, (list, tuple)) or isinstance(actual, (list, tuple)):
        if not isinstance(actual, (list, tuple)) or not isinstance(expected, (list, tuple)):
            return False
        return len(actual) == len(expected) and all(
            _same(a, e) for a, e in zip(actual, expected, strict=True)
        )
    if isinstance(actual, np.ndarray) or isinstance(expected, np.ndarray):
        return bool(np.array_equal(np.asarray(actual), np.asarray(expected)))
    if isinstance(expected, str) or isinstance(actual, str):
        return actual == expected
    if isinstance(expected, (int, float)) and isinstance(actual, (int, float)):
        return math.isclose(float(actual), float(expected), rel_tol=1e-6, abs_tol=1e-12)
    return actual == expected


def _is_literal(value: Any, literal: float | int) -> bool:
    if not expr.is_value(value):
        return False
    try:
        array = np.asarray(expr.to_array(value), dtype=np.float64)
    except expr.NoMatch:
        return False
    if array.size != 1:
        return False
    return math.isclose(float(array.reshape(())), float(literal), rel_tol=LITERAL_RTOL,
                        abs_tol=LITERAL_ATOL)


class _ModelDtype(np.ndarray):
    """An array whose dtype was taken from the model (a float64 model stays float64)."""


def _typed(value: Any, expression: expr.Expression, env: Mapping[str, Any]) -> Any:
    """Give a let array the dtype of the tensor it was computed from.

    numpy promotes (float16 weights times float32 statistics are float32), but the
    initializer must keep the model's dtype; the first captured tensor the
    expression reads decides, unless the expression casts explicitly.
    """
    if not isinstance(value, (np.ndarray, np.generic)) or expression.explicit_dtype:
        return value
    for name in expression.names_in_order():
        ref = env.get(name)
        if isinstance(ref, list):  # group rules: per-member lists; the first member decides
            ref = next((r for r in ref if r is not None), None)
        dtype = expr.value_dtype(ref) if expr.is_value(ref) else None
        if dtype is None and isinstance(ref, np.ndarray):
            dtype = ref.dtype
        if dtype is not None and dtype.kind in "fc" and np.asarray(value).dtype.kind in "fc":
            return np.asarray(value).astype(dtype).view(_ModelDtype)
        if dtype is not None:
            return np.asarray(value)
    return value


# --------------------------------------------------------------------- variants


def _build_variants(rule: Rule, *, eager: bool = True) -> list[_Variant]:
    combos: list[tuple[tuple[NodeSpec, ...], tuple[tuple[OpRef, bool], ...],
                       tuple[tuple[str, str], ...]]] = []
    variants_specs = rule.match_variants or (rule.match,)
    all_aliases = rule.match_aliases or ((),) * len(variants_specs)
    for specs, aliases in zip(variants_specs, all_aliases, strict=True):
        choices: list[list[tuple[OpRef, bool]]] = []
        for spec in specs:
            swaps = [False, True] if _commutes(spec) else [False]
            choices.append([(op, swap) for op in spec.ops for swap in swaps])
        combos.extend((specs, combo, aliases) for combo in itertools.product(*choices))
        if len(combos) > MAX_VARIANTS:
            raise RuleFileError([(rule.source, f"rule {rule.id}: more than {MAX_VARIANTS} "
                                  "pattern variants (alternatives x commuted operands)")])
    variants = []
    seen: set[tuple[Any, ...]] = set()
    for specs, combo, aliases in combos:
        key = (_pattern_key(specs, combo), aliases)  # `Add(a, b) | Add(b, a)` gives one
        if key in seen:
            continue
        seen.add(key)
        variant = _variant(rule, specs, combo, eager=eager)
        variants.append(dataclasses.replace(variant, aliases=aliases))
    return variants


def _pattern_key(specs: tuple[NodeSpec, ...], combo: tuple[tuple[OpRef, bool], ...]
                 ) -> tuple[Any, ...]:
    """What the pattern of one variant is made of (ops, inputs in matched order,
    attributes, outputs): equal keys build equal patterns, without building them."""
    key = []
    for spec, (op, swap) in zip(specs, combo, strict=True):
        inputs = spec.inputs[::-1] if swap else spec.inputs
        key.append((op, inputs, tuple((a.name, a.text) for a in spec.attrs), spec.outputs))
    return tuple(key)


def _root_ops(rule: Rule) -> frozenset[tuple[str, str]]:
    """The ops of the spec producing the rule's first output, over every match variant
    (every output comes from one node: ``_variant`` refuses anything else)."""
    ops = set()
    for specs in rule.match_variants or (rule.match,):
        for spec in specs:
            if rule.outputs and rule.outputs[0] in spec.outputs:
                ops.update((op.domain, op.op_type) for op in spec.ops)
    return frozenset(ops)


def _commutes(spec: NodeSpec) -> bool:
    return (
        len(spec.inputs) == 2
        and all(op.domain == "" and op.op_type in COMMUTATIVE for op in spec.ops)
        and spec.inputs[0] != spec.inputs[1]
    )


def _variant(rule: Rule, specs: tuple[NodeSpec, ...],
             combo: tuple[tuple[OpRef, bool], ...], *, eager: bool) -> _Variant:
    """One variant; ``eager`` builds onnxscript's pattern now (rules not tested by the
    library: a pattern onnxscript refuses is reported when the rule file is loaded)."""
    producers = [i for i, spec in enumerate(specs)
                 if any(name in spec.outputs for name in rule.outputs)]
    if eager or len(producers) != 1:
        _onnxscript_pattern(rule, specs, combo)  # raises what onnxscript refuses
    root_index = producers[0]
    variant = _Variant(rule, specs, combo, combo[root_index][0],
                       _expects(specs, combo, root_index, counted=not rule.kept),
                       _input_paths(specs, combo, root_index))
    if eager:
        variant.build()
    return variant


def _onnxscript_pattern(rule: Rule, specs: tuple[NodeSpec, ...],
                        combo: tuple[tuple[OpRef, bool], ...]
                        ) -> tuple[orp.Pattern, dict[int, Any], dict[str, float | int]]:
    builder = orp.OpsetPatternBuilder("", record=True)
    values: dict[str, Any] = {}
    literal_vars: dict[str, float | int] = {}
    optional = {i.name for s in specs for i in s.inputs if isinstance(i, Ref) and i.optional}
    inputs: list[Any] = []

    def value_for(item: Any) -> Any:
        if item is None:
            return None
        if isinstance(item, Literal):
            name = f"_lit{len(literal_vars)}"
            literal_vars[name] = item.value
            var = orp.Var(name)
            inputs.append(var)
            return var
        if item.name not in values:
            var = orp.Var(item.name, can_match_none=item.name in optional)
            values[item.name] = var
            inputs.append(var)
        return values[item.name]

    node_of_spec: dict[int, Any] = {}
    for spec, (op, swap) in zip(specs, combo, strict=True):
        args = [value_for(i) for i in spec.inputs]
        if swap:
            args = [args[1], args[0]]
        outs = builder.__getattr__(op.op_type)(
            *args,
            _domain=op.domain,
            _outputs=[None if o.startswith("%") else o for o in spec.outputs],
            _allow_other_attributes=True,
        )
        outs = outs if isinstance(outs, (list, tuple)) else [outs]
        for name, out in zip(spec.outputs, outs, strict=True):
            values[name] = out
        node_of_spec[spec.index] = builder.nodes()[-1]
    outputs = [values[name] for name in rule.outputs]
    graph_pattern = orp_graph_pattern(inputs, outputs, builder.nodes())
    if len(graph_pattern.output_nodes) != 1:
        raise RuleFileError([(rule.source, f"rule {rule.id}: outputs come from several "
                              "unconnected nodes; such patterns are not supported yet")])
    return orp.Pattern(graph_pattern, name=rule.id), node_of_spec, literal_vars


def _input_paths(specs: tuple[NodeSpec, ...], combo: tuple[tuple[OpRef, bool], ...],
                 root_index: int) -> dict[str, tuple[int, ...]]:
    """For each pattern input, the input indices to follow from the root node to reach it
    (through producers), as this variant orders commuted operands."""
    producer = {name: i for i, spec in enumerate(specs) for name in spec.outputs}
    paths: dict[str, tuple[int, ...]] = {}
    frontier = [(root_index, ())]
    while frontier:
        index, path = frontier.pop(0)
        inputs = list(specs[index].inputs)
        if combo[index][1]:
            inputs[0], inputs[1] = inputs[1], inputs[0]
        for position, item in enumerate(inputs):
            if not isinstance(item, Ref):
                continue
            if item.name in producer:
                frontier.append((producer[item.name], (*path, position)))
            else:
                paths.setdefault(item.name, (*path, position))
    return paths


def _follow(node: ir.Node, path: tuple[int, ...]) -> ir.Value | None:
    """The value reached from ``node`` through ``path`` (producers in between), or None."""
    value = None
    for step, position in enumerate(path):
        if step:
            node = value.producer() if value is not None else None  # type: ignore[assignment]
            if node is None:
                return None
        if position >= len(node.inputs):
            return None
        value = node.inputs[position]
    return value


def _expects(specs: tuple[NodeSpec, ...], combo: tuple[tuple[OpRef, bool], ...],
             index: int, *, counted: bool) -> tuple[_Expect, ...]:
    """The producers spec ``index``'s inputs must have in this variant (commuted operands
    swapped), recursively; ``counted``: limit their readers to the pattern's own reads."""
    producer = {name: i for i, spec in enumerate(specs) for name in spec.outputs}
    # Two pattern nodes of one op may match one graph node (``Mul(x, 1.0)`` written twice,
    # one Mul in the model): its value may have the reads of every such node's outputs.
    reads = collections.Counter(combo[producer[item.name]][0] for spec in specs
                                for item in spec.inputs
                                if isinstance(item, Ref) and item.name in producer)

    def expects(at: int) -> tuple[_Expect, ...]:
        inputs = list(specs[at].inputs)
        if combo[at][1]:
            inputs[0], inputs[1] = inputs[1], inputs[0]
        return tuple(
            _Expect(position, combo[producer[item.name]][0].domain,
                    combo[producer[item.name]][0].op_type,
                    reads[combo[producer[item.name]][0]] if counted else None,
                    expects(producer[item.name]))
            for position, item in enumerate(inputs)
            if isinstance(item, Ref) and item.name in producer
        )

    return expects(index)


def orp_graph_pattern(inputs: list[Any], outputs: list[Any], nodes: list[Any]) -> Any:
    """onnxscript builds GraphPatterns from functions; ours come from data."""
    return GraphPattern(inputs, outputs, nodes)


# ------------------------------------------------------------------ replacement


def _opsets(model: ir.Model, graph: ir.Graph | ir.Function) -> dict[str, int]:
    opsets = dict(model.opset_imports)
    opsets.update(graph.opset_imports)
    if "" not in opsets and "ai.onnx" in opsets:
        opsets[""] = opsets["ai.onnx"]
    return opsets


def _attribute(name: str, value: Any, op: OpRef, version: int) -> ir.Attr | None:
    """Build an attribute, using the op schema's declared type when there is one."""
    if value is None:
        return None
    declared = None
    try:
        schema = onnx.defs.get_schema(op.op_type, version, op.domain)
        if name in schema.attributes:
            declared = schema.attributes[name].type
    except onnx.defs.SchemaError:
        pass
    A = onnx.defs.OpSchema.AttrType  # noqa: N806
    if isinstance(value, np.ndarray) and declared not in (A.INTS, A.FLOATS, A.INT, A.FLOAT):
        return ir.AttrTensor(name, ir.tensor(value))
    if isinstance(value, (np.ndarray, np.generic)):
        value = value.tolist()
    if declared == A.FLOAT:
        return ir.AttrFloat32(name, float(value))
    if declared == A.INT:
        return ir.AttrInt64(name, int(value))
    if declared == A.FLOATS:
        return ir.AttrFloat32s(name, [float(v) for v in value])
    if declared == A.INTS:
        return ir.AttrInt64s(name, [int(v) for v in value])
    if declared == A.STRING:
        return ir.AttrString(name, str(value))
    if isinstance(value, bool):
        return ir.AttrInt64(name, int(value))
    if isinstance(value, int):
        return ir.AttrInt64(name, value)
    if isinstance(value, float):
        return ir.AttrFloat32(name, value)
    if isinstance(value, str):
        return ir.AttrString(name, value)
    if isinstance(value, (list, tuple)):
        if all(isinstance(v, (int, bool)) for v in value):
            return ir.AttrInt64s(name, [int(v) for v in value])
        if all(isinstance(v, (int, float)) for v in value):
            return ir.AttrFloat32s(name, [float(v) for v in value])
        if all(isinstance(v, str) for v in value):
            return ir.AttrStrings(name, list(value))
    raise NoRewrite(f"cannot make attribute {name} from {type(value).__name__}")


def _initializer(value: Any) -> ir.Value:
    """Plain Python floats (numpy float64) become float32; arrays typed from the model
    keep its dtype."""
    array = np.asarray(value)
    if array.dtype == np.float64 and not isinstance(value, _ModelDtype):
        array = array.astype(np.float32)
    # ir.Tensor directly: ir.tensor()'s protocol isinstance checks cost 0.2 ms a call.
    tensor = ir.tensor(array) if array.dtype == object else ir.Tensor(array)
    return ir.Value(name=None, type=ir.TensorType(tensor.dtype), shape=ir.Shape(array.shape),
                    const_value=tensor)


def _build_replacement(compiled: CompiledRule, model: ir.Model,
                       graph: ir.Graph | ir.Function, root: ir.Node, match: Any,
                       env: dict[str, Any], producer_of: dict[str, ir.Node],
                       opsets: dict[str, int]) -> Rewrite:
    rule = compiled.rule
    inside = {id(n) for n in match.nodes}
    live = [name for name in rule.kept if _read_outside(match.bindings[name], inside)]
    names = (*rule.outputs, *live)
    old_outputs = [match.bindings[name] for name in names]
    slots = {name: [i] for i, name in enumerate(names)}
    absent = {name for name in rule.kept if name not in live}
    rewrite = _replacement(compiled, root, list(match.nodes), old_outputs, slots, env,
                           producer_of, opsets, absent)
    if live and _feeds_back(rewrite, [match.bindings[name] for name in live], inside):
        raise NoRewrite("an intermediate the replacement writes again feeds its inputs "
                        "(the rewrite would make a cycle)")
    return rewrite


def _read_outside(value: ir.Value, inside: set[int]) -> bool:
    return value.is_graph_output() or any(id(u.node) not in inside for u in value.uses())


def _feeds_back(rewrite: Rewrite, kept: list[ir.Value], inside: set[int]) -> bool:
    """Whether a kept intermediate, which a new node writes again, reaches an input of that
    node (or of the new nodes feeding it) through nodes outside the match (a KV cache's
    present whose Shape sizes the attention's own mask): the node would read its output."""
    new_ids = {id(node) for node in rewrite.new_nodes}
    by_old = dict(zip((id(v) for v in rewrite.old_outputs), rewrite.new_outputs, strict=True))
    for old in kept:
        new = by_old.get(id(old))
        writer = new.producer() if new is not None else None
        if writer is None or id(writer) not in new_ids:
            continue
        wanted: set[int] = set()
        stack, seen_new = [writer], {id(writer)}
        while stack:  # the new nodes the writer depends on, and their outside inputs
            node = stack.pop()
            for value in node.inputs:
                producer = value.producer() if value is not None else None
                if producer is not None and id(producer) in new_ids:
                    if id(producer) not in seen_new:
                        seen_new.add(id(producer))
                        stack.append(producer)
                elif value is not None:
                    wanted.add(id(value))
        wanted -= _upstream_inputs(old, inside)
        if wanted and _reaches(old, wanted, inside):
            return True
    return False


def _upstream_inputs(value: ir.Value, inside: set[int]) -> set[int]:
    """The values the matched nodes producing ``value`` read, transitively within the match:
    they come before ``value``, so it cannot flow into them (transpose-cancel's ``x``: no walk
    over everything downstream, which made long chains quadratic)."""
    found: set[int] = set()
    producer = value.producer()
    stack = [producer] if producer is not None and id(producer) in inside else []
    seen = {id(n) for n in stack}
    while stack:
        node = stack.pop()
        for item in node.inputs:
            if item is None:
                continue
            found.add(id(item))
            source = item.producer()
            if source is not None and id(source) in inside and id(source) not in seen:
                seen.add(id(source))
                stack.append(source)
    return found


def _reaches(start: ir.Value, wanted: set[int], inside: set[int]) -> bool:
    """Whether ``start`` flows into a value of ``wanted`` through nodes outside the match."""
    seen: set[int] = set()
    stack = [start]
    while stack:
        value = stack.pop()
        if id(value) in wanted:
            return True
        for use in value.uses():
            node = use.node
            if id(node) in inside or id(node) in seen:
                continue
            seen.add(id(node))
            stack.extend(node.outputs)
    return False


def _build_group(compiled: CompiledRule, model: ir.Model, graph: ir.Graph | ir.Function,
                 members: list[_Member]) -> Rewrite:
    """One replacement for a whole sibling group: ``merge`` sees per-member lists."""
    rule = compiled.rule
    group = rule.group
    assert group is not None
    env: dict[str, Any] = {group.shared: members[0].env[group.shared]}
    for name in (*rule.captures, *(b.name for b in rule.let)):
        if name != group.shared:
            env[name] = [m.env.get(name) for m in members]
    for binding in rule.merge:
        try:
            value = binding.expression.evaluate(env)
        except expr.NoMatch as exc:
            raise NoRewrite(f"merge {binding.name}: {exc}") from None
        env[binding.name] = _typed(value, binding.expression, env)
    old_outputs: list[ir.Value] = []
    slots: dict[str, list[int]] = {name: [] for name in rule.outputs}
    for member in members:
        for name in rule.outputs:
            slots[name].append(len(old_outputs))
            old_outputs.append(member.match.bindings[name])
    nodes = [n for m in members for n in m.nodes]
    return _replacement(compiled, members[0].root, nodes, old_outputs, slots, env,
                        members[0].producer_of, _opsets(model, graph))


def _replacement(compiled: CompiledRule, root: ir.Node, matched: list[ir.Node],
                 old_outputs: list[ir.Value], slots: dict[str, list[int]],
                 env: dict[str, Any], producer_of: dict[str, ir.Node],
                 opsets: dict[str, int], absent: Collection[str] = ()) -> Rewrite:
    """Build the replace statements; ``slots`` maps each match output to its positions
    in ``old_outputs`` (one per group member; exactly one outside groups). Outputs
    named ``_``, and kept intermediates nobody outside reads (``absent``), are left
    empty: an omitted optional output, which the kernel does not write."""
    rule = compiled.rule
    available: dict[str, ir.Value | None] = {}
    for name in rule.captures:
        value = env.get(name)
        if value is None or expr.is_value(value):
            available[name] = value
    new_nodes: list[ir.Node] = []
    new_initializers: list[ir.Value] = []
    used_opsets = dict(rule.when.imports)
    name_hints: dict[int, str] = {}
    made: dict[str, ir.Value] = {}
    new_outputs: list[ir.Value | None] = [None] * len(old_outputs)
    aliases: dict[int, bool] = {}

    def resolve(item: Any) -> ir.Value | None:
        if item is None:
            return None
        if item.name in made:
            return made[item.name]
        if item.name in available:
            return available[item.name]
        value = env.get(item.name)
        if expr.is_value(value) or value is None:
            return value
        if isinstance(value, (bool, int, float, list, tuple, np.ndarray, np.generic)):
            init = _initializer(value)
            init.name = item.name  # a hint; the driver makes it unique
            new_initializers.append(init)
            made[item.name] = init
            return init
        raise NoRewrite(f"{item.name} is not a tensor")

    def present(option: list[NodeSpec]) -> bool:
        inside = {out for spec in option for out in spec.outputs}
        return all(spec.alias or item.name in inside or resolve(item) is not None
                   for spec in option for item in spec.inputs if isinstance(item, Ref))

    chosen: dict[int, int] = {}
    for spec in rule.replace:
        if spec.choice is not None:
            statement, option = spec.choice
            if statement not in chosen:
                options = compiled.replace_options[statement]
                first = next((i for i, specs in enumerate(options) if present(specs)), None)
                if first is None:
                    raise NoRewrite(f"replace statement {statement}: every alternative reads "
                                    "an absent value")
                chosen[statement] = first
            if option != chosen[statement]:
                continue
        op = spec.op
        if spec.same_op_as is not None:
            source = producer_of[spec.same_op_as]
            op = OpRef(source.domain, source.op_type)
        version = opsets.get(op.domain, dict(used_opsets).get(op.domain, 1))
        inputs = [resolve(i) for i in spec.inputs]
        targets = _targets(spec, slots)
        if spec.alias and (inputs[0] is None or not targets):  # ``b = Expand(m, e) | m``
            made[spec.outputs[0]] = inputs[0]  # type: ignore[assignment]
            continue
        while inputs and inputs[-1] is None:
            inputs.pop()
        if op.domain == "" and op.op_type == "Identity" and len(inputs) == 1 and inputs[0]:
            if targets and any(inputs[0] is out for node in new_nodes for out in node.outputs):
                for slot in targets:  # a value built here takes the output's place (and name)
                    new_outputs[slot] = inputs[0]
                continue
            kept = [t for t in targets if old_outputs[t].is_graph_output()]
            for slot in targets:
                if slot not in kept:
                    new_outputs[slot] = inputs[0]
                    aliases[slot] = True
            if targets and not kept:
                continue
            if targets:  # a graph output keeps its name through one Identity each
                for slot in kept:
                    node = ir.Node("", "Identity", inputs, num_outputs=1)
                    new_outputs[slot] = node.outputs[0]
                    name_hints[len(new_nodes)] = root.name or ""
                    new_nodes.append(node)
                continue
        attrs: dict[str, ir.Attr] = {}
        if spec.copy_attrs_from:
            source = producer_of[spec.copy_attrs_from]
            attrs.update({k: v for k, v in source.attributes.items()})
        for attr_spec in spec.attrs:
            parsed = compiled.attr_expressions[(spec.index, attr_spec.name)]
            try:
                value = parsed.evaluate(env)
            except expr.NoMatch as exc:
                raise NoRewrite(f"attribute {attr_spec.name}: {exc}") from None
            built = _attribute(attr_spec.name, value, op, version)
            if built is None:
                attrs.pop(attr_spec.name, None)
            else:
                attrs[attr_spec.name] = built
        count = len(targets) if targets else len(spec.outputs)
        node = ir.Node(op.domain, op.op_type, inputs, attributes=list(attrs.values()),
                       num_outputs=count)
        if targets:
            for slot, value in zip(targets, node.outputs, strict=True):
                new_outputs[slot] = value
        else:
            for out_name, value in zip(spec.outputs, node.outputs, strict=True):
                if out_name == OMITTED:
                    value.name = ""
                    continue
                made[out_name] = value
                for slot in slots.get(out_name, ()):
                    new_outputs[slot] = value
                if out_name in producer_of:
                    name_hints[len(new_nodes)] = producer_of[out_name].name or ""
        if len(new_nodes) not in name_hints:
            name_hints[len(new_nodes)] = root.name or ""
        if op.domain not in opsets:
            used_opsets.setdefault(op.domain, 1)
        new_nodes.append(node)
    for name in absent:
        if name in made and not made[name].uses():
            made[name].name = ""
    new_nodes, name_hints = _without_dead_nodes(new_nodes, name_hints)
    for index, value in enumerate(new_outputs):
        if value is None:
            raise NoRewrite(f"replacement output {old_outputs[index].name} is absent")
    if _scalar_raises_rank(matched):
        _check_output_shapes(new_nodes, old_outputs, new_outputs, {**used_opsets, **opsets})
    return Rewrite(rule.id, root, matched, old_outputs, new_outputs,  # type: ignore[arg-type]
                   new_nodes, new_initializers, aliases, used_opsets, name_hints)


def _scalar_raises_rank(nodes: Iterable[ir.Node]) -> bool:
    """Whether a matched node reads a one-element constant of higher rank than its other
    inputs: the one way a rule's ``size(c) == 1`` scale or fill changes the matched output's
    shape by broadcasting. Inferring every replacement instead costs 80% more rewrite time."""
    for node in nodes:
        ranks = [len(v.shape) for v in node.inputs
                 if v is not None and v.shape is not None and v.const_value is None]
        for value in node.inputs:
            tensor = None if value is None else value.const_value
            if tensor is not None and tensor.size == 1 and ranks and len(tensor.shape) > max(ranks):
                return True
    return False


def _check_output_shapes(new_nodes: list[ir.Node], old_outputs: Sequence[ir.Value],
                         new_outputs: Sequence[ir.Value | None],
                         opsets: Mapping[str, int]) -> None:
    """Refuse a replacement that gives an output another rank or other static dims than the
    match did (a one-element scale of rank 5 in ``Mul(s, c)`` makes the matched scores 5-D,
    the fused op's output 4-D). Checked here once for every rule, on the shapes inference
    gives the new nodes; an output it cannot type is not checked."""
    if all(old.shape is None for old in old_outputs):
        return
    for node in new_nodes:
        if any(out.shape is None for out in node.outputs):
            infer_node(node, opsets)
    for old, new in zip(old_outputs, new_outputs, strict=True):
        if old.shape is None or new is None or new.shape is None:
            continue
        if len(old.shape) != len(new.shape) or any(
                isinstance(a, int) and isinstance(b, int) and a != b
                for a, b in zip(old.shape, new.shape, strict=True)):
            raise NoRewrite(f"the replacement would make {old.name} {list(new.shape)}, "
                            f"not {list(old.shape)}")


def _without_dead_nodes(nodes: list[ir.Node], hints: dict[int, str]
                        ) -> tuple[list[ir.Node], dict[int, str]]:
    """Drop new nodes whose every output is omitted and unread (an intermediate written
    again for readers outside the match, when there are none): left in the graph until
    the final cleanup, they would read values of later matches and block them."""
    kept_nodes: list[ir.Node] = []
    kept_hints: dict[int, str] = {}
    for index, node in enumerate(nodes):
        if all(v.name == "" and not v.uses() for v in node.outputs):
            for position in range(len(node.inputs)):
                node.replace_input_with(position, None)
            continue
        if index in hints:
            kept_hints[len(kept_nodes)] = hints[index]
        kept_nodes.append(node)
    return kept_nodes, kept_hints


def _targets(spec: NodeSpec, slots: dict[str, list[int]]) -> list[int]:
    """Output slots a statement fills: ``y...`` (every member's y) or a plain match output
    whose single producer is this statement (``y = Identity(x)``)."""
    out = spec.outputs[0]
    if out.endswith(EACH):
        return list(slots[out[: -len(EACH)]])
    if spec.op.domain == "" and spec.op.op_type == "Identity" and len(spec.outputs) == 1:
        return list(slots.get(out, ()))
    return []


# ------------------------------------------------------------------ fused kernels


def _build_fused(compiled: CompiledRule, model: ir.Model, graph: ir.Graph | ir.Function,
                 root: ir.Node, match: Any, env: dict[str, Any]) -> Rewrite:
    """One node of the fused-kernel op; its meaning is a local function cloned from the
    matched nodes, so onnxruntime (which inlines functions) still runs and checks it."""
    rule = compiled.rule
    op = rule.fuse
    assert op is not None
    nodes = _in_graph_order(graph, list(match.nodes))
    produced = {id(v) for n in nodes for v in n.outputs}
    inputs: list[ir.Value] = []
    for node in nodes:
        for value in node.inputs:
            if value is not None and id(value) not in produced and value not in inputs:
                inputs.append(value)
    old_outputs = [match.bindings[name] for name in rule.outputs]
    function = _function_of(op, nodes, inputs, old_outputs, _opsets(model, graph))
    existing = _same_function(model, function)
    if existing is None:
        function.overload = _free_overload(model, op, function)
    else:
        function = existing
    node = ir.Node(op.domain, op.op_type, inputs, num_outputs=len(old_outputs),
                   overload=function.overload)
    opsets = dict(rule.when.imports)
    opsets.setdefault(op.domain, 1)
    rewrite = Rewrite(rule.id, root, nodes, old_outputs, list(node.outputs), [node], [],
                      {}, opsets, {0: root.name or ""})
    if existing is None:
        rewrite.functions.append(function)
    return rewrite


def _in_graph_order(graph: ir.Graph | ir.Function, nodes: list[ir.Node]) -> list[ir.Node]:
    wanted = {id(n) for n in nodes}
    return [n for n in graph if id(n) in wanted]


def _function_of(op: OpRef, nodes: list[ir.Node], inputs: list[ir.Value],
                 outputs: list[ir.Value], opsets: dict[str, int]) -> ir.Function:
    """Clone ``nodes`` into a function body with formal inputs ``x0..`` and outputs ``y0..``."""
    mapping: dict[int, ir.Value] = {}
    formal_inputs = []
    for index, value in enumerate(inputs):
        formal = ir.Value(name=f"x{index}")
        mapping[id(value)] = formal
        formal_inputs.append(formal)
    body = []
    counter = itertools.count()
    for node in nodes:
        clone = ir.Node(node.domain, node.op_type,
                        [None if v is None else mapping[id(v)] for v in node.inputs],
                        attributes=list(node.attributes.values()),
                        num_outputs=len(node.outputs), name=f"n{len(body)}")
        for old, new in zip(node.outputs, clone.outputs, strict=True):
            new.name = f"t{next(counter)}"
            mapping[id(old)] = new
        body.append(clone)
    formal_outputs = []
    for index, value in enumerate(outputs):
        formal = mapping[id(value)]
        formal.name = f"y{index}"
        formal_outputs.append(formal)
    used = {n.domain for n in nodes}
    imports = {d: opsets.get(d, 1) for d in used}
    graph = ir.Graph(formal_inputs, formal_outputs, nodes=body, opset_imports=imports,
                     name=op.op_type)
    return ir.Function(op.domain, op.op_type, graph=graph, attributes=[])


def _function_key(function: ir.Function) -> str:
    proto = ir.serde.serialize_function(function)
    proto.overload = ""
    return proto.SerializeToString(deterministic=True).hex()


def _same_function(model: ir.Model, function: ir.Function) -> ir.Function | None:
    key = _function_key(function)
    for existing in model.functions.values():
        if (existing.domain, existing.name) == (function.domain, function.name) and \
                _function_key(existing) == key:
            return existing
    return None


def _free_overload(model: ir.Model, op: OpRef, function: ir.Function) -> str:
    """The first body of a kernel has no overload; later different bodies get ``v2``...
    Overloads need IR version 10, so the model is raised to it when a second body appears."""
    taken = {f.overload for f in model.functions.values()
             if (f.domain, f.name) == (op.domain, op.op_type)}
    if "" not in taken:
        return ""
    model.ir_version = max(model.ir_version, OVERLOAD_IR_VERSION)
    index = 2
    while f"v{index}" in taken:
        index += 1
    return f"v{index}"


def compile_rules(rules: Iterable[Rule], *, lazy: Iterable[Rule] = ()) -> list[CompiledRule]:
    """Compile every rule; problems are collected and raised together. Rules in ``lazy``
    (the tested built-in library) build their patterns on first use."""
    compiled, problems = [], []
    deferred = {id(rule) for rule in lazy}
    for rule in rules:
        try:
            compiled.append(CompiledRule(rule, lazy=id(rule) in deferred))
        except RuleFileError as exc:
            problems.extend(exc.problems)
    if problems:
        raise RuleFileError(problems)
    return compiled
