"""fusectl: declarative ONNX fusion rules, verified on onnxruntime, with the memory
traffic each fusion saves.

Public API::

    import fusectl
    result = fusectl.optimize("model.onnx")        # OptimizeResult
    fusectl.save(result, "model.opt.onnx")
"""

from __future__ import annotations

__version__ = "0.1.0"

from .api import OptimizeResult, load_rule_set, optimize  # noqa: E402
from .errors import (  # noqa: E402
    BadInputError,
    CheckFailedError,
    FusectlError,
    InternalError,
    RuleFileError,
)
from .modelio import load_model, save_model  # noqa: E402
from .rulefile import Rule, load_rules  # noqa: E402
from .validate import ValidationOptions, ValidationResult  # noqa: E402

__all__ = [
    "BadInputError",
    "CheckFailedError",
    "FusectlError",
    "InternalError",
    "OptimizeResult",
    "Rule",
    "RuleFileError",
    "ValidationOptions",
    "ValidationResult",
    "__version__",
    "load_model",
    "load_rule_set",
    "load_rules",
    "optimize",
    "save_model",
]
