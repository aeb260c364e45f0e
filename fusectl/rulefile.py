"""Rule files (YAML, ``version: 1``) -> frozen Rule objects, with every error at once.

YAML is composed (not constructed) so that each value keeps its line number,
only plain YAML types are accepted (no tags, no anchors or aliases, no
duplicate keys), unknown keys are errors, and statements and expressions are
parsed and name-checked here so that a bad rule fails at load time with
``file:line`` rather than at match time.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from . import expr, rulecache
from .errors import RuleFileError, SourceSpan, first_line
from .statements import (
    EACH,
    NodeSpec,
    OpRef,
    Ref,
    StatementError,
    alias_of,
    op_ref,
    parse_statements,
    split_alternatives,
)

RULE_ID = re.compile(r"[a-z0-9](?:[a-z0-9-]*[a-z0-9])?")
TARGETS = ("onnx", "onnxruntime")
MAX_FILE_BYTES = 4 << 20
_STANDARD_TAGS = {
    "tag:yaml.org,2002:str",
    "tag:yaml.org,2002:int",
    "tag:yaml.org,2002:float",
    "tag:yaml.org,2002:bool",
    "tag:yaml.org,2002:null",
    "tag:yaml.org,2002:map",
    "tag:yaml.org,2002:seq",
}


# ---------------------------------------------------------------------------- model


@dataclass(frozen=True)
class OpsetRange:
    """``>=13,<18`` style constraint on one domain's opset version."""

    text: str
    bounds: tuple[tuple[str, int], ...]

    def allows(self, version: int) -> bool:
        ops = {
            ">=": version.__ge__,
            ">": version.__gt__,
            "<=": version.__le__,
            "<": version.__lt__,
            "==": version.__eq__,
            "!=": version.__ne__,
        }
        return all(ops[op](bound) for op, bound in self.bounds)


@dataclass(frozen=True)
class When:
    """When a rule applies: opset ranges per domain, targets, extra opset imports."""

    opsets: tuple[tuple[str, OpsetRange], ...] = ()
    targets: tuple[str, ...] = ("any",)
    imports: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class Condition:
    """One ``where`` entry: an expression that must hold, and the message if not."""

    expression: expr.Expression
    message: str
    line: int


@dataclass(frozen=True)
class LetBinding:
    """One ``let`` entry: a name bound to an expression evaluated after a match."""

    name: str
    expression: expr.Expression
    line: int


@dataclass(frozen=True)
class Expect:
    """What an embedded test expects after applying its rule."""

    fires: int | None = None
    ops: tuple[tuple[str, int], ...] = ()
    nodes: int | None = None


@dataclass(frozen=True)
class RuleTest:
    """An embedded test: an ONNX-text model, initializer ranges and expectations."""

    name: str
    model: str
    expect: Expect
    init: tuple[tuple[str, Any], ...] = ()
    rtol: float | None = None
    atol: float | None = None
    line: int = 0
    fold: bool = True
    """False: skip constant folding, for rules whose pattern the folder would remove
    first (the rule still matters with --no-fold or where shapes appear only later)."""


@dataclass(frozen=True)
class Group:
    """A sibling-group rule: every match consuming ``shared`` is one member; members
    whose attributes and ``key`` values agree are replaced together."""

    shared: str
    min_size: int = 2
    key: tuple[expr.Expression, ...] = ()
    line: int = 0
    require_saving: bool = True
    """Apply only when the merge moves fewer bytes than its members (traffic model)."""
    order: expr.Expression | None = None
    """Members are sorted by this per-member value before ``merge`` (graph order if None)."""


@dataclass(frozen=True)
class TargetSpec:
    """A target file's header: the custom domain its fused kernels live in."""

    name: str
    domain: str
    opset: int = 1
    base: str = "onnx"
    kernels: tuple[tuple[str, str], ...] = ()
    file: str = "<memory>"


@dataclass(frozen=True)
class Rule:
    """A loaded, checked rule; the compiler turns it into a rewrite rule."""

    id: str
    summary: str
    match: tuple[NodeSpec, ...]
    replace: tuple[NodeSpec, ...]
    where: tuple[Condition, ...] = ()
    let: tuple[LetBinding, ...] = ()
    when: When = When()
    tests: tuple[RuleTest, ...] = ()
    captures: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    file: str = "<memory>"
    line: int = 0
    match_variants: tuple[tuple[NodeSpec, ...], ...] = ()
    """Every combination of statement alternatives (``A(x) | B(x)``), each a full pattern."""
    match_aliases: tuple[tuple[tuple[str, str], ...], ...] = ()
    """Per match variant: (name, value) pairs of bare-name alternatives (``s = x``)."""
    match_text: tuple[str, ...] = field(default=(), compare=False)
    replace_text: tuple[str, ...] = field(default=(), compare=False)
    group: Group | None = None
    merge: tuple[LetBinding, ...] = ()
    """Group rules: evaluated once per group; per-member names read as lists."""
    fuse: OpRef | None = None
    """Replace the match by one node of this op plus a local function holding the match."""
    kept: tuple[str, ...] = ()
    """Intermediates of the match that ``replace`` produces again (e.g. the residual sum a
    skip-norm kernel also writes): they may have consumers outside the match."""
    opt_in: str = ""
    """Why the rule is off unless selected by name (``--rule``): e.g. a fused kernel measured
    slower than the ops it replaces on the runtime people mostly deploy on. Empty: on."""

    @property
    def source(self) -> SourceSpan:
        return SourceSpan(self.file, self.line)


