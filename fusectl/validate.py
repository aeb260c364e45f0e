"""Numerical validation: does the optimized model still compute what the original did?

Both models run on onnxruntime's CPU provider with onnxruntime's own graph optimizations
disabled, so a fusion onnxruntime would have done anyway cannot hide a difference. The two
sessions never coexist (the reference session is released before the candidate one is
created), so validating a large model needs memory for one model at a time; a model given
as a path (or holding external data) is loaded by onnxruntime from disk. The reference's
outputs are kept (``ReferenceRun``) so that bisection can check many candidates against
them without running the reference again.

onnxruntime runs in a child process (:mod:`fusectl.ortprocess`): a crash inside it is an
error fusectl reports. This module never prints: it returns results, and reports progress
through an optional callback.

Generated inputs (when the user does not provide an array for an input):

* They are seeded: sample ``i`` uses ``np.random.default_rng(options.seed + i)``.
* ``options.shapes[name]`` is the whole shape of that input (its anonymous dims too); the
  names it covers bind the same names elsewhere.
* Symbolic dims take their value from ``options.dims``; else from an array or a shape the user
  gave for another input with the same dim name; else a batch-like dim (named ``N``, ``B``,
  ``batch``, ``batch_size`` or containing ``batch``, case-insensitive) is 2 (1 when the
  reference cannot run at 2: exports that traced batch 1 as a constant), a dim spelled as
  an expression of named dims (torch's ``s16 + s62``, an attention mask as long as the past
  and the new tokens) is computed from theirs, and any other symbolic or unknown dim is 8.
* ``options.input_ranges[name] = (lo, hi)`` wins over every rule below. Floats are uniform in
  ``[lo, hi)``; integers are drawn from ``[lo, hi)`` like Python's ``range``; bools are
  ``x != 0`` for such integers.
* An input whose name contains ``mask`` keeps every key but one: ones (True for bool), or
  zeros where True masks out (it reaches, through id-preserving ops and Nots, the condition
  of a Where that picks a very negative constant: torch's ``masked_fill(mask, -inf)``, as
  nn.MultiheadAttention's ``key_padding_mask``, where all True would mask every key), except
  the last key of the second sequence when there are two or more sequences and keys (one
  padded position: a fusion that drops the mask must show).
* An integer input that feeds, possibly through Cast/CastLike/Unsqueeze/Squeeze/Reshape/
  Flatten/Identity/Expand, the ``indices`` of a Gather or GatherElements (or the ids of a
  com.microsoft EmbedLayerNormalization) is drawn from ``[0, rows)``, where ``rows`` is the
  length of the gathered axis of the data (the smallest one if it feeds several).
* Other floats are uniform in ``[-1, 1)``; other integers uniform in ``[0, 10)`` (clipped to
  the type's range); bools are random; strings are decimal digits.

Half precision. A model that computes in float16 or bfloat16 anywhere (a half input,
initializer, value or Cast) is judged with the half type's tolerances on every float output
(an fp32 output cannot be more exact than the fp16 arithmetic behind it). For every float
type the relative tolerance is measured against ``max(|r|, RMS(r))``: after cancellation an
element near zero carries the rounding error of the tensor's typical magnitude. A model that
computes in float16 also gets one extra input set, the *range sample*, whose generated float
inputs are uniform in ``[-R, R)``: R = 512 (squares of such values overflow float16's 65504,
so a fusion that keeps in float16 what the model computed in float32 is caught), halved
down to 4 until no float16 value of the reference overflows more than on ordinary inputs
(onnxruntime's CPU provider computes most float16 ops in float32, so a reference that would
overflow on float16 hardware may not here; comparing it with a true float16 kernel would be
a false alarm). Where the reference itself overflows in the range sample, the element is not
held against the candidate. Without a generated float input there is no range sample.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import tempfile
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
from onnx_ir.passes.common import TopologicalSortPass

from fusectl import float64
from fusectl.errors import BadInputError, first_line
from fusectl.ortprocess import OrtError, Session, open_session
from fusectl.protowire import encode_model

from .ortchild import RAW
from .shapeexpr import OPAQUE_OPERATORS, expression_symbols
from .shapes import infer_model_shapes

__all__ = [
    "HISTOGRAM_LABELS",
    "ModelSource",
    "OutputComparison",
    "ProgressStep",
    "ReferenceRun",
    "ValidationOptions",
    "ValidationResult",
    "check_candidate",
    "check_intermediates",
    "compare_outputs",
    "comparison_to_dict",
    "generate_inputs",
    "load_input_files",
    "run_model",
    "run_reference",
    "shape_named_dims",
    "to_dict",
    "validate",
]

ModelSource = ir.Model | str | Path
Progress = Callable[[str], None]
InputKey = str | int
"""An input's name, or its position among the model's runtime inputs (unnamed .pb tensors)."""

# Above this many bytes a model goes to onnxruntime's process in a file, not through the pipe.
_PIPE_LIMIT_BYTES = 64 << 20

# Above this much tensor data an in-memory ModelProto risks protobuf's 2 GiB limit, so the
# model goes to a temporary file with external data instead. Tests lower it.
_PROTO_LIMIT_BYTES = int(1.8 * 1024**3)

_BATCH_NAMES = frozenset({"batch", "batch_size"})
_SHORT_BATCH_NAMES = frozenset({"n", "b"})
_DEFAULT_BATCH = 2
_FALLBACK_BATCH = 1
_DEFAULT_DIM = 8
_FALLBACK_DIM = 32
_FALLBACK_LONG = 512
# Generated inputs together hold at most this many elements (64 MiB of float32): a fallback
# with dynamic dims at 512 fits an image or a sequence of 512, not a 512-cube volume, and the
# first attempt sizes dynamic dims of high-rank inputs below 8 (``_within_element_budget``).
_GENERATED_ELEMENTS = 1 << 24
_DEFAULT_INT_HIGH = 10
# Widest generated floats of the float16 range sample: |x| > 256 squares past 65504.
_FP16_RANGE = 512.0
_HALF_TYPES = (ir.DataType.BFLOAT16, ir.DataType.FLOAT16)  # loosest tolerance first

# Ops that pass integer ids through unchanged in value (their first input).
_ID_PASSTHROUGH = frozenset(
    {"Cast", "CastLike", "Unsqueeze", "Squeeze", "Reshape", "Flatten", "Identity", "Expand"}
)
# (domain, op_type) -> {indices input index: (data input index, axis attribute or None)}
_INDEX_CONSUMERS: dict[tuple[str, str], dict[int, tuple[int, str | None]]] = {
    ("", "Gather"): {1: (0, "axis")},
    ("", "GatherElements"): {1: (0, "axis")},
    ("com.microsoft", "EmbedLayerNormalization"): {0: (2, None), 1: (3, None)},
}

# Default (rtol, atol) per ONNX type; other float types use (eps, eps) of the type.
_FLOAT_TOLERANCES: dict[ir.DataType, tuple[float, float]] = {
    ir.DataType.FLOAT: (1e-4, 1e-5),
    ir.DataType.DOUBLE: (1e-4, 1e-5),
    ir.DataType.COMPLEX64: (1e-4, 1e-5),
    ir.DataType.COMPLEX128: (1e-4, 1e-5),
    ir.DataType.FLOAT16: (1e-2, 1e-3),
    ir.DataType.BFLOAT16: (2e-2, 1e-2),
}

# --------------------------------------------------------------------------- public types


@dataclass(frozen=True)
class ValidationOptions:
    """How to feed and judge a validation run; every field has a usable default.

    ``inputs`` are user arrays by input name (the rest are generated), ``dims`` binds symbolic
    dims by name, ``shapes`` fixes a generated input's whole shape, ``samples`` input sets
    are tried (sample ``i`` seeded with ``seed + i``), ``input_ranges`` overrides the value
    range of generated inputs, and ``rtol``/``atol`` replace the per-dtype default tolerances
    (for float and integer outputs; bools and strings are always compared exactly).
    """

    inputs: Mapping[InputKey, np.ndarray] | None = None
    dims: Mapping[str, int] = field(default_factory=dict)
    shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    """Whole shapes of generated inputs by name: how anonymous dims are set (``--input-shape``)."""
    seed: int = 0
    samples: int = 1
    input_ranges: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    rtol: float | None = None
    atol: float | None = None
    fp16_range_sample: bool = True
    """Add the range sample (module docstring) when the model computes in float16."""
    batch: int = _DEFAULT_BATCH
    """Batch-like dims not bound otherwise: 2, so a rewrite that mixes up the batch axis
    shows (at 1 it cannot); ``run_reference`` falls back to 1 for a model that fails at 2."""
    size: int = _DEFAULT_DIM
    """Other dynamic dims not bound otherwise, except on the first axis: 8, small and fast;
    ``run_reference`` falls back to 32 for a model that fails at 8 (a detector whose feature
    pyramid adds maps upsampled from 1/32 scale needs sizes divisible by 32), then to 512
    (an audio model's STFT window). The first
    axis, a batch by another name (Paddle2ONNX's ``-1``), stays at 8."""


class ProgressStep(str):
    """A progress message that also says how many runs of the current session are done."""

    done: int
    total: int

    def __new__(cls, message: str, done: int, total: int) -> ProgressStep:
        step = super().__new__(cls, message)
        step.done, step.total = done, total
        return step


# Error histogram buckets (absolute error |c - r|): exact, below 1e-9, one bucket per decade
# [1e-9, 1e-8) ... [10, 100), from 100 up, and NaN/Inf position mismatches.
_DECADES = tuple(range(-9, 2))
HISTOGRAM_LABELS: tuple[str, ...] = (
    "0", "<1e-9", *(f"1e{k}" for k in _DECADES), ">=1e2", "nan/inf",
)  # fmt: skip


@dataclass(frozen=True)
class OutputComparison:
    """The verdict and error statistics for one output on one input sample.

    Statistics are computed in float64 over elements finite in both models; they are NaN when
    they cannot be computed (dtype/shape mismatch, missing output, string outputs).
    ``pct_out_of_tol`` counts NaN/Inf position mismatches too. ``reason`` says why an output
    failed, or carries a note for a passing one (e.g. a non-deterministic reference).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    rtol: float
    atol: float
    max_abs: float
    max_rel: float
    mean_abs: float
    cosine: float
    pct_out_of_tol: float
    passed: bool
    nondeterministic: bool = False
    reason: str | None = None
    sample: int = 0
    histogram: tuple[int, ...] = ()
    """Element counts per ``HISTOGRAM_LABELS`` bucket of absolute error (empty if unknown)."""
    range_sample: bool = False
    """True for the float16 range sample (large inputs; reference overflows not compared)."""
    tolerance_dtype: str | None = None
    """The half type whose tolerances judged this wider float output, if any."""
    float64_floor: float | None = None
    """The reference's own largest rounding error on this output, against a float64 run of
    it; set when its float32 or float16 comparison failed and the float64 run was made."""


@dataclass(frozen=True)
class ValidationResult:
    """Everything one validation found; ``passed`` is the overall verdict.

    ``error`` is set when the candidate could not be loaded or run by onnxruntime (then
    ``outputs`` may be empty). ``input_shapes`` are the shapes fed (sample 0). The timings are
    wall-clock seconds of one inference pass over all samples (session creation excluded):
    the first of the two reference runs, and the candidate run.
    """

    outputs: tuple[OutputComparison, ...] = ()
    error: str | None = None
    input_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    seconds_reference: float = 0.0
    seconds_candidate: float = 0.0
    samples: int = 1
    """Input sets compared, the float16 range sample included."""
    compute_dtype: str | None = None
    """The half type the reference computes in (``float16``/``bfloat16``), if any."""
    range_scale: float | None = None
    """Generated floats of the float16 range sample are within this magnitude, if it ran."""
    batch_note: str | None = None
    """Why batch-like dims were generated at 1, not 2 (the input model fails at 2)."""

    @property
    def passed(self) -> bool:
        return self.error is None and all(o.passed for o in self.outputs)


@dataclass(frozen=True)
class ReferenceRun:
    """The reference's side of a validation: inputs fed, outputs of its first run, and the
    outputs that differed between its two runs (per sample). Kept so candidates can be
    checked against it without running the reference again."""

    feed_sets: tuple[dict[str, np.ndarray], ...]
    outputs: tuple[dict[str, np.ndarray], ...]
    unstable: tuple[frozenset[str], ...]
    input_shapes: dict[str, tuple[int, ...]]
    seconds: float
    range_sample: int | None = None
    """Index of the float16 range sample in ``feed_sets``, if one was added."""
    range_scale: float | None = None
    """Its generated floats are uniform in ``[-range_scale, range_scale)``."""
    batch_note: str | None = None
    """Set when batch-like dims fell back to 1: why (the error at the default batch)."""
    compute_dtype: np.dtype | None = None
    float64_run: Float64Outputs = field(default_factory=lambda: Float64Outputs(None),
                                        compare=False, repr=False)
    """The reference's float64 outputs, made only when float outputs differ."""

    def float64_outputs(self, sample: int) -> dict[str, np.ndarray] | None:
        """The reference's outputs on sample ``sample`` computed in float64, made once."""
        made = self.float64_run.get(sample, self.feed_sets[sample])
        return None if isinstance(made, str) else made


@dataclass(eq=False)
class Float64Outputs:
    """The reference's outputs in float64 per sample, or why there are none. Filled in place
    (the ReferenceRun holding it is frozen, this cache is not), so bisection makes them once;
    ``run`` widens and loads the model on the first sample that needs it."""

    run: float64.Float64Run | None
    made: dict[int, dict[str, np.ndarray] | str] = field(default_factory=dict)

    def get(self, sample: int, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray] | str:
        """Sample ``sample``'s outputs on ``feeds``, named as onnxruntime's are, or the reason
        there are none."""
        if sample not in self.made:
            self.made[sample] = self._make(feeds)
        return self.made[sample]

    def _make(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray] | str:
        if self.run is None:
            return "the reference model is not known"
        try:
            results = self.run.run(feeds)
        except float64.Unavailable as e:
            return str(e)
        flat: dict[str, np.ndarray] = {}
        for name, value in results.items():
            _flatten(name, value, flat)  # a sequence output is compared element by element
        return flat


# --------------------------------------------------------------------------- input files


def load_input_files(
    specs: Sequence[str],
    inputs: str | os.PathLike[str] | None,
    *,
    input_names: Sequence[str] | None = None,
) -> dict[InputKey, np.ndarray]:
    """Read ``--input NAME=FILE.npy`` specs and ``--inputs`` (an .npz archive or a folder).

    A folder is onnx's test_data_set layout: ``input_0.pb``, ``input_1.pb``... each a
    TensorProto, named by its ``name`` field or else by its position (an int key, resolved
    against the model's runtime inputs by ``generate_inputs``). Arrays from ``specs`` win
    over same-named arrays of ``inputs``. When ``input_names`` (the runtime inputs, in
    order) is given, positions are resolved and unknown names rejected. Problems raise a
    one-line BadInputError.
    """
    arrays: dict[InputKey, np.ndarray] = {}
    if inputs is not None:
        if os.path.isdir(inputs):
            arrays.update(_load_pb_folder(Path(inputs)))
        else:
            arrays.update(_load_npz(inputs))
    seen: set[str] = set()
    for spec in specs:
        name, sep, file = spec.partition("=")
        name, file = name.strip(), file.strip()
        if not sep or not name or not file:
            raise BadInputError(f"--input {spec!r}: expected NAME=FILE.npy")
        if name in seen:
            raise BadInputError(f"--input {spec!r}: input {name!r} is given twice")
        seen.add(name)
        arrays[name] = _load_npy(name, file)
    if input_names is not None:
        arrays = dict(_resolve_positions(arrays, input_names))
        _check_names(arrays, input_names, "input")
    return arrays


def _load_pb_folder(folder: Path) -> dict[InputKey, np.ndarray]:
    """``input_<N>.pb`` TensorProtos of an onnx test_data_set folder, by name or position."""
    numbered: dict[int, Path] = {}
    for path in folder.glob("input_*.pb"):
        index = path.stem[len("input_") :]
        if index.isdigit():
            numbered[int(index)] = path
    if not numbered:
        raise BadInputError(
            f"--inputs {folder}: no input_0.pb, input_1.pb... files (onnx test_data_set layout)"
        )
    missing = sorted(set(range(max(numbered) + 1)) - set(numbered))
    if missing:
        raise BadInputError(f"--inputs {folder}: input_{missing[0]}.pb is missing")
    arrays: dict[InputKey, np.ndarray] = {}
    for index in sorted(numbered):
        path = numbered[index]
        tensor = onnx.TensorProto()
        try:
            tensor.ParseFromString(path.read_bytes())
            if tensor.data_type == onnx.TensorProto.UNDEFINED:
                raise ValueError("not a dense TensorProto (no element type)")
            array = onnx.numpy_helper.to_array(tensor, base_dir=os.fspath(folder))
        except Exception as e:  # protobuf's DecodeError, onnx's conversion errors, OSError
            raise BadInputError(f"--inputs {path}: cannot read: {_first_line(e)}") from None
        key: InputKey = tensor.name or index
        if key in arrays:
            raise BadInputError(f"--inputs {folder}: input {key!r} is given twice")
        arrays[key] = array
    return arrays


def _resolve_positions(
    arrays: Mapping[InputKey, np.ndarray], names: Sequence[str]
) -> Iterator[tuple[str, np.ndarray]]:
    """Turn position keys into the names of the model's runtime inputs."""
    named = {k for k in arrays if isinstance(k, str)}
    for key, array in arrays.items():
        if isinstance(key, str):
            yield key, array
            continue
        if not 0 <= key < len(names):
            raise BadInputError(
                f"input_{key}.pb has no name and the model has only {len(names)} inputs"
            )
        if names[key] in named:
            raise BadInputError(f"input {names[key]!r} is given twice (by name and position)")
        yield names[key], array


def _load_npy(name: str, file: str) -> np.ndarray:
    try:
        loaded = np.load(file, allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        raise BadInputError(f"--input {name}={file}: cannot read: {_numpy_reason(e)}") from None
    if not isinstance(loaded, np.ndarray):
        with contextlib.suppress(AttributeError):
            loaded.close()
        raise BadInputError(f"--input {name}={file}: expected a .npy array file")
    return loaded


def _numpy_reason(error: BaseException) -> str:
    """numpy reads any file that is no .npy/.npz as a pickle, and refuses it as one: say
    what the user has to know instead."""
    if "allow_pickle" in str(error):
        return "not a .npy/.npz file (or one holding Python objects, which are not read)"
    return _first_line(error)


def _load_npz(npz: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    try:
        loaded = np.load(npz, allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        raise BadInputError(f"--inputs {npz}: cannot read: {_numpy_reason(e)}") from None
    if not isinstance(loaded, np.lib.npyio.NpzFile):
        raise BadInputError(f"--inputs {npz}: expected a .npz archive")
    try:
        with loaded:
            return {key: loaded[key] for key in loaded.files}
    except (OSError, ValueError, EOFError) as e:
        raise BadInputError(f"--inputs {npz}: cannot read: {_first_line(e)}") from None


def _check_names(given: Collection[str], known: Collection[str], what: str) -> None:
    unknown = sorted(set(given) - set(known))
    if unknown:
        listed = ", ".join(known) or "(none)"
        raise BadInputError(
            f"unknown {what} name {unknown[0]!r}; the model's {what}s are: {listed}"
        )


# --------------------------------------------------------------------------- input generation


def generate_inputs(
    model: ir.Model,
    options: ValidationOptions | None = None,
    sample: int = 0,
    *,
    float_range: tuple[float, float] | None = None,
) -> dict[str, np.ndarray]:
    """Feeds for every runtime input of ``model``: the user's arrays, else generated ones.

    See the module docstring for how values and dims are chosen; ``float_range`` replaces
    the default ``[-1, 1)`` of generated floats (not masks, not ``input_ranges``). Initializers
    listed among the graph inputs (old models) are not fed. Raises BadInputError for a user
    array of the wrong dtype/rank/shape, an unknown name, or an input that cannot be
    generated.
    """
    options = options or ValidationOptions()
    runtime_inputs = _runtime_inputs(model)
    names = [v.name or "" for v in runtime_inputs]
    provided = dict(_resolve_positions(options.inputs or {}, names))
    _check_names(provided, names, "input")
    _check_names(options.input_ranges, names, "input")
    named = _symbolic_names(runtime_inputs)
    _check_names(options.dims, list(named), "symbolic dim")
    for dim_name, dim_value in options.dims.items():
        if isinstance(dim_value, bool) or not isinstance(dim_value, (int, np.integer)):
            raise BadInputError(f"dim {dim_name}={dim_value!r}: expected a non-negative integer")
        if dim_value < 0:
            raise BadInputError(f"dim {dim_name}={dim_value}: expected a non-negative integer")
    for setting in ("batch", "size"):
        number = getattr(options, setting)
        if isinstance(number, bool) or not isinstance(number, (int, np.integer)) or number < 1:
            raise BadInputError(f"{setting} {number!r}: expected a positive integer")
    for range_name, bounds in options.input_ranges.items():
        lo, hi = bounds
        if not lo <= hi:
            raise BadInputError(f"input range for {range_name!r}: low {lo} is above high {hi}")

    _check_shapes(runtime_inputs, options, provided)

    feeds = {value.name: _check_provided(value, provided[value.name], options.dims)
             for value in runtime_inputs if value.name in provided}
    bound = _bound_dims(runtime_inputs, _given_shapes(feeds, options))

    rng = np.random.default_rng(options.seed + sample)
    result: dict[str, np.ndarray] = {}
    for value in runtime_inputs:
        name = value.name or ""
        if name in feeds:
            result[name] = feeds[name]
            continue
        fixed = options.shapes.get(name)
        dtype, shape = _tensor_signature(value, rank_known=fixed is None)
        dims = fixed if fixed is not None else _input_dims(shape, options, bound, named)
        result[name] = np.asarray(_generate(
            value, dtype, dims, rng, options.input_ranges.get(name), float_range or (-1.0, 1.0)
        ))
    return result


def _check_shapes(runtime: list[ir.Value], options: ValidationOptions,
                  provided: Mapping[str, Any]) -> None:
    """Refuse a given shape that the input's declaration, ``--dim``, another given shape or
    a given array contradicts (a dim spelled as a sum of others, ``past + seq``, is checked
    against theirs once they are all set): the model would fail, or the user asked for two
    sizes of one dim."""
    _check_names(options.shapes, [v.name or "" for v in runtime], "input")
    sizes: dict[str, tuple[int, str]] = {}  # dim name -> (size, what set it)
    for name, size in options.dims.items():
        sizes[name] = (int(size), "--dim")
    for value in runtime:
        if value.name in provided and value.shape is not None:
            for dim, size in zip(value.shape, np.shape(provided[value.name]), strict=False):
                if isinstance(dim, ir.SymbolicDim) and dim.value is not None:
                    sizes.setdefault(dim.value, (int(size), f"input {value.name!r}"))
    expressions = []
    for value in runtime:
        name = value.name or ""
        if name not in options.shapes:
            continue
        wanted = tuple(options.shapes[name])
        if name in provided:
            raise BadInputError(f"input {name!r}: both an array and a shape were given")
        if any(isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 0
               for d in wanted):
            raise BadInputError(f"input {name!r}: shape {list(wanted)} must be non-negative "
                                "integers")
        _tensor_signature(value, rank_known=False)
        declared = value.shape
        if declared is None:
            continue  # an input of unknown rank: the given shape is the whole declaration
        if len(wanted) != len(declared):
            raise BadInputError(f"input {name!r}: shape {list(wanted)} has rank {len(wanted)}, "
                                f"the model declares {_shape_text(declared)}")
        for axis, (dim, size) in enumerate(zip(declared, wanted, strict=True)):
            if isinstance(dim, int) and dim >= 0 and dim != size:
                raise BadInputError(f"input {name!r}: axis {axis} is {dim} in the model "
                                    f"({_shape_text(declared)}), not {size}")
            symbol = dim.value if isinstance(dim, ir.SymbolicDim) else None
            if symbol is None:
                continue
            first, where = sizes.setdefault(symbol, (int(size), f"input {name!r}"))
            if first != size:
                said = (f"bound to {first} by --dim" if where == "--dim"
                        else f"which {where} sets to {first}")
                raise BadInputError(f"input {name!r}: axis {axis} is dim {symbol}, {said}, "
                                    f"not {size}")
            expressions.append((name, axis, dim, int(size)))
    known = {n: size for n, (size, _) in sizes.items()}
    for name, axis, dim, size in expressions:
        if any(op in (dim.value or "") for op in OPAQUE_OPERATORS):
            continue  # a name, not a quotient: symdims does no arithmetic on it either
        symbols = expression_symbols(dim, lambda s, d=dim: s != d.value and s in known)
        if not symbols:
            continue
        value = dim.evaluate({s: known[s] for s in symbols})
        if isinstance(value, int) and value != size:
            raise BadInputError(f"input {name!r}: axis {axis} is dim {dim.value}, which the "
                                f"sizes of {' and '.join(sorted(symbols))} make {value}, "
                                f"not {size}")


def shape_named_dims(model: ir.Model, options: ValidationOptions) -> dict[str, int]:
    """The symbolic dims that ``options.shapes`` size, by name (the first wins), after
    checking the shapes as input generation does: what ``--input-shape`` binds for the
    traffic model, as ``--dim`` would. A dim spelled as an expression of others (``past +
    seq``) is left out: the traffic model computes it from theirs."""
    runtime = _runtime_inputs(model)
    _check_shapes(runtime, options, _given_inputs(runtime, options))
    bound = _bound_dims(runtime, options.shapes)
    return {name: size for name, size in bound.items()
            if expression_symbols(ir.SymbolicDim(name), lambda s, n=name: s != n) is None}


def _given_shapes(feeds: Mapping[str, Any], options: ValidationOptions
                  ) -> dict[str, tuple[int, ...]]:
    """The shapes the user fixed, by input name: given arrays' and ``options.shapes``."""
    return {**{name: np.shape(array) for name, array in feeds.items()}, **options.shapes}


def _runtime_inputs(model: ir.Model) -> list[ir.Value]:
    return [v for v in model.graph.inputs if not v.is_initializer()]


def _tensor_signature(value: ir.Value, rank_known: bool = True
                      ) -> tuple[ir.DataType, ir.Shape | None]:
    """The dtype and declared shape of a generated input (the shape may be None when
    ``rank_known`` is False: a given shape sets it)."""
    if value.type is None:
        raise BadInputError(f"cannot generate input {value.name!r}: it has no declared type")
    if not isinstance(value.type, ir.TensorType):
        raise BadInputError(
            f"cannot generate input {value.name!r} of type {value.type}: only dense tensor "
            "inputs are supported"
        )
    if value.shape is None and rank_known:
        raise BadInputError(
            f"cannot generate input {value.name!r}: its rank is unknown; give its shape with "
            "--input-shape NAME=D0,D1,... or provide it with --input NAME=FILE.npy or --inputs"
        )
    return value.type.dtype, value.shape


def _resolve_dim(dim: int | ir.SymbolicDim, dims: Mapping[str, int], bound: Mapping[str, int],
                 named: Mapping[str, bool | None] | None = None, batch: int = _DEFAULT_BATCH,
                 size: int = _DEFAULT_DIM, leading: bool = False):
    """The size to generate for one dim. ``named``: the inputs' dim names, each with whether
    it leads an input (``_symbolic_names``); ``leading``: this dim, if unnamed, leads its
    input. A leading dim is a batch by another name (``_leading_size``)."""
    named = named or {}
    if isinstance(dim, int) and dim >= 0:
        return dim
    # -1 is how older exporters (Paddle2ONNX) spell a dynamic dim: an unnamed one.
    name = None if isinstance(dim, int) else dim.value
    if name is None:
        return _leading_size(batch, size) if leading else size
    if name in dims:
        return int(dims[name])
    if name in bound:
        return bound[name]
    if not name.isidentifier():  # torch's "s16 + s62" (past + new length): its symbols' sum
        computed = _expression_dim(dim, dims, bound, named, batch, size)
        if computed is not None:
            return computed
    if _batch_like(name, named):
        return batch
    return _leading_size(batch, size) if named.get(name) else size


def _leading_size(batch: int, size: int) -> int:
    """The size of a dim that leads an input of rank 2 or more, a batch by another name
    (Paddle2ONNX's ``[-1, 3, -1, -1]`` images, ``p2o.DynamicDimension.0``): 1 where
    batch-like dims are 1, else at most 8 (the fallback to 32 would multiply the work of a
    3-D volume by 4 more)."""
    return 1 if batch == 1 else min(size, _DEFAULT_DIM)


def _batch_like(name: str, named: Mapping[str, bool | None]) -> bool:
    """A batch by name: ``batch``, ``batch_size`` or anything containing ``batch``; ``N``
    and ``B`` only where they lead an input (onnx-asr's ``waveforms [batch_size, N]`` names
    the samples N, and needs hundreds of them)."""
    lowered = name.lower()
    if lowered in _SHORT_BATCH_NAMES:
        return named.get(name, True) is not None
    return lowered in _BATCH_NAMES or "batch" in lowered


def _symbolic_names(runtime: list[ir.Value]) -> dict[str, bool | None]:
    """The symbolic dim names the inputs use, in order, each with whether it leads some
    input of rank 2 or more (True: then it is sized as such everywhere, one name, one size),
    leads only 1-D inputs (False) or no input at all (None)."""
    names: dict[str, bool | None] = {}
    for value in runtime:
        shape = value.shape or ()
        for axis, dim in enumerate(shape):
            if isinstance(dim, ir.SymbolicDim) and dim.value is not None:
                seen = names.get(dim.value)
                here = _leading(axis, shape) or (False if axis == 0 else None)
                names[dim.value] = here if seen is None else (seen or here or False)
    return names


def _bound_dims(runtime: list[ir.Value], shapes: Mapping[str, Sequence[int]]
                ) -> dict[str, int]:
    """Symbolic dims the user's arrays and shapes fix, by name (the first naming one wins)."""
    bound: dict[str, int] = {}
    for value in runtime:
        if value.name in shapes:
            for dim, size in zip(value.shape or (), shapes[value.name], strict=False):
                if isinstance(dim, ir.SymbolicDim) and dim.value is not None:
                    bound.setdefault(dim.value, int(size))
    return bound


def _generated_shapes(model: ir.Model, options: ValidationOptions
                      ) -> tuple[tuple[int, ...], ...]:
    """The shapes ``generate_inputs`` chooses for the inputs it generates, those whose shape
    the user fixed left out (the same in every setting): two settings that give the same
    ones are one attempt, and a fallback's size budget is for these."""
    runtime = _runtime_inputs(model)
    given = _given_inputs(runtime, options)
    bound = _bound_dims(runtime, _given_shapes(given, options))
    named = _symbolic_names(runtime)
    return tuple(_input_dims(v.shape, options, bound, named)
                 for v in runtime if v.name not in given and v.name not in options.shapes
                 and v.shape is not None)


def _input_dims(shape: ir.Shape, options: ValidationOptions, bound: Mapping[str, int],
                named: Mapping[str, bool | None]) -> tuple[int, ...]:
    """The sizes generated for one input's dims."""
    return tuple(_resolve_dim(d, options.dims, bound, named, options.batch, options.size,
                              _leading(axis, shape)) for axis, d in enumerate(shape))


def _leading(axis: int, shape: ir.Shape | tuple) -> bool:
    """Whether ``axis`` leads a tensor of rank 2 or more: a batch, by whatever name."""
    return axis == 0 and len(shape) >= 2


def _expression_dim(dim: ir.SymbolicDim, dims: Mapping[str, int], bound: Mapping[str, int],
                    named: Mapping[str, bool | None], batch: int, size: int) -> int | None:
    """A dim spelled as an expression of dims that inputs name on their own (torch's
    ``s16 + s62``), each resolved as such; None for anything else (``seq-len`` is a name,
    not a difference) and for a result below 1."""
    symbols = expression_symbols(dim, lambda s: s in named or s in dims or s in bound)
    if symbols is None:
        return None
    try:
        value = dim.evaluate({s: _resolve_dim(ir.SymbolicDim(s), dims, bound, named, batch, size)
                              for s in symbols})
    except Exception:  # noqa: BLE001 - an expression onnx-ir cannot evaluate
        return None
    return int(value) if isinstance(value, int) and value >= 1 else None


def _check_provided(value: ir.Value, arr: Any, dims: Mapping[str, int]) -> np.ndarray:
    name = value.name
    dtype, shape = _tensor_signature(value)
    arr = np.asarray(arr)
    expected = dtype.numpy()
    if dtype == ir.DataType.STRING and arr.dtype.kind in "OUS":
        arr = arr.astype(object)
    elif arr.dtype.kind == "V" and arr.dtype.itemsize == expected.itemsize:
        arr = arr.view(expected)  # ml_dtypes arrays (bfloat16, ...) come back from .npy as void
    if arr.dtype != expected:
        raise BadInputError(
            f"input {name!r}: expected dtype {_dtype_name(expected)}, got {_dtype_name(arr.dtype)}"
        )
    if arr.ndim != len(shape):
        raise BadInputError(
            f"input {name!r}: expected rank {len(shape)} (shape {_shape_text(shape)}), "
            f"got shape {tuple(arr.shape)}"
        )
    for axis, (dim, size) in enumerate(zip(shape, arr.shape, strict=True)):
        if isinstance(dim, int) and dim >= 0 and dim != size:
            raise BadInputError(
                f"input {name!r}: axis {axis} must be {dim} (shape {_shape_text(shape)}), "
                f"got shape {tuple(arr.shape)}"
            )
        if isinstance(dim, ir.SymbolicDim) and dim.value in dims and dims[dim.value] != size:
            raise BadInputError(
                f"input {name!r}: dim {dim.value}={dims[dim.value]} was requested, but the "
                f"given array has {size} on axis {axis}"
            )
    return arr


def _check_not_vacuous(outputs: Mapping[str, Any]) -> None:
    """Refuse given inputs on which every float output of the reference is NaN (an all-NaN
    input, say): NaN facing NaN passes, so validation would pass without comparing a
    number. A model that maps NaN to numbers (Where(IsNaN(x), 0, x)) is compared as usual."""
    floats = [v for v in outputs.values() if isinstance(v, np.ndarray)
              and (v.dtype.kind in "fc" or "float" in v.dtype.name)]  # bfloat16 too
    if floats and all(a.size and np.isnan(a).all() for a in floats):
        raise BadInputError("every float output of the model is NaN on the given inputs; "
                            "validation would compare nothing")


MAX_GENERATED_ELEMENTS = 1 << 31
"""A generated input larger than this (8 GiB of float32) is refused, not attempted."""


def _generate(
    value: ir.Value,
    dtype: ir.DataType,
    shape: tuple[int, ...],
    rng: np.random.Generator,
    value_range: tuple[float, float] | None,
    float_range: tuple[float, float],
) -> np.ndarray | np.generic:
    name = value.name or ""
    if dtype == ir.DataType.UNDEFINED:
        raise BadInputError(f"cannot generate input {name!r}: its element type is undefined")
    elements = math.prod(shape)
    if elements > MAX_GENERATED_ELEMENTS:
        raise BadInputError(
            f"cannot generate input {name!r} of shape {list(shape)} ({elements:,} elements, "
            f"more than {MAX_GENERATED_ELEMENTS:,}); give it with --input or bind smaller dims "
            "with --dim"
        )
    np_dtype = dtype.numpy()
    if value_range is not None:
        lo, hi = float(value_range[0]), float(value_range[1])
        if dtype.is_floating_point() or _is_complex(dtype):
            return _floats(rng, dtype, shape, lo, hi)
        ilo, ihi = math.ceil(lo), math.ceil(hi)
        if ihi <= ilo:
            raise BadInputError(f"input range for {name!r}: [{lo}, {hi}) holds no integer")
        if dtype.is_integer() and (ilo < dtype.min or ihi - 1 > dtype.max):
            raise BadInputError(
                f"input range for {name!r}: [{lo}, {hi}) does not fit {_dtype_name(np_dtype)}"
            )
        return _integers(rng, dtype, shape, ilo, ihi)
    if dtype == ir.DataType.STRING:
        raise BadInputError(
            f"cannot generate input {name!r} of type string (random text means nothing to the "
            "model); provide it with --input NAME=FILE.npy or --inputs, or give "
            "--input-range NAME=LO:HI for decimal-digit strings"
        )
    if "mask" in name.lower():
        return _padding_mask(shape, np_dtype, _true_masks_out(value))
    if dtype.is_floating_point() or _is_complex(dtype):
        return _floats(rng, dtype, shape, *float_range)
    if dtype.is_integer():
        rows = _index_bound(value)
        if rows is not None:
            return _integers(rng, dtype, shape, 0, max(rows, 1))
        high = min(_DEFAULT_INT_HIGH, int(dtype.max) + 1)
        return _integers(rng, dtype, shape, max(0, int(dtype.min)), high)
    if dtype == ir.DataType.BOOL:
        return rng.random(shape) < 0.5
    raise BadInputError(f"cannot generate input {name!r} of element type {dtype.name}")


def _padding_mask(shape: tuple[int, ...], dtype: np.dtype, true_masks_out: bool) -> np.ndarray:
    """A mask that keeps every key but the last one of the second sequence (one padded
    position, as right padding leaves it: a fusion that drops or mis-broadcasts the mask
    changes the outputs), keeping all where there is no second sequence or one key only.
    A sequence keeps all its other keys (a row masked entirely is NaN in a Softmax over -inf),
    unless the model masks queries by the same mask (DeBERTa's outer product)."""
    keep, drop = (0, 1) if true_masks_out else (1, 0)
    mask = np.full(shape, keep, dtype=dtype)
    if len(shape) >= 2 and shape[0] >= 2 and shape[-1] >= 2:
        mask[1, ..., -1] = drop
    return mask


def _is_complex(dtype: ir.DataType) -> bool:
    return dtype in (ir.DataType.COMPLEX64, ir.DataType.COMPLEX128)


def _floats(rng, dtype: ir.DataType, shape, lo: float, hi: float) -> np.ndarray:
    data = rng.uniform(lo, hi, size=shape)
    if _is_complex(dtype):
        data = data + 1j * rng.uniform(lo, hi, size=shape)
    return data.astype(dtype.numpy())


def _integers(rng, dtype: ir.DataType, shape, lo: int, hi: int) -> np.ndarray:
    data = rng.integers(lo, hi, size=shape, dtype=np.int64)
    if dtype == ir.DataType.BOOL:
        return data != 0
    if dtype == ir.DataType.STRING:
        return np.vectorize(str, otypes=[object])(data) if data.size else data.astype(object)
    return data.astype(dtype.numpy())


def _reached_uses(value: ir.Value) -> Iterator[tuple[ir.Node, int, bool]]:
    """Every use of ``value``'s data past id-preserving ops (a Cast, a view) and Nots: the
    node, the input index, and whether an odd number of Nots lies on the way."""
    seen: set[int] = set()
    stack = [(value, False)]
    while stack:
        current, flipped = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        for use in current.uses():
            node, idx = use.node, use.idx
            standard = node.domain in ("", "ai.onnx")
            if standard and node.op_type == "Not":
                stack.append((node.outputs[0], not flipped))
            elif standard and node.op_type in _ID_PASSTHROUGH and idx == 0:
                stack.extend((out, flipped) for out in node.outputs)
            else:
                yield node, idx, flipped


def _index_bound(value: ir.Value) -> int | None:
    """Length of the axis that ``value`` indexes into (through id-preserving ops), if known."""
    rows: int | None = None
    for node, idx, _ in _reached_uses(value):
        domain = "" if node.domain == "ai.onnx" else node.domain
        consumer = _INDEX_CONSUMERS.get((domain, node.op_type), {}).get(idx)
        if consumer is None:
            continue
        data_idx, axis_attr = consumer
        axis = node.attributes.get_int(axis_attr, 0) if axis_attr else 0
        data = node.inputs[data_idx] if data_idx < len(node.inputs) else None
        length = _axis_length(data, axis) if data is not None else None
        if length is not None:
            rows = length if rows is None else min(rows, length)
    return rows


_VERY_NEGATIVE = -1e4
"""A fill at or below this masks a score out (torch fills -inf; HF's exports fill the dtype's
lowest value or -10000)."""


def _true_masks_out(value: ir.Value) -> bool:
    """Whether a mask input's True (nonzero) marks what to mask out: it reaches, through
    id-preserving ops and Nots, the condition of a Where that picks a very negative constant
    there (torch's ``masked_fill(mask, -inf)``: nn.MultiheadAttention's key_padding_mask).
    All ones would then mask every key, and the reference's Softmax would return NaN."""
    for node, idx, flipped in _reached_uses(value):
        if node.op_type != "Where" or node.domain not in ("", "ai.onnx") or idx != 0 \
                or len(node.inputs) != 3:
            continue
        for branch, masks_when in ((node.inputs[1], True), (node.inputs[2], False)):
            fill = None if branch is None else ir.convenience.get_const_tensor(branch)
            if fill is not None and fill.dtype.is_floating_point():
                values = fill.numpy()
                if values.size and bool(np.all(values <= _VERY_NEGATIVE)):
                    return masks_when != flipped
    return False


def _axis_length(data: ir.Value, axis: int) -> int | None:
    shape: Sequence[Any] | None = None
    if data.const_value is not None:
        shape = tuple(data.const_value.shape)
    else:
        producer = data.producer()
        if producer is not None and producer.op_type == "Constant" and producer.domain == "":
            attr = producer.attributes.get("value")
            if attr is not None and attr.type == ir.AttributeType.TENSOR:
                shape = tuple(attr.value.shape)
    if shape is None and data.shape is not None:
        shape = tuple(data.shape)
    if shape is None or not -len(shape) <= axis < len(shape):
        return None
    length = shape[axis]
    return length if isinstance(length, int) else None


# --------------------------------------------------------------------------- running


class _OrtFailure(Exception):
    """onnxruntime (or serializing the model for it) failed; ``stage`` says where."""

    def __init__(self, stage: str, message: str):
        super().__init__(message)
        self.stage = stage
        self.message = message


def run_model(model: ModelSource, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Run ``model`` once on ``feeds`` in a fresh session (optimizations off), then free it.

    Outputs are keyed by output name; sequence/map outputs are flattened to ``name[i]`` /
    ``name[key]`` entries. onnxruntime errors propagate as BadInputError.
    """
    try:
        runs, _ = _run_session(model, [feeds], repeats=1, label="model", notify=_ignore)
    except _OrtFailure as e:
        raise BadInputError(f"onnxruntime cannot run the model: {_first_line(e.message)}") from None
    return runs[0][0]


def _ignore(_message: str) -> None:
    return None


def _run_session(
    model: ModelSource,
    feed_sets: Sequence[Mapping[str, np.ndarray]],
    *,
    repeats: int,
    label: str,
    notify: Progress,
    only_known_inputs: bool = False,
    until: Callable[[int, dict[str, np.ndarray]], bool] | None = None,
) -> tuple[list[list[dict[str, np.ndarray]]], float]:
    """Create one session, run every feed set ``repeats`` times, release the session.

    Returns ``runs[sample][repeat]`` and the seconds of the first repeat summed over samples.
    ``until(sample, outputs)``, when given, sees each sample's first outputs (which are then
    not kept) and stops the runs by returning True.
    The session never outlives this call, not even when an error propagates.
    """
    runs: list[list[dict[str, np.ndarray]]] = []
    seconds = 0.0
    # Errors are turned into text and re-raised outside the ``except`` blocks, so no traceback
    # (whose frames would reference the session) keeps the session alive after we return.
    failure: _OrtFailure | None = None
    with contextlib.ExitStack() as stack:
        notify(f"creating {label} session")
        session = None
        try:
            session = _create_session(model, stack, label, notify)
        except Exception as e:  # noqa: BLE001 - onnxruntime's refusal, or serializing for it
            failure = _OrtFailure("session creation", _error_text(e))
        if session is not None:
            try:
                runs, seconds, failure = _run_all(
                    session, feed_sets, repeats, label, notify, only_known_inputs, until
                )
            finally:
                session.close()
            notify(f"released {label} session")
    if failure is not None:
        raise failure
    return runs, seconds


def _run_all(
    session: Session,
    feed_sets: Sequence[Mapping[str, np.ndarray]],
    repeats: int,
    label: str,
    notify: Progress,
    only_known_inputs: bool,
    until: Callable[[int, dict[str, np.ndarray]], bool] | None = None,
) -> tuple[list[list[dict[str, np.ndarray]]], float, _OrtFailure | None]:
    runs: list[list[dict[str, np.ndarray]]] = []
    seconds = 0.0
    expected = set(session.input_names)
    n = len(feed_sets)
    for s, feeds in enumerate(feed_sets):
        if only_known_inputs:
            feeds = {k: v for k, v in feeds.items() if k in expected}
        per_sample = []
        for r in range(repeats):
            repeat_text = f" {r + 1}/{repeats}" if repeats > 1 else ""
            done = s * repeats + r
            message = f"{label} run{repeat_text} (sample {s + 1}/{n})"
            notify(ProgressStep(message, done, n * repeats))
            try:
                outputs, took = _run_once(session, feeds)
            except Exception as e:  # noqa: BLE001 - onnxruntime's failure, or packing the feeds
                return runs, seconds, _OrtFailure("run", _error_text(e))
            if r == 0:
                seconds += took
            if until is not None:
                if until(s, outputs):
                    return runs, seconds, None
                continue
            per_sample.append(outputs)
        runs.append(per_sample)
    notify(ProgressStep(f"{label} runs done", n * repeats, n * repeats))
    return runs, seconds, None


def _create_session(model: ModelSource, stack: contextlib.ExitStack, label: str,
                    notify: Progress) -> Session:
    """A session of ``model`` (:mod:`fusectl.ortprocess`); at the newest IR version
    onnxruntime reads when it refuses a newer one that the model's opsets do not need (onnx
    1.23's ``make_model`` writes IR 14, onnxruntime 1.31 reads up to 13: the number only says
    which file-format features a model may use, and onnxruntime still checks every one it
    finds)."""
    try:
        return open_session(_session_source(model, stack))
    except OrtError as e:
        refused = _IR_REFUSED.search(e.message)
        if refused is None:
            raise
        error = e
    loaded = model if isinstance(model, ir.Model) else _load_for_inputs(model)
    supported = int(refused.group(2))
    needed = onnx.helper.find_min_ir_version_for(
        [onnx.helper.make_opsetid(d, v) for d, v in loaded.opset_imports.items()],
        ignore_unknown=True)
    if needed > supported:
        raise error
    written = loaded.ir_version
    loaded.ir_version = supported
    try:
        source = _session_source(loaded, stack)
    finally:
        loaded.ir_version = written  # the caller's model (the candidate) keeps its version
    notify(f"{label}: IR version {written} read as {supported}, the newest onnxruntime reads")
    return open_session(source)


_IR_REFUSED = re.compile(r"Unsupported model IR version: (\d+), max supported IR version: (\d+)")


def _given_inputs(runtime: list[ir.Value], options: ValidationOptions) -> dict[str, Any]:
    """The user's arrays by input name (positions resolved)."""
    return dict(_resolve_positions(options.inputs or {}, [v.name or "" for v in runtime]))


def _dynamic_generated_inputs(model: ir.Model, options: ValidationOptions) -> list[str]:
    """Inputs generated (not given) whose shape has a dynamic dim."""
    runtime = _runtime_inputs(model)
    given = _given_inputs(runtime, options)
    return [v.name or "" for v in runtime
            if v.name not in given and v.name not in options.shapes and v.shape is not None
            and any(not isinstance(d, int) or d < 0 for d in v.shape)]


def _generated_hint(dynamic: list[str], shapes: Mapping[str, tuple[int, ...]]) -> str:
    """For a reference that fails on generated inputs with dynamic dims (a detector whose
    FPN needs sizes divisible by 32 gets 8): which shapes were used and how to choose."""
    if not dynamic:
        return ""
    used = ", ".join(f"{name} {list(shapes.get(name, ()))}" for name in dynamic)
    return (f" (generated inputs: {used}; bind dynamic dims with --dim NAME=VALUE, set an "
            "input's shape with --input-shape NAME=D0,D1,... or give inputs with "
            "--input/--inputs)")


def _session_source(model: ModelSource, stack: contextlib.ExitStack) -> str | bytes:
    """Bytes for an in-memory model, a file path for a large one or one given as a path."""
    if not isinstance(model, ir.Model):
        return os.fspath(model)
    data_bytes, has_external = _tensor_data_size(model)
    in_one = data_bytes < _PROTO_LIMIT_BYTES and not has_external
    encoded = encode_model(model) if in_one else None
    if encoded is not None and encoded.size <= _PIPE_LIMIT_BYTES:
        return encoded.tobytes()
    directory = stack.enter_context(tempfile.TemporaryDirectory(prefix="fusectl-validate-"))
    path = os.path.join(directory, "model.onnx")
    if encoded is not None:
        # a file, not the pipe: onnxruntime's process reads it without a second copy of the
        # weights in memory (the pieces are views of this process's tensors)
        with open(path, "wb") as f:
            encoded.write(f)
    else:
        ir.save(model, path, external_data="model.data")
    return path


def _tensor_data_size(model: ir.Model) -> tuple[int, bool]:
    """Bytes of initializer and constant-attribute data, and whether any lives in a file."""
    tensors: list[ir.TensorProtocol] = []
    for graph in model.graphs():
        tensors.extend(
            v.const_value for v in graph.initializers.values() if v.const_value is not None
        )
    graph_likes: list[Any] = [model.graph, *model.functions.values()]
    for graph_like in graph_likes:
        for node in ir.traversal.RecursiveGraphIterator(graph_like):
            for attr in node.attributes.values():
                if attr.type == ir.AttributeType.TENSOR:
                    tensors.append(attr.value)
                elif attr.type == ir.AttributeType.TENSORS:
                    tensors.extend(attr.value)
    total = sum(int(t.nbytes) for t in tensors)
    return total, any(isinstance(t, ir.ExternalTensor) for t in tensors)


def _run_once(session: Session, feeds: Mapping[str, np.ndarray]
              ) -> tuple[dict[str, np.ndarray], float]:
    """One run's outputs by name (sequences and maps flattened) and its seconds."""
    packed = {k: _pack(v) if isinstance(v, np.ndarray) else v for k, v in feeds.items()}
    values, seconds = session.run(packed)
    flat: dict[str, np.ndarray] = {}
    for name, value in zip(session.output_names, values, strict=True):
        _flatten(name, _unpack(value), flat)
    return flat, seconds


def _numpy_native(dtype: np.dtype) -> bool:
    return dtype.type.__module__ == "numpy"


def _pack(arr: np.ndarray) -> Any:
    """An array as onnxruntime's process takes it: numpy's own types as they are, the others
    (bfloat16, float8, 4-bit: ml_dtypes) as ONNX packs them."""
    if _numpy_native(arr.dtype):
        return arr
    element_type = int(ir.DataType.from_numpy(arr.dtype))
    data = ir.Tensor(np.ascontiguousarray(arr)).tobytes()  # packs 4-bit types like ONNX does
    return (RAW, element_type, tuple(arr.shape), data)


def _unpack(value: Any) -> Any:
    """An output as numpy holds it (the inverse of :func:`_pack`)."""
    if isinstance(value, tuple) and len(value) == 4 and value[0] == RAW:
        _, element_type, shape, data = value
        proto = onnx.helper.make_tensor("output", element_type, shape, data, raw=True)
        return onnx.numpy_helper.to_array(proto)
    if isinstance(value, list):
        return [_unpack(v) for v in value]
    return value


def _flatten(name: str, value: Any, out: dict[str, np.ndarray]) -> None:
    if isinstance(value, np.ndarray):
        out[name] = value
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _flatten(f"{name}[{i}]", item, out)
    elif isinstance(value, dict):
        for key, item in value.items():
            _flatten(f"{name}[{key!r}]", item, out)
    else:
        out[name] = np.asarray(value, dtype=object if value is None else None)


# --------------------------------------------------------------------------- comparison


def compare_outputs(
    reference: Mapping[str, np.ndarray],
    candidate: Mapping[str, np.ndarray],
    *,
    rtol: float | None = None,
    atol: float | None = None,
    sample: int = 0,
    nondeterministic: Collection[str] = frozenset(),
    compute_dtype: np.dtype | None = None,
    range_sample: bool = False,
) -> list[OutputComparison]:
    """Compare outputs matched by name; one OutputComparison per name in either mapping.

    An element passes if ``|c - r| <= atol + rtol * max(|r|, RMS(r))`` (floats); NaN/Inf
    positions must agree, except that an infinity may face a finite value at the type's
    saturation point. A name in ``nondeterministic`` passes (with
    a note) unless its dtype changed. ``compute_dtype`` (a half type the reference computes
    in) sets the tolerances of wider float outputs; in a ``range_sample``, elements where the
    reference is not finite are not compared.
    """
    results = []
    for name, ref in reference.items():
        if name not in candidate:
            results.append(_unmatched(name, np.asarray(ref), sample, "missing from the candidate"))
            continue
        results.append(
            _compare_one(
                name,
                np.asarray(ref),
                np.asarray(candidate[name]),
                _Judge.of(np.asarray(ref).dtype, rtol, atol, compute_dtype),
                sample=sample,
                nondeterministic=name in nondeterministic,
                range_sample=range_sample,
            )
        )
    for name, cand in candidate.items():
        if name not in reference:
            results.append(
                _unmatched(name, np.asarray(cand), sample, "not an output of the reference")
            )
    return results


@dataclass(frozen=True)
class _Judge:
    """How one output is judged: tolerances, the half-type rule, the saturation point."""

    rtol: float
    atol: float
    half: bool
    saturation: float
    tolerance_dtype: str | None

    @classmethod
    def of(
        cls, dtype: np.dtype, rtol: float | None, atol: float | None, compute: np.dtype | None
    ) -> _Judge:
        judged, borrowed = dtype, None
        onnx_type = _onnx_type(dtype)
        if compute is not None and onnx_type in (ir.DataType.FLOAT, ir.DataType.DOUBLE):
            judged, borrowed = compute, _dtype_name(compute)
        r_tol, a_tol = _tolerances(judged, rtol, atol)
        half = _onnx_type(judged) in _HALF_TYPES
        saturation = math.inf
        if onnx_type is not None and onnx_type.is_floating_point():
            saturation = float(onnx_type.max) / (1.0 + r_tol)
        return cls(r_tol, a_tol, half, saturation, borrowed)


def _unmatched(name: str, arr: np.ndarray, sample: int, reason: str) -> OutputComparison:
    rtol, atol = _tolerances(arr.dtype, None, None)
    nan = math.nan
    return OutputComparison(
        name, _dtype_name(arr.dtype), tuple(arr.shape), rtol, atol,
        nan, nan, nan, nan, 100.0, passed=False, reason=reason, sample=sample,
    )  # fmt: skip


def _compare_one(
    name: str,
    ref: np.ndarray,
    cand: np.ndarray,
    judge: _Judge,
    *,
    sample: int,
    nondeterministic: bool,
    range_sample: bool = False,
) -> OutputComparison:
    r_tol, a_tol = judge.rtol, judge.atol
    nan = math.nan

    def verdict(stats, pct, passed, reason, histogram=()):
        return OutputComparison(
            name, _dtype_name(ref.dtype), tuple(ref.shape), r_tol, a_tol, *stats, pct,
            passed=passed, nondeterministic=nondeterministic, reason=reason, sample=sample,
            histogram=histogram, range_sample=range_sample,
            tolerance_dtype=judge.tolerance_dtype,
        )  # fmt: skip

    if ref.dtype != cand.dtype:
        reason = f"dtype mismatch: reference {_dtype_name(ref.dtype)}, "
        reason += f"candidate {_dtype_name(cand.dtype)}"
        return verdict((nan,) * 4, 100.0, False, reason)
    note = "reference output is non-deterministic (its two runs differ); values not held "
    note += "against the candidate"
    if ref.shape != cand.shape:
        reason = f"shape mismatch: reference {tuple(ref.shape)}, candidate {tuple(cand.shape)}"
        if nondeterministic:
            return verdict((nan,) * 4, 100.0, True, f"{note}; {reason}")
        return verdict((nan,) * 4, 100.0, False, reason)

    kind = _kind(ref.dtype)
    histogram: tuple[int, ...] = ()
    if kind == "other":
        bad = np.asarray(ref != cand, dtype=bool).reshape(ref.shape)
        stats: tuple[float, float, float, float] = (nan,) * 4
    else:
        r64, c64 = _as_float64(ref), _as_float64(cand)
        with np.errstate(all="ignore"):
            if kind in ("float", "complex"):
                bad = _out_of_tolerance(r64, c64, judge, skip_reference_overflow=range_sample)
            elif kind == "int" and (r_tol or a_tol):
                bad = np.abs(c64 - r64) > a_tol + r_tol * np.abs(r64)
            else:
                bad = ref != cand
            stats = _statistics(r64, c64, _tiny(ref.dtype))
            histogram = _histogram(r64, c64, bad)
    count = int(np.count_nonzero(bad))
    pct = 100.0 * count / bad.size if bad.size else 0.0
    if nondeterministic:
        return verdict(stats, pct, True, note, histogram)
    if count:
        total = bad.size
        kind_text = "differ" if r_tol == 0 and a_tol == 0 else "are out of tolerance"
        return verdict(stats, pct, False, f"{count} of {total} elements {kind_text}", histogram)
    return verdict(stats, pct, True, None, histogram)


def _out_of_tolerance(
    r: np.ndarray, c: np.ndarray, judge: _Judge, *, skip_reference_overflow: bool = False
) -> np.ndarray:
    finite = np.isfinite(r) & np.isfinite(c)
    same_special = (np.isnan(r) & np.isnan(c)) | (r == c)  # NaN vs NaN, +inf vs +inf
    # An infinity facing a finite value of the same sign at the saturation point: rounding
    # decided on which side of the type's largest value the result fell.
    one_inf = np.isinf(r) != np.isinf(c)
    finite_side = np.where(np.isinf(r), c, r)
    saturated = one_inf & (np.sign(r) == np.sign(c)) & (np.abs(finite_side) >= judge.saturation)
    scale = np.abs(r)
    if r.dtype.kind == "f" or judge.half:  # bfloat16 is not a numpy float kind
        reference_finite = r[np.isfinite(r)]
        if reference_finite.size:
            scale = np.maximum(scale, float(np.sqrt(np.mean(np.square(reference_finite)))))
    close = np.abs(c - r) <= judge.atol + judge.rtol * scale
    bad = np.where(finite, ~close, ~(same_special | saturated))
    if skip_reference_overflow:
        bad &= np.isfinite(r)
    return bad


# How far the float64 run may vouch for a candidate. The reference's own float32 error is
# rounding only while it stays within this multiple of the tolerance (a step function, a
# Floor or an ArgMax flipped by the float64 run, or an evaluator that computes an op
# differently, would otherwise excuse anything); within it, the candidate must be as
# accurate as the reference: at most this many times as many elements out of tolerance of
# the float64 values, and at most this many times its mean error there (plus atol).
_FLOAT64_FLOOR_LIMIT = 20.0
_FLOAT64_WORSE_RATIO = 2.0
_WIDENED_DTYPES = tuple(np.dtype(t.numpy()) for t in float64.WIDENED)


def _against_float64(
    reference: ReferenceRun,
    sample: int,
    candidate: Mapping[str, np.ndarray],
    comparisons: list[OutputComparison],
    options: ValidationOptions,
) -> list[OutputComparison]:
    """Float32 and float16 outputs that failed, judged again against the reference's float64
    run (``_rejudge``, with the tolerances they failed); NaN/Inf positions and every other
    kind of failure stand. Without a float64 value the reason says why, so a failure the
    float64 run might have excused is never silently kept."""
    expected = reference.outputs[sample]
    redo = [
        i for i, c in enumerate(comparisons)
        if not c.passed and not c.nondeterministic
        and c.name in expected and c.name in candidate
        and np.asarray(expected[c.name]).dtype in _WIDENED_DTYPES
        and np.asarray(candidate[c.name]).dtype == np.asarray(expected[c.name]).dtype
        and np.shape(expected[c.name]) == np.shape(candidate[c.name])
    ]
    if not redo:
        return comparisons
    truth = reference.float64_run.get(sample, reference.feed_sets[sample])
    judged = list(comparisons)
    for i in redo:
        name = judged[i].name
        exact = None if isinstance(truth, str) else truth.get(name)
        why = truth if isinstance(truth, str) else _float64_missing(exact, expected[name])
        if exact is None or why is not None:
            judged[i] = replace(judged[i], reason=f"{judged[i].reason}; no float64 run: {why}")
            continue
        judge = _Judge.of(np.asarray(expected[name]).dtype, options.rtol, options.atol,
                          reference.compute_dtype)
        judged[i] = _rejudge(judged[i], expected[name], candidate[name], exact, judge)
    return judged


def _float64_missing(truth: np.ndarray | None, expected: np.ndarray) -> str | None:
    """Why the float64 run has no value to judge this output by, if it has none."""
    if truth is None:
        return "the float64 run has no such output"
    if np.shape(truth) != np.shape(expected):
        return f"its float64 value has shape {list(np.shape(truth))}"
    return None


def _rejudge(comparison: OutputComparison, ref: np.ndarray, cand: np.ndarray,
             truth: np.ndarray, judge: _Judge) -> OutputComparison:
    """The candidate passes when it is as accurate as the reference: every element out of
    tolerance of the reference is within tolerance of the float64 value ``t`` widened by the
    reference's largest rounding error (``|c - t| <= atol + rtol * scale + max|r - t|``), no
    more than twice as many elements as the reference's are out of tolerance of ``t``, its
    mean error against ``t`` is at most twice the reference's, and that largest error is
    rounding (at most ``_FLOAT64_FLOOR_LIMIT`` tolerances)."""
    r, c, t = (np.asarray(a, dtype=np.float64) for a in (ref, cand, truth))
    with np.errstate(all="ignore"):
        known = np.isfinite(r) & np.isfinite(t)
        finite = known & np.isfinite(c)
        rms = float(np.sqrt(np.mean(np.square(r[known])))) if known.any() else 0.0
        tolerance = judge.atol + judge.rtol * np.maximum(np.abs(r), rms)
        floor = float(np.abs(r - t)[known].max()) if known.any() else 0.0
        left = _out_of_tolerance(r, c, judge) & ~(finite & (np.abs(c - t) <= tolerance + floor))
        off_cand = int(np.count_nonzero(finite & (np.abs(c - t) > tolerance)))
        off_ref = int(np.count_nonzero(finite & (np.abs(r - t) > tolerance)))
        mean_cand = float(np.abs(c - t)[finite].mean()) if finite.any() else 0.0
        mean_ref = float(np.abs(r - t)[finite].mean()) if finite.any() else 0.0
        further = int(np.count_nonzero(
            finite & (np.abs(c - t) > np.abs(r - t) + tolerance)))
    problems = []
    if floor > _FLOAT64_FLOOR_LIMIT * (judge.atol + judge.rtol * rms):
        if not comparison.range_sample:
            problems.append("the reference's own error is more than rounding")
        elif further:
            # Inputs at the edge of float16's range can make the model's own float16
            # result meaningless (attention logits in the thousands): the sample then only
            # asks that the candidate be, element by element, no further from exact than
            # the reference (plus the tolerance).
            problems.append(f"the reference's own error is more than rounding and the "
                            f"candidate is further from exact at {further} elements")
    if left.any():
        problems.append(f"{int(np.count_nonzero(left))} beyond the reference's own rounding "
                        "error too")
    if off_cand > _FLOAT64_WORSE_RATIO * off_ref:
        problems.append(f"{off_cand} elements out of tolerance of its float64 run, the "
                        f"reference {off_ref}")
    if mean_cand > _FLOAT64_WORSE_RATIO * mean_ref + judge.atol:
        problems.append(f"mean error against its float64 run {mean_cand:.3g}, the "
                        f"reference's {mean_ref:.3g}")
    if not problems:
        note = (f"{comparison.reason}, but within the reference's own rounding error "
                f"(up to {floor:.3g} from its float64 run): not held against the candidate")
        return replace(comparison, passed=True, reason=note, float64_floor=floor)
    return replace(comparison, float64_floor=floor,
                   reason=f"{comparison.reason} ({'; '.join(problems)}; its rounding error is "
                          f"up to {floor:.3g})")


def _histogram(r: np.ndarray, c: np.ndarray, bad: np.ndarray) -> tuple[int, ...]:
    """Counts per ``HISTOGRAM_LABELS`` bucket of ``|c - r|``."""
    finite = np.isfinite(r) & np.isfinite(c)
    diff = np.abs(c[finite] - r[finite])
    exact = int(np.count_nonzero(diff == 0))
    positive = diff[diff > 0]
    low, high = _DECADES[0] - 1, _DECADES[-1] + 1
    exponents = np.clip(np.floor(np.log10(positive)), low, high).astype(np.int64)
    decades = np.bincount(exponents - low, minlength=high - low + 1)
    mismatched = int(np.count_nonzero(bad & ~finite))
    return (exact, *(int(n) for n in decades), mismatched)


def _statistics(r: np.ndarray, c: np.ndarray, tiny: float) -> tuple[float, float, float, float]:
    """max abs, max rel, mean abs error and cosine similarity over elements finite in both."""
    finite = np.isfinite(r) & np.isfinite(c)
    rf, cf = r[finite], c[finite]
    if rf.size == 0:
        return 0.0, 0.0, 0.0, 1.0
    diff = np.abs(cf - rf)
    max_abs = float(diff.max())
    mean_abs = float(diff.mean())
    max_rel = float((diff / np.maximum(np.abs(rf), tiny)).max())
    scale = float(max(np.abs(rf).max(), np.abs(cf).max()))
    if scale == 0.0:
        return max_abs, max_rel, mean_abs, 1.0
    rs, cs = rf / scale, cf / scale
    nr, nc = float(np.linalg.norm(rs)), float(np.linalg.norm(cs))
    if nr == 0.0 or nc == 0.0:
        cosine = 1.0 if nr == nc else 0.0
    else:
        cosine = float(np.clip(np.dot(rs, cs) / (nr * nc), -1.0, 1.0))
    return max_abs, max_rel, mean_abs, cosine


def _onnx_type(dtype: np.dtype) -> ir.DataType | None:
    try:
        return ir.DataType.from_numpy(dtype)
    except (TypeError, ValueError, KeyError):
        return None


def _kind(dtype: np.dtype) -> str:
    onnx_type = _onnx_type(dtype)
    if onnx_type is None or onnx_type == ir.DataType.STRING:
        return "other"
    if _is_complex(onnx_type):
        return "complex"
    if onnx_type.is_floating_point():
        return "float"
    if onnx_type.is_integer():
        return "int"
    if onnx_type == ir.DataType.BOOL:
        return "bool"
    return "other"


def _tolerances(dtype: np.dtype, rtol: float | None, atol: float | None) -> tuple[float, float]:
    kind = _kind(dtype)
    if kind in ("bool", "other"):
        return 0.0, 0.0
    if kind == "int":
        default = (0.0, 0.0)
    else:
        onnx_type = _onnx_type(dtype)
        assert onnx_type is not None
        if onnx_type in _FLOAT_TOLERANCES:
            default = _FLOAT_TOLERANCES[onnx_type]
        else:  # float8/float6/float4: one unit in the last place, relative and absolute
            default = (float(onnx_type.eps), float(onnx_type.eps))
    return (
        float(default[0] if rtol is None else rtol),
        float(default[1] if atol is None else atol),
    )


def _tiny(dtype: np.dtype) -> float:
    """Floor of ``|r|`` in relative errors: the type's smallest normal float, else 1."""
    onnx_type = _onnx_type(dtype)
    if onnx_type is not None and onnx_type.is_floating_point():
        return float(onnx_type.tiny)
    if onnx_type in (ir.DataType.COMPLEX64, ir.DataType.COMPLEX128):
        return float(np.finfo(dtype).tiny)
    return 1.0


def _as_float64(arr: np.ndarray) -> np.ndarray:
    if arr.dtype.kind == "c":
        return np.stack([arr.real, arr.imag], axis=-1).astype(np.float64)
    return arr.astype(np.float64)


def _dtype_name(dtype: np.dtype) -> str:
    return "string" if dtype.kind in "OUS" else str(dtype.name)


def _shape_text(shape: ir.Shape) -> str:
    return "[" + ",".join(str(d) if isinstance(d, int) else str(d.value) for d in shape) + "]"


# --------------------------------------------------------------------------- validate


def validate(
    reference: ModelSource,
    candidate: ModelSource,
    options: ValidationOptions | None = None,
    progress: Progress | None = None,
) -> ValidationResult:
    """Run both models on the same inputs and compare every output.

    The reference runs twice per sample; outputs that differ between its own runs are
    marked non-deterministic and not held against the candidate. Raises BadInputError if
    the reference cannot be run; a candidate that cannot be run gives ``error`` and a failed
    result. ``options=None`` means ``ValidationOptions()``.
    """
    options = options or ValidationOptions()
    reference_run = run_reference(reference, options, progress)
    return check_candidate(reference_run, candidate, options, progress)


def run_reference(
    reference: ModelSource,
    options: ValidationOptions | None = None,
    progress: Progress | None = None,
) -> ReferenceRun:
    """Generate the input sets and run the reference twice on each, then free its session.

    Raises BadInputError when inputs cannot be generated or the reference cannot be run.
    """
    options = options or ValidationOptions()
    notify = progress or _ignore
    if options.samples < 1:
        raise BadInputError(f"samples must be at least 1, got {options.samples}")
    try:
        return _run_reference(reference, options, notify)
    except _ReferenceFailure as failure:
        first = failure
    for attempt in first.fallbacks:
        notify(f"the input model fails on generated inputs; trying "
               f"{_generated_at(attempt, options)}")
        try:
            run = _run_reference(reference, attempt, notify, plan_fallbacks=False)
        except _ReferenceFailure as failure:
            if not failure.ran:
                break  # no other inputs help (the session cannot be created)
            continue
        note = (f"inputs generated with {_generated_at(attempt, options)}: the input model "
                f"fails with {_generated_at(options, attempt)} ({first.error})")
        notify(note)
        return replace(run, batch_note=note)
    raise first.error from None


def _distinct_fallbacks(model: ir.Model, options: ValidationOptions
                        ) -> list[ValidationOptions]:
    """The fallbacks that generate other inputs than ``options`` and each other."""
    tried = [_generated_shapes(model, options)]
    distinct = []
    for attempt in _fallbacks(options):
        # the inputs the attempt chooses (the user's fixed shapes are the same in every one)
        shapes = _generated_shapes(model, attempt)
        too_big = sum(math.prod(s) for s in shapes) > _GENERATED_ELEMENTS
        if shapes not in tried and not too_big:
            tried.append(shapes)
            distinct.append(attempt)
    return distinct


def _fallbacks(options: ValidationOptions) -> list[ValidationOptions]:
    """The generated-input settings to try after ``options``: batch-like dims at 1, other
    dynamic dims at 32, both, then other dims at 512 (an audio model whose STFT reflects a
    window of 512 samples: silero-vad), also with batch 1. ``_distinct_fallbacks`` drops
    those that repeat inputs, and the 512 ones whose inputs would be large."""
    return [replace(options, batch=_FALLBACK_BATCH), replace(options, size=_FALLBACK_DIM),
            replace(options, batch=_FALLBACK_BATCH, size=_FALLBACK_DIM),
            replace(options, size=_FALLBACK_LONG),
            replace(options, batch=_FALLBACK_BATCH, size=_FALLBACK_LONG)]


def _generated_at(options: ValidationOptions, other: ValidationOptions) -> str:
    """How ``options`` generates inputs, where it differs from ``other``."""
    said = [f"batch-like dims at {options.batch}"] if options.batch != other.batch else []
    if options.size != other.size:
        said.append(f"{'other ' if said else ''}dynamic dims at {options.size}")
    return " and ".join(said)


class _ReferenceFailure(Exception):
    """onnxruntime could not run the reference on generated inputs; ``ran``: the session was
    created (other inputs may help); ``fallbacks``: the settings whose other inputs may let
    it run (planned for the first attempt only, none when the session cannot be created)."""

    def __init__(self, error: BadInputError, ran: bool,
                 fallbacks: list[ValidationOptions]) -> None:
        super().__init__(str(error))
        self.error, self.ran, self.fallbacks = error, ran, fallbacks


def _run_reference(reference: ModelSource, options: ValidationOptions,
                   notify: Progress, plan_fallbacks: bool = True) -> ReferenceRun:
    reference_ir = _load_for_inputs(reference)
    note = None
    if plan_fallbacks:  # the first attempt (fallbacks are sized within the budget already)
        options, note = _within_element_budget(reference_ir, options)
        if note is not None:
            notify(note)
    feed_sets = []
    for s in range(options.samples):
        notify(f"generating inputs (sample {s + 1}/{options.samples})")
        feed_sets.append(generate_inputs(reference_ir, options, s))
    compute = _compute_dtype(reference_ir)
    range_sample = range_scale = None
    if (
        options.fp16_range_sample
        and _uses_type(reference_ir, ir.DataType.FLOAT16)
        and _range_sample_inputs(reference_ir, options)
    ):
        notify("choosing the float16 range sample")
        found = _range_sample_feeds(reference_ir, options, len(feed_sets), notify)
        if found is not None:
            range_scale, feeds = found
            range_sample = len(feed_sets)
            feed_sets.append(feeds)
    dynamic = _dynamic_generated_inputs(reference_ir, options)
    # shapes only, from the model loaded once; a fallback attempt plans no further ones
    fallbacks = _distinct_fallbacks(reference_ir, options) if plan_fallbacks else []
    del reference_ir
    input_shapes = {k: tuple(int(d) for d in np.shape(v)) for k, v in feed_sets[0].items()}
    try:
        runs, seconds = _run_session(
            reference, feed_sets, repeats=2, label="reference", notify=notify
        )
    except _OrtFailure as e:
        ran = e.stage != "session creation"
        raise _ReferenceFailure(BadInputError(
            f"onnxruntime cannot run the input model: {_first_line(e.message)}"
            f"{_generated_hint(dynamic, input_shapes)}"
        ), ran, fallbacks if ran else []) from None
    if options.inputs:
        _check_not_vacuous(runs[0][0])
    unstable = []
    for first, second in runs:
        self_check = compare_outputs(first, second, rtol=options.rtol, atol=options.atol,
                                     compute_dtype=compute)
        unstable.append(frozenset(c.name for c in self_check if not c.passed))
    return ReferenceRun(
        feed_sets=tuple(feed_sets),
        outputs=tuple(first for first, _second in runs),
        unstable=tuple(unstable),
        input_shapes=input_shapes,
        seconds=seconds,
        range_sample=range_sample,
        range_scale=range_scale,
        compute_dtype=compute,
        float64_run=Float64Outputs(float64.Float64Run(reference)),
        batch_note=note,
    )


def _within_element_budget(model: ir.Model, options: ValidationOptions
                           ) -> tuple[ValidationOptions, str | None]:
    """``options`` with the dynamic dims' size halved until the generated inputs hold at
    most ``_GENERATED_ELEMENTS`` (a 9-D input of symbolic dims holds 134M elements at 8,
    and took a minute to validate a two-node model), and a note saying so; ``options``
    itself when they fit, or when no size would make them fit (static dims)."""
    def elements(size: int) -> int:
        return sum(math.prod(s) for s in _generated_shapes(model, replace(options, size=size)))

    wanted = elements(options.size)
    size = options.size
    while size > 1 and elements(size) > _GENERATED_ELEMENTS:
        size //= 2
    if size == options.size or elements(size) > _GENERATED_ELEMENTS:
        return options, None
    return replace(options, size=size), (
        f"inputs generated with dynamic dims at {size}: at {options.size} they would hold "
        f"{wanted:,} elements (bind dims with --dim NAME=VALUE)")


def _range_sample_feeds(
    reference: ir.Model, options: ValidationOptions, index: int, notify: Progress
) -> tuple[float, dict[str, np.ndarray]] | None:
    """The widest generated float range (512, 256, ... 4) at which no float16 value of the
    reference overflows more than on ordinary inputs, and its feeds; None if there is none.

    onnxruntime's CPU provider runs most float16 ops in float32, so a reference that would
    overflow on float16 hardware may not here, while a fused kernel with a true float16
    implementation does: comparing them there would be a false alarm. A copy of the
    reference with its float16 values exposed as outputs (which makes onnxruntime round
    them to float16) tells how wide the inputs may be.
    """
    probe = reference.clone()
    with contextlib.suppress(Exception):  # best effort: untyped values are not exposed
        infer_model_shapes(probe)
    present = {v.name for v in probe.graph.outputs}
    for node in probe.graph:
        for value in node.outputs:
            half = value.type is not None and value.type.dtype == ir.DataType.FLOAT16
            if half and value.name and value.name not in present:
                probe.graph.outputs.append(value)
                present.add(value.name)
    scales = [_FP16_RANGE / 2**i for i in range(8)]
    feed_sets = [generate_inputs(reference, options, index)]
    feed_sets += [
        generate_inputs(reference, options, index, float_range=(-scale, scale)) for scale in scales
    ]
    baseline: dict[str, int] = {}
    chosen: list[int] = []

    def in_range(run: int, outputs: Mapping[str, np.ndarray]) -> bool:
        overflows = {
            name: int(np.count_nonzero(~np.isfinite(value)))
            for name, value in outputs.items()
            if value.dtype.kind == "f"
        }
        if run == 0:
            baseline.update(overflows)
            return False
        if all(count <= baseline.get(name, 0) for name, count in overflows.items()):
            chosen.append(run)
            return True
        return False

    try:
        _run_session(probe, feed_sets, repeats=1, label="reference (float16 range)",
                     notify=notify, until=in_range)
    except _OrtFailure:
        return None
    if not chosen:
        return None
    return scales[chosen[0] - 1], feed_sets[chosen[0]]


def check_candidate(
    reference: ReferenceRun,
    candidate: ModelSource,
    options: ValidationOptions | None = None,
    progress: Progress | None = None,
) -> ValidationResult:
    """Run ``candidate`` on the reference's inputs and compare it with the kept outputs."""
    options = options or ValidationOptions()
    notify = progress or _ignore
    compute_name = None if reference.compute_dtype is None else _dtype_name(reference.compute_dtype)
    shared: dict[str, Any] = dict(  # what the reference run tells, whatever the candidate does
        input_shapes=reference.input_shapes, seconds_reference=reference.seconds,
        samples=len(reference.feed_sets), compute_dtype=compute_name,
        range_scale=reference.range_scale, batch_note=reference.batch_note)
    try:
        cand_runs, cand_seconds = _run_session(
            candidate, reference.feed_sets, repeats=1, label="candidate", notify=notify,
            only_known_inputs=True,
        )  # fmt: skip
    except _OrtFailure as e:
        where = "load" if e.stage == "session creation" else "run"
        return ValidationResult(
            outputs=(), error=f"onnxruntime could not {where} the candidate: {e.message}",
            **shared)
    notify("comparing outputs")
    comparisons: list[OutputComparison] = []
    for s, (expected, unstable, runs) in enumerate(
        zip(reference.outputs, reference.unstable, cand_runs, strict=True)
    ):
        found = compare_outputs(
            expected,
            runs[0],
            rtol=options.rtol,
            atol=options.atol,
            sample=s,
            nondeterministic=unstable,
            compute_dtype=reference.compute_dtype,
            range_sample=s == reference.range_sample,
        )
        comparisons.extend(_against_float64(reference, s, runs[0], found, options))
    return ValidationResult(outputs=tuple(comparisons), error=None,
                            seconds_candidate=cand_seconds, **shared)


def check_intermediates(
    reference: ModelSource,
    candidate: ir.Model,
    values: Sequence[str],
    run: ReferenceRun,
    options: ValidationOptions | None = None,
    progress: Progress | None = None,
) -> tuple[OutputComparison, ...]:
    """Compare intermediate values that exist by name in both models (e.g. the outputs of
    each rewritten subgraph), in the order of ``values``, on the first input set.

    Both models are copied with those values exposed as extra graph outputs and run one
    after the other (the reference twice, so non-deterministic values are flagged). Values
    missing from either model, or already graph outputs, are left out.
    """
    options = options or ValidationOptions()
    notify = progress or _ignore
    reference_ir = _load_for_inputs(reference)
    reference_ir = reference_ir.clone() if reference_ir is reference else reference_ir
    candidate_ir = candidate.clone()
    for model_ir in (reference_ir, candidate_ir):
        produced = _produced_values(model_ir.graph)
        if any(produced[n].type is None for n in values if n in produced):
            with contextlib.suppress(Exception):  # best effort: untyped values are skipped
                infer_model_shapes(model_ir)
    reference_values = _produced_values(reference_ir.graph)
    candidate_values = _produced_values(candidate_ir.graph)
    exposed = []
    for name in dict.fromkeys(values):
        ref_value, cand_value = reference_values.get(name), candidate_values.get(name)
        if ref_value is None or cand_value is None:
            continue
        if ref_value.is_graph_output() or cand_value.is_graph_output():
            continue  # compared as an output already
        value_type = ref_value.type or cand_value.type
        if value_type is None:
            continue
        for value, model_ir in ((ref_value, reference_ir), (cand_value, candidate_ir)):
            value.type = value.type or value_type
            model_ir.graph.outputs.append(value)
        exposed.append(name)
    if not exposed:
        return ()
    feeds = [run.feed_sets[0]]
    try:
        ref_runs, _ = _run_session(reference_ir, feeds, repeats=2, label="reference (values)",
                                   notify=notify)
        cand_runs, _ = _run_session(candidate_ir, feeds, repeats=1, label="candidate (values)",
                                    notify=notify, only_known_inputs=True)
    except _OrtFailure as e:
        raise BadInputError(
            f"onnxruntime cannot run the models with intermediate outputs: {_first_line(e.message)}"
        ) from None
    first, second = ref_runs[0]
    pick = {n: first[n] for n in exposed}
    unstable = {
        c.name for c in compare_outputs(pick, {n: second[n] for n in exposed}) if not c.passed
    }
    return tuple(
        compare_outputs(
            pick,
            {n: cand_runs[0][0][n] for n in exposed},
            rtol=options.rtol,
            atol=options.atol,
            nondeterministic=unstable,
            compute_dtype=run.compute_dtype,
        )
    )


def _produced_values(graph: ir.Graph) -> dict[str, ir.Value]:
    return {v.name: v for node in graph for v in node.outputs if v.name}


def _load_for_inputs(model: ModelSource) -> ir.Model:
    if isinstance(model, ir.Model):
        return model
    try:
        loaded = ir.load(os.fspath(model))
    except Exception as e:
        raise BadInputError(f"cannot read model {os.fspath(model)}: {_first_line(e)}") from None
    # an input out of topological order (fusectl.repair forgives it) cannot be cloned
    TopologicalSortPass()(loaded)
    return loaded


def _uses_type(model: ir.Model, dtype: ir.DataType) -> bool:
    """Whether ``model`` holds or computes a tensor of ``dtype`` anywhere."""
    for graph in model.graphs():
        values = [*graph.inputs, *graph.outputs, *graph.initializers.values()]
        for value in values:
            if value.type is not None and value.type.dtype == dtype:
                return True
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if node.op_type in ("Cast", "CastLike") and node.attributes.get_int("to", 0) == dtype:
            return True
        for value in node.outputs:
            if value.type is not None and value.type.dtype == dtype:
                return True
        for attr in node.attributes.values():
            if attr.type == ir.AttributeType.TENSOR and attr.value.dtype == dtype:
                return True
    return False


def _compute_dtype(model: ir.Model) -> np.dtype | None:
    """The loosest half type the model computes in: it bounds every float output's accuracy."""
    for dtype in _HALF_TYPES:
        if _uses_type(model, dtype):
            return dtype.numpy()
    return None


def _range_sample_inputs(model: ir.Model, options: ValidationOptions) -> list[str]:
    """Generated float inputs the range sample would change."""
    provided = {k for k in (options.inputs or {}) if isinstance(k, str)}
    positions = {k for k in (options.inputs or {}) if isinstance(k, int)}
    names = []
    for index, value in enumerate(_runtime_inputs(model)):
        name = value.name or ""
        if name in provided or index in positions or name in options.input_ranges:
            continue
        if "mask" in name.lower() or not isinstance(value.type, ir.TensorType):
            continue
        if value.type.dtype.is_floating_point():
            names.append(name)
    return names


# --------------------------------------------------------------------------- reporting


def to_dict(result: ValidationResult) -> dict[str, Any]:
    """A JSON-ready view of ``result``: plain Python types, NaN -> None, inf -> "inf"."""
    return {
        "passed": result.passed,
        "error": result.error,
        "input_shapes": {k: [int(d) for d in v] for k, v in result.input_shapes.items()},
        "seconds_reference": _json_float(result.seconds_reference),
        "seconds_candidate": _json_float(result.seconds_candidate),
        "samples": int(result.samples),
        "compute_dtype": result.compute_dtype,
        "range_scale": result.range_scale,
        "batch_note": result.batch_note,
        "outputs": [comparison_to_dict(o) for o in result.outputs],
    }


def comparison_to_dict(o: OutputComparison) -> dict[str, Any]:
    """A JSON-ready view of one output comparison, every statistic included."""
    return {
        "name": o.name,
        "sample": int(o.sample),
        "dtype": o.dtype,
        "shape": [int(d) for d in o.shape],
        "passed": bool(o.passed),
        "nondeterministic": bool(o.nondeterministic),
        "reason": o.reason,
        "rtol": _json_float(o.rtol),
        "atol": _json_float(o.atol),
        "max_abs": _json_float(o.max_abs),
        "max_rel": _json_float(o.max_rel),
        "mean_abs": _json_float(o.mean_abs),
        "cosine": _json_float(o.cosine),
        "pct_out_of_tol": _json_float(o.pct_out_of_tol),
        "range_sample": bool(o.range_sample),
        "tolerance_dtype": o.tolerance_dtype,
        "error_histogram": dict(zip(HISTOGRAM_LABELS, o.histogram, strict=False)),
        "float64_floor": None if o.float64_floor is None else _json_float(o.float64_floor),
    }


def _json_float(value: float) -> float | str | None:
    value = float(value)
    if math.isnan(value):
        return None
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return value


# --------------------------------------------------------------------------- helpers


def _error_text(error: BaseException) -> str:
    if isinstance(error, OrtError):
        return error.message
    text = str(error).strip()
    return text or type(error).__name__


def _first_line(error: BaseException | str) -> str:
    return first_line(error if isinstance(error, str) else _error_text(error)) or "unknown error"
