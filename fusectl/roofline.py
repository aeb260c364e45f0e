"""Device profiles and the roofline estimate: is a kernel limited by memory or by compute?

Why this exists: "this fusion saves N bytes" matters only for kernels whose time is spent
moving bytes. A roofline needs two numbers per device - peak DRAM bandwidth and peak
compute - and says that a kernel takes at least ``max(bytes / bandwidth, flops / peak)``.
A kernel whose memory time is the larger one is memory-bound: fusing it away saves time; a
compute-bound kernel costs its FLOPs wherever it runs.

A device profile is a small YAML file::

    name: my-npu                # optional, defaults to the file name
    description: what it is     # optional
    bandwidth_gb_s: 100         # peak DRAM bandwidth, GB/s (1 GB = 1e9 bytes)
    peak_gflop_s: 4000          # peak compute, GFLOP/s (1 GFLOP = 1e9 FLOPs)

``cpu``, ``a100`` and ``h100`` ship with fusectl (``fusectl/devices/*.yaml``; their
comments give the arithmetic and the datasheet figures).
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import yaml

from .errors import BadInputError
from .traffic import NodeTraffic, TrafficReport

__all__ = [
    "Device",
    "NodeRoofline",
    "Roofline",
    "builtin_devices",
    "load_device",
    "roofline",
]

_REQUIRED = ("bandwidth_gb_s", "peak_gflop_s")
_KEYS = frozenset({"name", "description", *_REQUIRED})


@dataclass(frozen=True)
class Device:
    """Peak DRAM bandwidth (bytes/s) and peak compute (FLOP/s) of one device."""

    name: str
    bandwidth: float
    peak_flops: float
    description: str = ""
    source: str = "builtin"

    @property
    def ridge(self) -> float:
        """FLOPs per byte above which a kernel is compute-bound."""
        return self.peak_flops / self.bandwidth


def _devices_folder() -> Path:
    folder = Path(str(resources.files("fusectl") / "devices"))
    if not folder.is_dir():  # pragma: no cover - an installation without package data
        folder = Path(__file__).resolve().parent / "devices"
    return folder


def builtin_devices() -> dict[str, Path]:
    """The device profiles shipped with fusectl, by name."""
    return {path.stem: path for path in sorted(_devices_folder().glob("*.yaml"))}


def load_device(spec: str | Path | Device) -> Device:
    """A built-in profile by name (``cpu``, ``a100``, ``h100``) or a YAML file.

    Any problem (unreadable file, bad YAML, unknown key, missing or non-positive number)
    is one BadInputError line naming the file.
    """
    if isinstance(spec, Device):
        return spec
    builtin = builtin_devices()
    if isinstance(spec, str) and spec in builtin:
        return _parse(builtin[spec], "builtin")
    path = Path(spec)
    if not path.is_file():
        names = ", ".join(builtin)
        raise BadInputError(f"--device {spec}: not a built-in device ({names}) nor a YAML file")
    return _parse(path, str(path))


def _parse(path: Path, source: str) -> Device:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise BadInputError(f"{path}: cannot read device profile: {exc}") from None
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        line = f":{where.line + 1}" if where is not None else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise BadInputError(f"{path}{line}: invalid YAML in device profile: {problem}") from None
    if not isinstance(data, dict):
        raise BadInputError(f"{path}: a device profile is a mapping with "
                            f"{' and '.join(_REQUIRED)}")
    unknown = sorted(str(k) for k in data if k not in _KEYS)
    if unknown:
        raise BadInputError(f"{path}: unknown key {unknown[0]!r} in device profile "
                            f"(known: {', '.join(sorted(_KEYS))})")
    numbers = {}
    for key in _REQUIRED:
        value = data.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise BadInputError(f"{path}: {key} must be a positive number, got {value!r}")
        numbers[key] = float(value)
    for key in ("name", "description"):
        if key in data and not isinstance(data[key], str):
            raise BadInputError(f"{path}: {key} must be a string")
    return Device(
        name=data.get("name") or path.stem,
        bandwidth=numbers["bandwidth_gb_s"] * 1e9,
        peak_flops=numbers["peak_gflop_s"] * 1e9,
        description=data.get("description", ""),
        source=source,
    )


@dataclass(frozen=True)
class NodeRoofline:
    """One kernel on one device: the time its bytes and its FLOPs need at peak."""

    node: NodeTraffic
    memory_seconds: float
    compute_seconds: float

    @property
    def seconds(self) -> float:
        """Roofline time: the larger of the memory and the compute time."""
        return max(self.memory_seconds, self.compute_seconds)

    @property
    def bound(self) -> str:
        """``memory``, ``compute``, or ``none`` for a kernel that moves and computes nothing."""
        if self.memory_seconds == 0 and self.compute_seconds == 0:
            return "none"
        return "memory" if self.memory_seconds >= self.compute_seconds else "compute"

    @property
    def intensity(self) -> float | None:
        """Arithmetic intensity, FLOPs per byte moved (None when no byte moves)."""
        moved = self.node.bytes_total
        return self.node.flops / moved if moved else None


@dataclass(frozen=True)
class Roofline:
    """Every kernel of a traffic report on one device, and the summed time."""

    device: Device
    nodes: tuple[NodeRoofline, ...]

    @property
    def seconds(self) -> float:
        """Sum over kernels of max(bytes / bandwidth, FLOPs / peak)."""
        return sum(n.seconds for n in self.nodes)

    def count(self, bound: str) -> int:
        """Kernels that are ``memory``- or ``compute``-bound (or ``none``)."""
        return sum(1 for n in self.nodes if n.bound == bound)


def roofline(report: TrafficReport, device: Device) -> Roofline:
    """Place every kernel of ``report`` (folded nodes excluded) on ``device``'s roofline."""
    return Roofline(
        device,
        tuple(
            NodeRoofline(n, n.bytes_total / device.bandwidth, n.flops / device.peak_flops)
            for n in report.nodes
            if n.is_kernel
        ),
    )