# ------------------------------------------------------------------------ yaml layer


@dataclass
class _Node:
    """A YAML value with its line (1-based)."""

    value: Any
    line: int
    key_lines: dict[str, int] = field(default_factory=dict)


class _Problems:
    def __init__(self, file: str) -> None:
        self.file = file
        self.items: list[tuple[SourceSpan | None, str]] = []
        self.refused: set[int] = set()
        """Lines where a YAML tag or alias was refused: what it stood for is not reported
        again there (as a missing summary, or a file that is not a mapping)."""

    def add(self, line: int | None, message: str, *, refusal: bool = False) -> None:
        line = line or 1
        if refusal:
            self.refused.add(line)
        elif line in self.refused:
            return
        self.items.append((SourceSpan(self.file, line), message))


_SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
"""libyaml's parser when PyYAML has it: the rule library parses ten times faster."""
_SCALARS = yaml.constructor.SafeConstructor()
_STRING_TAG = "tag:yaml.org,2002:str"
"""Builds scalar values only: mappings and sequences are walked by ``_convert``."""


def _compose(text: str, problems: _Problems) -> _Node | None:
    try:
        root = _compose_fast(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark else 1
        reason = first_line(str(getattr(exc, "problem", None) or exc)) or "unreadable"
        problems.add(line, f"invalid YAML: {reason}")
        return None
    except RecursionError:  # PyYAML composes recursively: [[[[...]]]] exhausts the stack
        problems.add(1, "YAML nested too deeply")
        return None
    if root is None:
        problems.add(1, "empty rule file")
        return None
    try:
        return _convert(root, problems, set())
    except RecursionError:
        problems.add(1, "YAML nested too deeply")
        return None


def _compose_fast(text: str) -> yaml.Node | None:
    """libyaml when present; on an error, PyYAML's own parser says what is wrong (its
    messages and lines are the ones users and our tests know)."""
    try:
        return yaml.compose(text, Loader=_SAFE_LOADER)
    except yaml.YAMLError:
        if _SAFE_LOADER is yaml.SafeLoader:
            raise
        return yaml.compose(text, Loader=yaml.SafeLoader)


def _convert(node: yaml.Node, problems: _Problems, seen: set[int]) -> _Node:
    line = node.start_mark.line + 1
    if id(node) in seen:
        problems.add(line, "YAML anchors and aliases are not allowed in rule files",
                     refusal=True)
        return _Node(None, line)
    seen.add(id(node))
    if node.tag not in _STANDARD_TAGS:
        problems.add(line, f"YAML tag {node.tag!r} is not allowed in rule files", refusal=True)
        return _Node(None, line)
    if isinstance(node, yaml.MappingNode):
        mapping: dict[str, _Node] = {}
        key_lines: dict[str, int] = {}
        for key_node, value_node in node.value:
            key = _convert(key_node, problems, seen)
            if not isinstance(key.value, str):
                problems.add(key.line, f"mapping keys must be strings, got {key.value!r}")
                continue
            if key.value in mapping:
                problems.add(
                    key.line,
                    f"duplicate key {key.value!r} (first at line {key_lines[key.value]})",
                )
                continue
            key_lines[key.value] = key.line
            mapping[key.value] = _convert(value_node, problems, seen)
        return _Node(mapping, line, key_lines)
    if isinstance(node, yaml.SequenceNode):
        return _Node([_convert(item, problems, seen) for item in node.value], line)
    if node.tag == _STRING_TAG:  # most scalars in rule files: no constructor needed
        return _Node(node.value, line)
    try:
        return _Node(_SCALARS.construct_object(node), line)
    except yaml.YAMLError as exc:
        problems.add(line, f"invalid value: {exc}")
        return _Node(None, line)
    finally:
        _SCALARS.constructed_objects.clear()


def _plain(node: _Node) -> Any:
    if isinstance(node.value, dict):
        return {k: _plain(v) for k, v in node.value.items()}
    if isinstance(node.value, list):
        return [_plain(v) for v in node.value]
    return node.value


def _keys(node: _Node, allowed: Iterable[str], required: Iterable[str], what: str,
          problems: _Problems) -> dict[str, _Node]:
    if not isinstance(node.value, dict):
        problems.add(node.line, f"{what} must be a mapping")
        return {}
    allowed_set = set(allowed)
    for key in node.value:
        if key not in allowed_set:
            problems.add(
                node.key_lines.get(key, node.line),
                f"unknown key {key!r} in {what}; allowed: {', '.join(sorted(allowed_set))}",
            )
    for key in required:
        if key not in node.value:
            problems.add(node.line, f"{what} is missing required key {key!r}")
    return node.value


# -------------------------------------------------------------------------- loading


def load_rule_text(text: str, file: str = "<string>",
                   header: list[TargetSpec] | None = None) -> list[Rule]:
    """Load rules from YAML text; raises RuleFileError listing every problem."""
    problems = _Problems(file)
    rules = list(_load(text, problems, header))
    if problems.items:
        raise RuleFileError(problems.items)
    return rules


def load_rule_file(path: str | Path) -> list[Rule]:
    """Load one rule file (from the rule cache when it holds this file's bytes);
    unreadable files are reported like other rule errors."""
    text = _read(Path(path))
    return rulecache.cached(Path(path), text.encode("utf-8"),
                            lambda: load_rule_text(text, str(path)), _is_rule_list)


def _is_rule_list(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(rule, Rule) for rule in value)


def load_target_file(path: str | Path) -> tuple[TargetSpec, list[Rule]]:
    """A target file: a rule file with a ``target:`` header naming a custom domain."""
    header: list[TargetSpec] = []
    rules = load_rule_text(_read(Path(path)), str(path), header)
    if not header:
        raise RuleFileError([(SourceSpan(str(path), 1),
                              "not a target file: it has no 'target:' header")])
    return header[0], rules


def _read(path: Path) -> str:
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            raise RuleFileError([(SourceSpan(str(path), 1), "rule file larger than 4 MiB")])
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RuleFileError([(None, f"{path}: rule file not found")]) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise RuleFileError([(None, f"{path}: cannot read rule file ({exc})")]) from None
    return text


def rule_files(path: str | Path) -> list[Path]:
    """A rule path is a file or a folder of ``*.yaml``/``*.yml`` files (sorted by name)."""
    path = Path(path)
    if path.is_dir():
        return sorted(p for p in path.iterdir() if p.suffix in (".yaml", ".yml") and p.is_file())
    return [path]


def load_rules(paths: Iterable[str | Path]) -> list[Rule]:
    """Load rule files and folders in order; ids must be unique across all of them."""
    problems: list[tuple[SourceSpan | None, str]] = []
    rules: list[Rule] = []
    seen: dict[str, Rule] = {}
    for path in paths:
        files = rule_files(path)
        if not files and Path(path).is_dir():
            problems.append((None, f"{path}: folder holds no .yaml rule files"))
        for file in files:
            try:
                loaded = load_rule_file(file)
            except RuleFileError as exc:
                problems.extend(exc.problems)
                continue
            for rule in loaded:
                if rule.id in seen:
                    first = seen[rule.id]
                    problems.append(
                        (rule.source, f"rule id {rule.id!r} already defined at {first.source}")
                    )
                    continue
                seen[rule.id] = rule
                rules.append(rule)
    if problems:
        raise RuleFileError(problems)
    return rules


def builtin_rule_paths() -> list[Path]:
    """The built-in library shipped inside the package (``fusectl/rules``)."""
    root = resources.files("fusectl") / "rules"
    folder = Path(str(root))
    if not folder.is_dir():  # running from a source checkout without installation
        folder = Path(__file__).resolve().parent.parent / "rules"
    return [folder]


def load_builtin_rules() -> list[Rule]:
    return load_rules(builtin_rule_paths())


def _load(text: str, problems: _Problems, header: list[TargetSpec] | None = None
          ) -> Iterator[Rule]:
    """Rules of one file; a target file's header is appended to ``header``."""
    root = _compose(text, problems)
    if root is None:
        return
    top = _keys(root, ("version", "rules", "target"), ("version", "rules"), "the rule file",
                problems)
    version = top.get("version")
    if version is not None and (type(version.value) is not int or version.value != 1):
        problems.add(version.line, f"unsupported version {version.value!r}; expected 1")
    target = _target(top.get("target"), problems)
    if target is not None and header is not None:
        header.append(target)
    rules_node = top.get("rules")
    if rules_node is None:
        return
    if not isinstance(rules_node.value, list):
        problems.add(rules_node.line, "'rules' must be a list")
        return
    ids: dict[str, int] = {}
    for item in rules_node.value:
        rule = _load_rule(item, problems, target)
        if rule is None:
            continue
        if rule.id in ids:
            problems.add(rule.line, f"duplicate rule id {rule.id!r} (first at line {ids[rule.id]})")
            continue
        ids[rule.id] = rule.line
        yield rule


_TARGET_KEYS = ("name", "domain", "opset", "base", "kernels")


def _target(node: _Node | None, problems: _Problems) -> TargetSpec | None:
    """``target:`` header of a target file: name, custom domain, its opset, base target."""
    if node is None:
        return None
    keys = _keys(node, _TARGET_KEYS, ("name", "domain"), "target", problems)
    name = _string(keys.get("name"), "target name", problems)
    domain = _string(keys.get("domain"), "target domain", problems)
    if name and (name in TARGETS or name == "any" or not RULE_ID.fullmatch(name)):
        problems.add(keys["name"].line, f"target name {name!r} must be kebab-case and not "
                                        f"one of {', '.join(TARGETS)}, any")
    if domain and (not re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_]\w*)*", domain)
                   or domain in ("", "ai.onnx", "onnx")):
        problems.add(keys["domain"].line, f"target domain {domain!r} must be a custom domain "
                                          "such as npu.example")
    opset = keys.get("opset")
    version = 1
    if opset is not None:
        if type(opset.value) is not int or opset.value < 1:
            problems.add(opset.line, "target opset must be a positive integer")
        else:
            version = opset.value
    base = "onnx"
    if "base" in keys:
        base = _string(keys["base"], "target base", problems) or "onnx"
        if base not in TARGETS:
            problems.add(keys["base"].line, f"target base must be one of {', '.join(TARGETS)}")
    kernels: list[tuple[str, str]] = []
    if "kernels" in keys:
        raw = keys["kernels"]
        if not isinstance(raw.value, dict) or not all(
            isinstance(v.value, str) for v in raw.value.values()
        ):
            problems.add(raw.line, "kernels must map a kernel op name to its description")
        else:
            for kernel, text in raw.value.items():
                if not re.fullmatch(r"[A-Za-z_]\w*", kernel):
                    problems.add(text.line, f"kernel name {kernel!r} is not an op name")
                kernels.append((kernel, text.value.strip()))
    if not name or not domain:
        return None
    return TargetSpec(name, domain, version, base, tuple(kernels), problems.file)


