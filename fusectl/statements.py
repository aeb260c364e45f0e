"""Parse the node statements of ``match:`` and ``replace:`` into flat node specs.

Syntax (ONNX textual syntax, extended for patterns)::

    outs = [domain.]Op<attr=literal|capture, **y>(in, opt?, Nested(x), 0.5)
    y = Relu | LeakyRelu (x)            # alternatives of the op
    y = Add(Relu(x), b)                 # calls may nest

Nested calls are flattened into separate specs with generated ``%n`` names.
In ``replace`` statements attribute values are expressions (see expr.py).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

EACH = "..."
"""``y... = Split(m)`` in a group rule's replace: one output per group member."""


class StatementError(Exception):
    """A statement does not parse; the message says where."""


@dataclass(frozen=True)
class OpRef:
    """One operator a statement may match: domain ('' for ONNX) and op type."""

    domain: str
    op_type: str

    def __str__(self) -> str:
        return f"{self.domain}.{self.op_type}" if self.domain else self.op_type


@dataclass(frozen=True)
class Literal:
    """A numeric literal used as an input (a constant pattern in ``match``)."""

    value: float | int


@dataclass(frozen=True)
class Ref:
    """A named value used as an input; ``optional`` is the ``x?`` form."""

    name: str
    optional: bool = False


Input = Ref | Literal | None
"""None is an explicitly skipped optional input: ``Clip(x, , hi)``."""


@dataclass(frozen=True)
class AttrSpec:
    """``name=value``; in match a literal or capture name, in replace an expression text."""

    name: str
    text: str
    literal: Any = None
    is_capture: bool = False


@dataclass(frozen=True)
class NodeSpec:
    """One node of a pattern or replacement, after flattening nested calls."""

    outputs: tuple[str, ...]
    ops: tuple[OpRef, ...]
    inputs: tuple[Input, ...]
    attrs: tuple[AttrSpec, ...]
    copy_attrs_from: str | None
    index: int
    same_op_as: str | None = None
    """``u = @z(x)`` in replace: the op (and attributes) of the node that produced ``z``."""
    choice: tuple[int, int] | None = None
    """In replace, (statement, alternative) of ``z = A(..) | B(..)``: only the first
    alternative whose inputs are all present (not None) is built."""
    alias: bool = False
    """In replace, a bare-name alternative ``z = A(x) | x``: z is x, even when x is None."""

    @property
    def op(self) -> OpRef:
        return self.ops[0]


def _split_top_level(text: str, stop: str) -> tuple[list[str], int]:
    """Split ``text`` on top-level commas until an unnested ``stop`` character."""
    parts, depth, start, quote = [], 0, 0, ""
    for i, ch in enumerate(text):
        if quote:
            if ch == quote:
                quote = ""
            continue
        if ch in "\"'":
            quote = ch
        elif depth == 0 and ch == stop and (stop != ">" or text[i + 1 :].lstrip()[:1] == "("):
            parts.append(text[start:i])
            return parts, i
        elif ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        elif depth == 0 and ch == ",":
            parts.append(text[start:i])
            start = i + 1
    raise StatementError(f"missing closing {stop!r}")


