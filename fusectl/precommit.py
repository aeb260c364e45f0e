"""The pre-commit hook: ``fusectl optimize --check-only`` on every staged model.

pre-commit calls a hook once with the hook's ``args`` followed by a batch of file
names, while ``fusectl optimize`` takes one model. This splits the two (the trailing
``*.onnx`` arguments are the models), checks each model, writes nothing, and exits with
the worst code (SPEC §2: 1 a check or gate failed, 2 bad input).

    python -m fusectl.precommit [OPTIMIZE OPTIONS...] MODEL.onnx...
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from .cli import main as cli_main


def split_arguments(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """(optimize options, models): the models are the trailing ``.onnx`` arguments."""
    args = list(argv)
    first_model = len(args)
    while first_model > 0 and args[first_model - 1].lower().endswith(".onnx") \
            and not args[first_model - 1].startswith("-"):
        first_model -= 1
    return args[:first_model], args[first_model:]


def main(argv: Sequence[str] | None = None) -> int:
    options, models = split_arguments(sys.argv[1:] if argv is None else argv)
    if not models:
        print("fusectl pre-commit hook: no .onnx files given", file=sys.stderr)
        return 0
    worst = 0
    for model in models:
        code = cli_main(["optimize", *options, "--check-only", model])
        if code:
            print(f"fusectl: {model}: exit code {code}", file=sys.stderr)
        worst = max(worst, code)
    return worst


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