_RULE_KEYS = ("id", "summary", "when", "match", "where", "let", "replace", "tests",
              "group", "merge", "fuse", "opt_in")


def _load_rule(node: _Node, problems: _Problems, target: TargetSpec | None = None
               ) -> Rule | None:
    before = len(problems.items)
    keys = _keys(node, _RULE_KEYS, ("id", "summary", "match"), "a rule", problems)
    if not keys:
        return None
    if ("replace" in keys) == ("fuse" in keys):
        problems.add(node.line, "a rule needs exactly one of 'replace' and 'fuse'")
    rule_id = _string(keys.get("id"), "id", problems) or "?"
    if rule_id != "?" and not RULE_ID.fullmatch(rule_id):
        problems.add(keys["id"].line, f"rule id {rule_id!r} must be lowercase-kebab-case")
    summary = _string(keys.get("summary"), "summary", problems) or ""
    opt_in = _string(keys.get("opt_in"), "opt_in (why the rule is off by default)",
                     problems) or ""

    match_texts, variants, variant_aliases = _match_variants(keys.get("match"), problems)
    match_specs = variants[0] if variants else []
    produced = list(dict.fromkeys(o for v in variants for spec in v for o in spec.outputs))
    value_captures, attr_captures, outputs = [], [], []
    for variant in variants:
        made = {out for spec in variant for out in spec.outputs}
        consumed = {i.name for spec in variant for i in spec.inputs if isinstance(i, Ref)}
        value_captures += [i.name for spec in variant for i in spec.inputs
                           if isinstance(i, Ref) and i.name not in made]
        attr_captures += [a.text for spec in variant for a in spec.attrs if a.is_capture]
        these = [o for spec in variant for o in spec.outputs
                 if o not in consumed and not o.startswith("%")]
        if outputs and these != outputs:
            problems.add(keys["match"].line,
                         f"alternatives produce different outputs: {outputs} vs {these}")
        outputs = outputs or these
        duplicated = [o for o, n in Counter(o for spec in variant for o in spec.outputs).items()
                      if n > 1]
        for name in duplicated:
            problems.add(keys["match"].line, f"{name!r} is produced by more than one statement")
    captures = list(dict.fromkeys(value_captures + attr_captures))
    if variants and not outputs:
        problems.add(keys["match"].line, "the match has no output (every value is consumed)")
    for name in set(produced) & set(captures):
        problems.add(keys["match"].line, f"{name!r} is both produced and captured")
    for name in attr_captures:
        if name in value_captures:
            problems.add(keys["match"].line, f"{name!r} is used both as a value and an attribute")
    match_names = [n for n in dict.fromkeys(captures + produced) if not n.startswith("%")]

    replace_texts, replace_specs, replace_lines = _statements(
        keys.get("replace"), "replace", True, problems
    )
    # Names can only be checked against a match that parsed; otherwise check safety only.
    names: list[str] | None = match_names if variants else None
    where = _where(keys.get("where"), names, problems)
    let = _let(keys.get("let"), names, problems)
    known = None if names is None else names + [b.name for b in let]
    group = _group(keys.get("group"), known, captures, problems)
    merge: list[LetBinding] = []
    if "merge" in keys:
        if group is None:
            problems.add(keys["merge"].line, "'merge' is only for group rules (see 'group')")
        merge = _let(keys.get("merge"), known, problems)
    elif group is not None:
        pass
    fuse = _fuse(keys.get("fuse"), target, problems)
    if fuse is not None and group is not None:
        problems.add(keys["fuse"].line, "a group rule cannot 'fuse'; use replace")
    if variants and known is not None and "replace" in keys:
        if group is None:
            _check_replace(keys.get("replace"), replace_specs, replace_lines, known, produced,
                           outputs, captures, problems)
        else:
            _check_group_replace(keys.get("replace"), replace_specs, replace_lines, group,
                                 known, [b.name for b in merge], produced, outputs, problems)
    kept = [o for spec in replace_specs for o in spec.outputs
            if o in produced and o not in outputs and not o.startswith("%")]
    if kept and group is not None:
        problems.add(keys["replace"].line, f"a group rule cannot produce match intermediates "
                                           f"again ({', '.join(kept)})")
    when = _when(keys.get("when"), problems, target)
    tests = _tests(keys.get("tests"), problems)
    if len(problems.items) > before:
        return None
    return Rule(
        id=rule_id,
        summary=summary,
        match=tuple(match_specs),
        match_variants=tuple(tuple(v) for v in variants),
        match_aliases=tuple(tuple(sorted(a.items())) for a in variant_aliases),
        replace=tuple(replace_specs),
        where=tuple(where),
        let=tuple(let),
        when=when,
        tests=tuple(tests),
        captures=tuple(captures),
        outputs=tuple(outputs),
        file=problems.file,
        line=node.line,
        match_text=tuple(match_texts),
        replace_text=tuple(replace_texts),
        group=group,
        merge=tuple(merge),
        fuse=fuse,
        kept=tuple(kept),
        opt_in=opt_in,
    )


