"""fusectl: declarative ONNX fusion rules, verified on onnxruntime, with the memory
traffic each fusion saves.

Public API::

    import fusectl
    result = fusectl.optimize("model.onnx")        # OptimizeResult
    fusectl.save_model(result.model, "model.opt.onnx")
    fusectl.report_model("model.onnx", device="a100")   # ModelReport (dry run)
    fusectl.diff_models("a.onnx", "b.onnx")             # DiffResult
"""

from __future__ import annotations

__version__ = "0.1.0"

from .analysis import ModelReport, report_model  # noqa: E402
from .api import OptimizeResult, load_rule_set, optimize  # noqa: E402
from .diff import DiffResult, diff_models  # noqa: E402
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
    "DiffResult",
    "FusectlError",
    "InternalError",
    "ModelReport",
    "OptimizeResult",
    "Rule",
    "RuleFileError",
    "ValidationOptions",
    "ValidationResult",
    "__version__",
    "diff_models",
    "load_model",
    "load_rule_set",
    "load_rules",
    "optimize",
    "report_model",
    "save_model",
]
