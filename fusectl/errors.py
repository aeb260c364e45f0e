"""One exception tree for everything fusectl reports to a user.

The CLI maps each class to an exit code (SPEC §2), so library code raises
these and never calls ``sys.exit`` itself.
"""

from __future__ import annotations

from dataclasses import dataclass


class FusectlError(Exception):
    """Base class: a message meant for the user, and the exit code it maps to."""

    exit_code = 3


class BadInputError(FusectlError):
    """The user gave us something unusable: a corrupt model, a bad path, bad options."""

    exit_code = 2


@dataclass(frozen=True)
class SourceSpan:
    """Where in a rule file a problem is, for ``file:line`` messages."""

    file: str
    line: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}"


class RuleFileError(BadInputError):
    """One or more problems in rule files; every problem is reported at once."""

    def __init__(self, problems: list[tuple[SourceSpan | None, str]]):
        self.problems = problems
        lines = [f"{span}: {msg}" if span else msg for span, msg in problems]
        super().__init__("\n".join(lines))


class CheckFailedError(FusectlError):
    """A check the user asked for failed (numeric mismatch, rule test failure)."""

    exit_code = 1


class InternalError(FusectlError):
    """A bug in fusectl; the CLI asks the user to report it."""

    exit_code = 3


def first_line_of(error: BaseException, limit: int | None = None) -> str:
    """:func:`first_line` of an exception's message, or its type's name when it has none."""
    return first_line(str(error), limit) or type(error).__name__


def first_line(text: str, limit: int | None = None) -> str:
    """The first non-blank line of an error text, cut to ``limit`` characters (a report
    line must stay one line; onnxruntime's and onnx's messages span several)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    line = lines[0] if lines else ""
    return line if limit is None or len(line) <= limit else line[: limit - 3] + "..."