_GROUP_KEYS = ("shared", "min", "key", "order", "require_saving")
MAX_GROUP_KEYS = 8


def _group(node: _Node | None, known: list[str] | None, captures: list[str],
           problems: _Problems) -> Group | None:
    """``group: {shared: x, min: 2, key: [expr...], order: expr}``: a sibling-merge rule."""
    if node is None:
        return None
    keys = _keys(node, _GROUP_KEYS, ("shared",), "group", problems)
    shared = _string(keys.get("shared"), "group shared value", problems)
    if shared and known is not None and shared not in captures:
        problems.add(keys["shared"].line, f"group: shared value {shared!r} must be a value "
                                          "the match consumes (a capture)")
    size = 2
    if "min" in keys:
        if type(keys["min"].value) is not int or keys["min"].value < 2:
            problems.add(keys["min"].line, "group: min must be an integer >= 2")
        else:
            size = keys["min"].value
    parsed: list[expr.Expression] = []
    if "key" in keys:
        items = keys["key"].value if isinstance(keys["key"].value, list) else [keys["key"]]
        if len(items) > MAX_GROUP_KEYS:
            problems.add(keys["key"].line, f"group: at most {MAX_GROUP_KEYS} key expressions")
        for item in items[:MAX_GROUP_KEYS]:
            if not isinstance(item.value, str):
                problems.add(item.line, "group: key entries must be expressions")
                continue
            try:
                parsed.append(expr.parse(item.value, known))
            except expr.ExprError as exc:
                problems.add(item.line, f"group key: {exc}")
    saving = _flag(keys.get("require_saving"), "group: require_saving", True, problems)
    order = None
    if "order" in keys:
        if not isinstance(keys["order"].value, str):
            problems.add(keys["order"].line, "group: order must be an expression")
        else:
            try:
                order = expr.parse(keys["order"].value, known)
            except expr.ExprError as exc:
                problems.add(keys["order"].line, f"group order: {exc}")
    if not shared:
        return None
    return Group(shared, size, tuple(parsed), node.line, saving, order)