class _Parser:
    def __init__(self, *, replace: bool) -> None:
        self.replace = replace
        self.specs: list[NodeSpec] = []
        self.temp = 0
        self.choice: tuple[int, int] | None = None

    def statement(self, text: str) -> None:
        eq = _find_assignment(text)
        if eq < 0:
            raise StatementError("a statement needs the form 'outputs = Op(inputs)'")
        outputs = tuple(o.strip() for o in text[:eq].split(","))
        for out in outputs:
            if self.replace and out.endswith(EACH):
                out = out[: -len(EACH)]
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", out):
                raise StatementError(f"bad output name {out!r}")
        self.call(text[eq + 1 :].strip(), outputs)

    def call(self, text: str, outputs: tuple[str, ...]) -> None:
        names = r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*(?:\s*\|\s*[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)*"
        same = re.match(r"\s*@([A-Za-z_]\w*)\s*", text)
        if same and not self.replace:
            raise StatementError("'@y' (the op that produced y) is only for replace")
        m = same or re.match(rf"\s*\(\s*({names})\s*\)\s*", text) or re.match(
            rf"\s*({names})\s*", text)
        if not m:
            raise StatementError(f"expected an operator name in {text!r}")
        if same:
            ops: tuple[OpRef, ...] = (OpRef("", f"@{same.group(1)}"),)
        else:
            ops = tuple(op_ref(name.strip()) for name in m.group(1).split("|"))
        if self.replace and len(ops) > 1:
            raise StatementError("alternatives ('|') are only allowed in match statements")
        rest = text[m.end() :]
        attrs: list[AttrSpec] = []
        copy_from: str | None = None
        if rest.startswith("<"):
            parts, end = _split_top_level(rest[1:], ">")
            for part in parts:
                part = part.strip()
                if not part:
                    continue
                if part.startswith("**"):
                    if not self.replace:
                        raise StatementError("'**y' (copy attributes) is only for replace")
                    copy_from = part[2:].strip()
                    if not re.fullmatch(r"[A-Za-z_]\w*", copy_from):
                        raise StatementError("'**' must name a value: '**y'")
                    continue
                attrs.append(self.attribute(part))
            rest = rest[end + 2 :].lstrip()
        if not rest.startswith("("):
            raise StatementError(f"expected '(' after {ops[0]}")
        parts, end = _split_top_level(rest[1:], ")")
        if rest[end + 2 :].strip():
            raise StatementError(f"unexpected text after the call: {rest[end + 2 :].strip()!r}")
        if parts == [""]:
            parts = []
        inputs = tuple(self.argument(part.strip()) for part in parts)
        same_op = same.group(1) if same else None
        self.specs.append(
            NodeSpec(outputs, ops, inputs, tuple(attrs), copy_from or same_op,
                     index=len(self.specs), same_op_as=same_op, choice=self.choice)
        )

    def attribute(self, text: str) -> AttrSpec:
        name, sep, value = text.partition("=")
        name, value = name.strip(), value.strip()
        if not sep or not re.fullmatch(r"[A-Za-z_]\w*", name) or not value:
            raise StatementError(f"bad attribute {text!r}; expected name=value")
        if self.replace:
            return AttrSpec(name, value)
        literal, is_literal = _literal(value)
        if is_literal:
            return AttrSpec(name, value, literal=literal)
        if re.fullmatch(r"[A-Za-z_]\w*", value):
            return AttrSpec(name, value, is_capture=True)
        raise StatementError(f"attribute {name}: expected a literal or a capture name")

    def argument(self, text: str) -> Input:
        if not text:
            return None
        literal, is_literal = _literal(text)
        if is_literal:
            if not isinstance(literal, (int, float)):
                raise StatementError(f"input literal must be a number, got {text!r}")
            if self.replace:
                raise StatementError("replace inputs must be names; compute constants in let")
            return Literal(literal)
        m = re.fullmatch(r"([A-Za-z_]\w*)\s*(\?)?", text)
        if m:
            if m.group(2) and self.replace:
                raise StatementError("'?' (optional input) is only for match statements")
            return Ref(m.group(1), optional=bool(m.group(2)))
        self.temp += 1
        name = f"%{self.temp}"
        self.call(text, (name,))
        return Ref(name)


def _find_assignment(text: str) -> int:
    depth = 0
    for i, ch in enumerate(text):
        if ch in "(<[":
            depth += 1
        elif ch in ")>]":
            depth -= 1
        elif ch == "=" and depth == 0:
            return i
    return -1


def op_ref(name: str) -> OpRef:
    """``com.microsoft.FusedConv`` -> OpRef('com.microsoft', 'FusedConv')."""
    domain, _, op = name.rpartition(".")
    if domain in ("ai.onnx", "onnx"):
        domain = ""
    return OpRef(domain, op)


def _literal(text: str) -> tuple[Any, bool]:
    """Parse ONNX-style attribute literals: numbers, strings, lists of them."""
    text = text.strip()
    if re.fullmatch(r"[-+]?\d+", text):
        return int(text), True
    if re.fullmatch(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?|[-+]?(?:inf|nan)", text):
        return float(text), True
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
        return text[1:-1], True
    if text.startswith("[") and text.endswith("]"):
        inner = text[1:-1].strip()
        if not inner:
            return [], True
        items = []
        for part in inner.split(","):
            value, ok = _literal(part)
            if not ok or isinstance(value, list):
                return None, False
            items.append(value)
        return items, True
    return None, False


def parse_statements(texts: list[str], *, replace: bool) -> list[NodeSpec]:
    """Parse a list of statements; nested calls become extra specs before their user.

    Raises StatementError naming the statement (1-based) that failed.
    """
    parser = _Parser(replace=replace)
    for number, text in enumerate(texts, 1):
        if not isinstance(text, str):
            raise StatementError(f"statement {number} must be a string")
        options = split_alternatives(text) if replace else [text]
        try:
            for option_number, option in enumerate(options):
                alias = alias_of(option) if option_number else None
                if alias is not None:  # ``z = A(x) | x``: x itself when A cannot be built
                    option = f"{alias[0]} = Identity({alias[1]})"
                parser.choice = (number, option_number) if len(options) > 1 else None
                parser.statement(option)
                if alias is not None:
                    parser.specs[-1] = dataclasses.replace(parser.specs[-1], alias=True)
        except StatementError as exc:
            raise StatementError(f"statement {number} ({text.strip()!r}): {exc}") from None
    return parser.specs


def split_alternatives(text: str) -> list[str]:
    """``y = A(x) | B(x)`` -> [``y = A(x)``, ``y = B(x)``]; op alternatives
    (``y = Relu | Sigmoid (x)``) are left to the parser. A bare name after the first
    alternative (``s = Mul(x, c) | x``) makes the node optional: see :func:`alias_of`."""
    eq = _find_assignment(text)
    if eq < 0:
        return [text]
    lhs, rhs = text[: eq + 1], text[eq + 1 :]
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(rhs):
        if ch in "(<[":
            depth += 1
        elif ch in ")>]":
            depth -= 1
        elif ch == "|" and depth == 0:
            parts.append(rhs[start:i])
            start = i + 1
    parts.append(rhs[start:])
    if len(parts) > 1 and "(" in parts[0] and all(
        "(" in part or _NAME.fullmatch(part.strip()) for part in parts[1:]
    ):
        return [lhs + " " + part.strip() for part in parts]
    return [text]


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def alias_of(text: str) -> tuple[str, str] | None:
    """``s = x`` (a bare-name alternative) -> ('s', 'x'): in that variant of the pattern no
    node produces ``s``; ``s`` is ``x`` itself, and what the skipped node captured is None."""
    eq = _find_assignment(text)
    if eq < 0:
        return None
    lhs, rhs = text[:eq].strip(), text[eq + 1 :].strip()
    if _NAME.fullmatch(lhs) and _NAME.fullmatch(rhs):
        return lhs, rhs
    return None


def produced_names(specs: list[NodeSpec]) -> list[str]:
    """Every value produced by the specs, in order."""
    return [out for spec in specs for out in spec.outputs]


def consumed_names(specs: list[NodeSpec]) -> list[str]:
    """Every named input of the specs, in order, without repeats."""
    seen: dict[str, None] = {}
    for spec in specs:
        for item in spec.inputs:
            if isinstance(item, Ref):
                seen.setdefault(item.name)
    return list(seen)
