"""Rule files (YAML, ``version: 1``) -> frozen Rule objects, with every error at once.

YAML is composed (not constructed) so that each value keeps its line number,
only plain YAML types are accepted (no tags, no anchors or aliases, no
duplicate keys), unknown keys are errors, and statements and expressions are
parsed and name-checked here so that a bad rule fails at load time with
``file:line`` rather than at match time.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from . import expr
from .errors import RuleFileError, SourceSpan
from .statements import NodeSpec, Ref, StatementError, parse_statements, split_alternatives

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
    match_text: tuple[str, ...] = field(default=(), compare=False)
    replace_text: tuple[str, ...] = field(default=(), compare=False)

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

    def add(self, line: int | None, message: str) -> None:
        span = SourceSpan(self.file, line) if line else SourceSpan(self.file, 1)
        self.items.append((span, message))


def _compose(text: str, problems: _Problems) -> _Node | None:
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark else 1
        problems.add(line, f"invalid YAML: {getattr(exc, 'problem', None) or exc}")
        return None
    if root is None:
        problems.add(1, "empty rule file")
        return None
    return _convert(root, problems, set())


def _convert(node: yaml.Node, problems: _Problems, seen: set[int]) -> _Node:
    line = node.start_mark.line + 1
    if id(node) in seen:
        problems.add(line, "YAML anchors and aliases are not allowed in rule files")
        return _Node(None, line)
    seen.add(id(node))
    if node.tag not in _STANDARD_TAGS:
        problems.add(line, f"YAML tag {node.tag!r} is not allowed in rule files")
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
    loader = yaml.SafeLoader("")
    try:
        return _Node(loader.construct_object(node), line)
    except yaml.YAMLError as exc:
        problems.add(line, f"invalid value: {exc}")
        return _Node(None, line)
    finally:
        loader.dispose()


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


def load_rule_text(text: str, file: str = "<string>") -> list[Rule]:
    """Load rules from YAML text; raises RuleFileError listing every problem."""
    problems = _Problems(file)
    rules = list(_load(text, problems))
    if problems.items:
        raise RuleFileError(problems.items)
    return rules


def load_rule_file(path: str | Path) -> list[Rule]:
    """Load one rule file; unreadable files are reported like other rule errors."""
    path = Path(path)
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            raise RuleFileError([(SourceSpan(str(path), 1), "rule file larger than 4 MiB")])
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RuleFileError([(None, f"{path}: rule file not found")]) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise RuleFileError([(None, f"{path}: cannot read rule file ({exc})")]) from None
    return load_rule_text(text, str(path))


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


def _load(text: str, problems: _Problems) -> Iterator[Rule]:
    root = _compose(text, problems)
    if root is None:
        return
    top = _keys(root, ("version", "rules"), ("version", "rules"), "the rule file", problems)
    version = top.get("version")
    if version is not None and (type(version.value) is not int or version.value != 1):
        problems.add(version.line, f"unsupported version {version.value!r}; expected 1")
    rules_node = top.get("rules")
    if rules_node is None:
        return
    if not isinstance(rules_node.value, list):
        problems.add(rules_node.line, "'rules' must be a list")
        return
    ids: dict[str, int] = {}
    for item in rules_node.value:
        rule = _load_rule(item, problems)
        if rule is None:
            continue
        if rule.id in ids:
            problems.add(rule.line, f"duplicate rule id {rule.id!r} (first at line {ids[rule.id]})")
            continue
        ids[rule.id] = rule.line
        yield rule


_RULE_KEYS = ("id", "summary", "when", "match", "where", "let", "replace", "tests")


def _load_rule(node: _Node, problems: _Problems) -> Rule | None:
    before = len(problems.items)
    keys = _keys(node, _RULE_KEYS, ("id", "summary", "match", "replace"), "a rule", problems)
    if not keys:
        return None
    rule_id = _string(keys.get("id"), "id", problems) or "?"
    if rule_id != "?" and not RULE_ID.fullmatch(rule_id):
        problems.add(keys["id"].line, f"rule id {rule_id!r} must be lowercase-kebab-case")
    summary = _string(keys.get("summary"), "summary", problems) or ""

    match_texts, variants = _match_variants(keys.get("match"), problems)
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
    if variants:
        known = match_names + [b.name for b in let]
        _check_replace(keys.get("replace"), replace_specs, replace_lines, known, produced,
                       outputs, captures, problems)
    when = _when(keys.get("when"), problems)
    tests = _tests(keys.get("tests"), problems)
    if len(problems.items) > before:
        return None
    return Rule(
        id=rule_id,
        summary=summary,
        match=tuple(match_specs),
        match_variants=tuple(tuple(v) for v in variants),
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
    )


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


MAX_MATCH_VARIANTS = 16


def _match_variants(node: _Node | None, problems: _Problems
                    ) -> tuple[list[str], list[list[NodeSpec]]]:
    """Parse match statements, expanding ``A(..) | B(..)`` into whole-pattern variants."""
    texts, specs, _ = _statements(node, "match", False, problems)
    if not specs or node is None:
        return texts, []
    choices = [split_alternatives(t) for t in texts]
    combos: list[list[str]] = [[]]
    for options in choices:
        combos = [c + [o] for c in combos for o in options]
        if len(combos) > MAX_MATCH_VARIANTS:
            problems.add(node.line, f"more than {MAX_MATCH_VARIANTS} alternative combinations")
            return texts, []
    variants = []
    for combo in combos:
        try:
            variants.append(parse_statements(combo, replace=False))
        except StatementError as exc:
            problems.add(node.line, f"match: {exc}")
            return texts, []
    return texts, variants


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
            if isinstance(item, Ref) and item.name not in available and item.name not in made:
                problems.add(line, f"replace: {item.name!r} is not a capture, a let name or "
                                   "an earlier replacement output")
        if spec.copy_attrs_from and spec.copy_attrs_from not in match_produced:
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


def _when(node: _Node | None, problems: _Problems) -> When:
    if node is None:
        return When()
    keys = _keys(node, ("opset", "target", "imports"), (), "when", problems)
    opsets: list[tuple[str, OpsetRange]] = []
    opset = keys.get("opset")
    if opset is not None:
        entries = opset.value.items() if isinstance(opset.value, dict) else [("", opset)]
        for domain, value in entries:
            parsed = _opset_range(value.value, value.line, problems)
            if parsed:
                opsets.append(("" if domain in ("ai.onnx", "onnx") else domain, parsed))
    targets: tuple[str, ...] = ("any",)
    target = keys.get("target")
    if target is not None:
        raw = _plain(target)
        names = raw if isinstance(raw, list) else [raw]
        if not all(isinstance(n, str) and n for n in names):
            problems.add(target.line, "target must be a name or a list of names")
        else:
            targets = tuple(names)
    imports: list[tuple[str, int]] = []
    imp = keys.get("imports")
    if imp is not None:
        raw = _plain(imp)
        if not isinstance(raw, dict) or not all(isinstance(v, int) for v in raw.values()):
            problems.add(imp.line, "imports must map a domain to an opset version")
        else:
            imports = sorted(raw.items())
    return When(tuple(opsets), targets, tuple(imports))


_TEST_KEYS = ("name", "model", "init", "expect", "rtol", "atol")


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
        tests.append(RuleTest(name, model, expect, tuple(init_items), tol.get("rtol"),
                              tol.get("atol"), item.line))
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