def _fuse(node: _Node | None, target: TargetSpec | None, problems: _Problems) -> OpRef | None:
    """``fuse: npu.example.ConvReluPool``: the fused kernel op (a custom domain)."""
    if node is None:
        return None
    text = _string(node, "fuse", problems)
    if not text:
        return None
    if not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+", text):
        problems.add(node.line, f"fuse: {text!r} must be DOMAIN.Op, e.g. npu.example.ConvRelu")
        return None
    op = op_ref(text)
    if op.domain in ("", "com.microsoft"):
        problems.add(node.line, f"fuse: {text!r} must be in a custom domain")
        return None
    if target is not None:
        if op.domain != target.domain:
            problems.add(node.line, f"fuse: {text!r} is not in the target's domain "
                                    f"{target.domain!r}")
        elif target.kernels and op.op_type not in dict(target.kernels):
            problems.add(node.line, f"fuse: kernel {op.op_type!r} is not declared in the "
                                    f"target's kernels ({', '.join(dict(target.kernels))})")
    return op


def _flag(node: _Node | None, what: str, default: bool, problems: _Problems) -> bool:
    """A true/false key; absent gives the default."""
    if node is None:
        return default
    if not isinstance(node.value, bool):
        problems.add(node.line, f"{what} must be true or false")
        return default
    return node.value


def _string(node: _Node | None, what: str, problems: _Problems) -> str | None:
    if node is None:
        return None
    if not isinstance(node.value, str) or not node.value.strip():
        problems.add(node.line, f"{what} must be a non-empty string")
        return None
    return node.value.strip()


def _statements(node: _Node | None, what: str, replace: bool, problems: _Problems
                ) -> tuple[list[str], list[NodeSpec], list[int]]:
    """Parse a statement list; also return, for each spec, the line of its statement."""
    if node is None:
        return [], [], []
    items = node.value if isinstance(node.value, list) else None
    if not items or not all(isinstance(i.value, str) for i in items):
        problems.add(node.line, f"{what} must be a non-empty list of statements")
        return [], [], []
    texts = [i.value for i in items]
    failed = False
    lines: list[int] = []
    for item in items:
        options = [item.value] if replace else split_alternatives(item.value)
        options = [o for o in options if alias_of(o) is None] if len(options) > 1 else options
        try:
            counts = [len(parse_statements([option], replace=replace)) for option in options]
            lines += [item.line] * counts[0]
        except StatementError as exc:
            failed = True
            problems.add(item.line, f"{what}: {str(exc).split(': ', 1)[-1]}")
    if failed:
        return texts, [], []
    first = texts if replace else [split_alternatives(t)[0] for t in texts]
    return texts, parse_statements(first, replace=replace), lines


MAX_MATCH_VARIANTS = 32


def _match_variants(node: _Node | None, problems: _Problems
                    ) -> tuple[list[str], list[list[NodeSpec]], list[dict[str, str]]]:
    """Parse match statements, expanding ``A(..) | B(..)`` into whole-pattern variants.

    A bare-name alternative (``s = Mul(x, c) | x``) drops the node from its variants and
    reads ``x`` wherever ``s`` is used; each variant's such aliases are returned with it."""
    texts, specs, _ = _statements(node, "match", False, problems)
    if not specs or node is None:
        return texts, [], []
    choices = [split_alternatives(t) for t in texts]
    combos: list[list[str]] = [[]]
    for options in choices:
        combos = [c + [o] for c in combos for o in options]
        if len(combos) > MAX_MATCH_VARIANTS:
            problems.add(node.line, f"more than {MAX_MATCH_VARIANTS} alternative combinations")
            return texts, [], []
    variants, aliases = [], []
    for combo in combos:
        pairs = [alias_of(t) for t in combo]
        alias = {pair[0]: pair[1] for pair in pairs if pair is not None}
        try:
            parsed = parse_statements([t for t, pair in zip(combo, pairs, strict=True)
                                       if pair is None], replace=False)
        except StatementError as exc:
            problems.add(node.line, f"match: {exc}")
            return texts, [], []
        resolved = {name: _resolve_alias(name, alias) for name in alias}
        if any(target is None for target in resolved.values()):
            problems.add(node.line, "match: bare-name alternatives refer to each other in a "
                         "cycle")
            return texts, [], []
        read = {i.name for spec in parsed for i in spec.inputs if isinstance(i, Ref)}
        unread = [name for name in alias if name not in read]
        if unread:
            problems.add(node.line, f"match: {unread[0]!r} has a bare-name alternative but no "
                         "statement reads it (a match output needs a node)")
            return texts, [], []
        variants.append([_rename_inputs(spec, resolved) for spec in parsed])
        aliases.append({name: target for name, target in resolved.items() if target})
    return texts, variants, aliases


def _resolve_alias(name: str, alias: dict[str, str]) -> str | None:
    """Follow ``a = b``, ``b = c`` to ``c``; None on a cycle."""
    seen = {name}
    while name in alias:
        name = alias[name]
        if name in seen:
            return None
        seen.add(name)
    return name


def _rename_inputs(spec: NodeSpec, renamed: dict[str, str | None]) -> NodeSpec:
    inputs = tuple(Ref(renamed[i.name] or i.name, i.optional)
                   if isinstance(i, Ref) and i.name in renamed else i for i in spec.inputs)
    return dataclasses.replace(spec, inputs=inputs) if inputs != spec.inputs else spec


def _where(node: _Node | None, names: list[str] | None, problems: _Problems
           ) -> list[Condition]:
    if node is None:
        return []
    items = node.value if isinstance(node.value, list) else [node]
    conditions = []
    for item in items:
        message = None
        text_node = item
        if isinstance(item.value, dict):
            keys = _keys(item, ("expr", "message"), ("expr",), "a where entry", problems)
            if "expr" not in keys:
                continue
            text_node = keys["expr"]
            message = _string(keys.get("message"), "message", problems)
        try:
            parsed = expr.parse(text_node.value, names)
        except expr.ExprError as exc:
            problems.add(text_node.line, f"where: {exc}")
            continue
        conditions.append(Condition(parsed, message or f"{parsed.source} is false",
                                    text_node.line))
    return conditions


def _let(node: _Node | None, names: list[str] | None, problems: _Problems
         ) -> list[LetBinding]:
    if node is None:
        return []
    if not isinstance(node.value, dict):
        problems.add(node.line, "let must be a mapping of name: expression")
        return []
    known = None if names is None else list(names)
    bindings = []
    for name, value in node.value.items():
        if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*", name):
            problems.add(value.line, f"let name {name!r} is not a valid name")
            continue
        if (known is not None and name in known) or name in expr.FUNCTIONS:
            problems.add(value.line, f"let name {name!r} is already defined")
            continue
        try:
            parsed = expr.parse(value.value, known)
        except expr.ExprError as exc:
            problems.add(value.line, f"let {name}: {exc}")
            continue
        bindings.append(LetBinding(name, parsed, value.line))
        if known is not None:
            known.append(name)
    return bindings


def _check_replace(node: _Node | None, specs: list[NodeSpec], lines: list[int],
                   known: list[str], match_produced: list[str], outputs: list[str],
                   captures: list[str], problems: _Problems) -> None:
    if node is None or not specs:
        return
    available = set(known) - (set(match_produced) - set(captures))
    made: set[str] = set()
    for spec, line in zip(specs, lines, strict=True):
        for item in spec.inputs:
            if isinstance(item, Ref) and item.name == "_":
                problems.add(line, "replace: '_' names an omitted output and cannot be read")
            elif isinstance(item, Ref) and item.name not in available and item.name not in made:
                problems.add(line, f"replace: {item.name!r} is not a capture, a let name or "
                                   "an earlier replacement output")
        if spec.same_op_as and spec.same_op_as not in match_produced:
            problems.add(line, f"replace: '@{spec.same_op_as}' must name a value the match "
                               "produces")
        elif spec.copy_attrs_from and spec.copy_attrs_from not in match_produced:
            problems.add(line, f"replace: '**{spec.copy_attrs_from}' must name a value the match "
                               "produces")
        for attr in spec.attrs:
            try:
                expr.parse(attr.text, known)
            except expr.ExprError as exc:
                problems.add(line, f"replace: attribute {attr.name}: {exc}")
        for out in spec.outputs:
            if out in captures:
                problems.add(line, f"replace: {out!r} is a capture and cannot be produced")
        made.update(spec.outputs)
    for out in outputs:
        if out not in made:
            problems.add(node.line, f"replace must produce the match output {out!r}")


def _opset_range(text: Any, line: int, problems: _Problems) -> OpsetRange | None:
    raw = str(text).replace(" ", "")
    bounds = []
    for part in raw.split(","):
        m = re.fullmatch(r"(>=|<=|==|!=|>|<)?(\d+)", part)
        if not m:
            problems.add(line, f"bad opset range {text!r}; use e.g. '>=13' or '>=13,<18'")
            return None
        bounds.append((m.group(1) or "==", int(m.group(2))))
    return OpsetRange(str(text), tuple(bounds))


def _when(node: _Node | None, problems: _Problems, target: TargetSpec | None = None) -> When:
    """Rules of a target file default to that target and import its domain."""
    default_targets: tuple[str, ...] = (target.name,) if target else ("any",)
    default_imports = ((target.domain, target.opset),) if target else ()
    if node is None:
        return When((), default_targets, default_imports)
    keys = _keys(node, ("opset", "target", "imports"), (), "when", problems)
    opsets: list[tuple[str, OpsetRange]] = []
    opset = keys.get("opset")
    if opset is not None:
        entries = opset.value.items() if isinstance(opset.value, dict) else [("", opset)]
        for domain, value in entries:
            parsed = _opset_range(value.value, value.line, problems)
            if parsed:
                opsets.append(("" if domain in ("ai.onnx", "onnx") else domain, parsed))
    targets = default_targets
    target_node = keys.get("target")
    if target_node is not None:
        raw = _plain(target_node)
        names = raw if isinstance(raw, list) else [raw]
        if not all(isinstance(n, str) and n for n in names):
            problems.add(target_node.line, "target must be a name or a list of names")
        else:
            targets = tuple(names)
    imports: list[tuple[str, int]] = list(default_imports)
    imp = keys.get("imports")
    if imp is not None:
        raw = _plain(imp)
        if not isinstance(raw, dict) or not all(isinstance(v, int) for v in raw.values()):
            problems.add(imp.line, "imports must map a domain to an opset version")
        else:
            imports = sorted({**dict(imports), **raw}.items())
    return When(tuple(opsets), targets, tuple(imports))


_TEST_KEYS = ("name", "model", "init", "expect", "rtol", "atol", "fold")


def _tests(node: _Node | None, problems: _Problems) -> list[RuleTest]:
    if node is None:
        return []
    if not isinstance(node.value, list):
        problems.add(node.line, "tests must be a list")
        return []
    tests = []
    for item in node.value:
        keys = _keys(item, _TEST_KEYS, ("name", "model", "expect"), "a test", problems)
        if not keys:
            continue
        name = _string(keys.get("name"), "test name", problems) or "?"
        model = _string(keys.get("model"), "test model", problems) or ""
        expect = _expect(keys.get("expect"), problems)
        init = keys.get("init")
        init_items: list[tuple[str, Any]] = []
        if init is not None:
            raw = _plain(init)
            if not isinstance(raw, dict):
                problems.add(init.line, "init must map initializer names to values")
            else:
                for key, value in raw.items():
                    if not _valid_init(value):
                        problems.add(init.value[key].line,
                                     f"init {key}: use uniform(lo, hi), normal(mean, std), "
                                     "a number or a list")
                    init_items.append((key, value))
        tol = {}
        for key in ("rtol", "atol"):
            if key in keys:
                value = keys[key].value
                if not isinstance(value, (int, float)) or value < 0:
                    problems.add(keys[key].line, f"{key} must be a non-negative number")
                else:
                    tol[key] = float(value)
        fold = _flag(keys.get("fold"), "fold", True, problems)
        tests.append(RuleTest(name, model, expect, tuple(init_items), tol.get("rtol"),
                              tol.get("atol"), item.line, fold))
    return tests


def _valid_init(value: Any) -> bool:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return True
    if isinstance(value, list):
        return all(isinstance(v, (int, float, list)) for v in value)
    return isinstance(value, str) and bool(
        re.fullmatch(r"(uniform|normal|randint)\(\s*[-+.\deE]+\s*,\s*[-+.\deE]+\s*\)", value)
    )


def _expect(node: _Node | None, problems: _Problems) -> Expect:
    if node is None:
        return Expect()
    keys = _keys(node, ("fires", "ops", "nodes"), (), "expect", problems)
    fires = keys.get("fires")
    nodes = keys.get("nodes")
    for key in (fires, nodes):
        if key is not None and (not isinstance(key.value, int) or key.value < 0):
            problems.add(key.line, "expect counts must be non-negative integers")
    ops: list[tuple[str, int]] = []
    if "ops" in keys:
        raw = _plain(keys["ops"])
        if not isinstance(raw, dict) or not all(
            isinstance(v, int) and v >= 0 for v in raw.values()
        ):
            problems.add(keys["ops"].line, "expect.ops must map op names to counts")
        else:
            ops = sorted(raw.items())
    return Expect(
        fires.value if fires is not None and isinstance(fires.value, int) else None,
        tuple(ops),
        nodes.value if nodes is not None and isinstance(nodes.value, int) else None,
    )


def _check_group_replace(node: _Node | None, specs: list[NodeSpec], lines: list[int],
                         group: Group, known: list[str], merged: list[str],
                         match_produced: list[str], outputs: list[str],
                         problems: _Problems) -> None:
    """A group's replacement reads the shared value, merge names and its own outputs,
    and produces every match output once per member (``y... = Split(...)``)."""
    if node is None or not specs:
        return
    available = {group.shared, *merged}
    made: set[str] = set()
    each: set[str] = set()
    for spec, line in zip(specs, lines, strict=True):
        for item in spec.inputs:
            if isinstance(item, Ref) and item.name == "_":
                problems.add(line, "replace: '_' names an omitted output and cannot be read")
            elif isinstance(item, Ref) and item.name not in available and item.name not in made:
                problems.add(line, f"replace: {item.name!r} is not the shared value, a merge "
                                   "name or an earlier replacement output (per-member values "
                                   "are lists: combine them in merge)")
        if spec.same_op_as and spec.same_op_as not in match_produced:
            problems.add(line, f"replace: '@{spec.same_op_as}' must name a value the match "
                               "produces")
        elif spec.copy_attrs_from and spec.copy_attrs_from not in match_produced:
            problems.add(line, f"replace: '**{spec.copy_attrs_from}' must name a value the match "
                               "produces")
        for attr in spec.attrs:
            try:
                expr.parse(attr.text, known + merged)
            except expr.ExprError as exc:
                problems.add(line, f"replace: attribute {attr.name}: {exc}")
        for out in spec.outputs:
            if out.endswith(EACH):
                base = out[: -len(EACH)]
                if base not in outputs:
                    problems.add(line, f"replace: {out!r} must name a match output")
                if len(spec.outputs) != 1:
                    problems.add(line, f"replace: {out!r} must be the statement's only output")
                each.add(base)
            else:
                made.add(out)
    for out in outputs:
        if out not in each:
            problems.add(node.line, f"replace must produce '{out}{EACH}' (one per member)")
