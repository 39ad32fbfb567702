"""Target: an accelerator profile (YAML) and the operator support tables of software stacks.

A target is named (``h200``, ``h100-sxm``, ``b200``, ``mi300x``, ``cpu``: files beside this
module) or given as a path to the user's own YAML. Every number in a profile carries its
source (a datasheet, or a measurement with date) in a ``sources`` mapping.

Units in the Target object: bytes, bytes/s, FLOP/s, seconds.

Stack tables (``stacks/<name>.yaml``, or a user's YAML path) map semantic operators to
``native`` | ``composable`` | ``adapt_kernel`` | ``missing``, each with a reason.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from adapt.errors import InputError

HERE = Path(__file__).parent
GiB = 1024**3
SUPPORT_STATUSES = ("native", "composable", "adapt_kernel", "missing")

# field -> (type, unit multiplier into base units, required)
_SCALARS: dict[str, tuple[type, float, bool]] = {
    "devices_per_node": (int, 1, True),
    "max_nodes": (int, 1, False),
    "memory_gib": (float, GiB, True),
    "hbm_bandwidth_tbs": (float, 1e12, True),
    "intra_node_bandwidth_gbs": (float, 1e9, True),
    "inter_node_bandwidth_gbs": (float, 1e9, True),
    "intra_node_latency_us": (float, 1e-6, True),
    "inter_node_latency_us": (float, 1e-6, True),
}
# link rates and latencies may be 0 only on a single-device, single-node target (it has no links)
_LINK_FIELDS = ("intra_node_bandwidth_gbs", "inter_node_bandwidth_gbs", "intra_node_latency_us",
                "inter_node_latency_us")


@dataclass(frozen=True)
class Target:
    """An accelerator and how its devices are connected.

    memory_bytes: usable device memory per device (bytes)
    hbm_bandwidth: device memory bandwidth (bytes/s)
    peak_flops: dtype ("fp32", "bf16", "fp16", "fp8", "fp4", "int8") -> dense FLOP/s per device
    native_dtypes: dtypes the matrix units take natively
    intra_node_bandwidth / inter_node_bandwidth: per-device, one direction (bytes/s)
    intra_node_latency / inter_node_latency: per collective step (s)
    compute_capability: e.g. "9.0" (NVIDIA), "gfx942" (AMD), "cpu"
    default_stack: the stack table used when none is named
    sources: field -> where its number came from
    calibration: for a target written by ``adapt calibrate``: what was measured, where and when,
        which fields stay datasheet, what was refused and why, every timed point ({} otherwise)
    """

    name: str
    path: str
    vendor: str
    description: str
    devices_per_node: int
    max_nodes: int
    memory_bytes: int
    hbm_bandwidth: float
    peak_flops: dict[str, float]
    native_dtypes: tuple[str, ...]
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    intra_node_latency: float
    inter_node_latency: float
    compute_capability: str
    default_stack: str
    sources: dict[str, str] = field(default_factory=dict)
    calibration: dict[str, Any] = field(default_factory=dict)

    def supports_dtype(self, dtype: str) -> bool:
        return dtype in self.native_dtypes

    def flops(self, dtype: str) -> float:
        """Dense FLOP/s for a dtype; falls back to bf16 for dtypes the units do not take natively
        (they are upcast before the MMA)."""
        return self.peak_flops.get(dtype) or self.peak_flops["bf16"]

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "vendor": self.vendor, "description": self.description,
            "devices_per_node": self.devices_per_node, "max_nodes": self.max_nodes,
            "memory_gib": self.memory_bytes / GiB, "hbm_bandwidth_tbs": self.hbm_bandwidth / 1e12,
            "peak_tflops": {k: v / 1e12 for k, v in self.peak_flops.items()},
            "native_dtypes": list(self.native_dtypes),
            "intra_node_bandwidth_gbs": self.intra_node_bandwidth / 1e9,
            "inter_node_bandwidth_gbs": self.inter_node_bandwidth / 1e9,
            "compute_capability": self.compute_capability, "default_stack": self.default_stack,
            "sources": dict(self.sources),
        }


def target_names() -> list[str]:
    return sorted(p.stem for p in HERE.glob("*.yaml"))


def _read_yaml(path: Path, what: str) -> dict[str, Any]:
    from adapt.report import load_yaml

    data = load_yaml(path, what)
    if not isinstance(data, dict):
        raise InputError(f"expected a mapping at the top of the {what}", file=path)
    return data


def _resolve(name_or_path: str, folder: Path, what: str, names: list[str]) -> Path:
    candidate = Path(name_or_path)
    if candidate.suffix in (".yaml", ".yml") or candidate.exists():
        if not candidate.is_file():
            raise InputError(f"{what} file not found", file=candidate)
        return candidate
    builtin = folder / f"{name_or_path}.yaml"
    if builtin.is_file():
        return builtin
    raise InputError(f"unknown {what} {name_or_path!r}; known: {', '.join(names)}",
                     hint=f"or pass a path to your own {what} YAML")


def load_target(name_or_path: str) -> Target:
    """A built-in target by name or a user's YAML by path; schema-checked (InputError on any problem)."""
    path = _resolve(name_or_path, HERE, "target", target_names())
    data = _read_yaml(path, "target")
    values: dict[str, Any] = {}
    for key, (kind, unit, required) in _SCALARS.items():
        if key not in data:
            if required:
                raise InputError("missing required field", file=path, field=key,
                                 hint=f"see {HERE / 'h200.yaml'} for an example")
            continue
        value = data[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
            raise InputError(f"expected {'an integer' if kind is int else 'a number'}, got {value!r}",
                             file=path, field=key)
        if not math.isfinite(value) or value < 0 or (value == 0 and key not in _LINK_FIELDS):
            raise InputError(f"expected a finite number > 0, got {value!r}", file=path, field=key)
        values[key] = value * unit
    single = values["devices_per_node"] == 1 and values.get("max_nodes", 1) == 1
    zero_links = [k for k in _LINK_FIELDS if k in values and values[k] == 0]
    if zero_links and not single:
        raise InputError("expected a finite number > 0, got 0 (only a 1-device, 1-node target has no links)",
                         file=path, field=zero_links[0])
    peak = data.get("peak_tflops")
    if not isinstance(peak, dict) or "bf16" not in peak:
        raise InputError("expected a mapping of dtype -> dense TFLOP/s that includes bf16",
                         file=path, field="peak_tflops")
    peak_flops = {}
    for dtype, rate in peak.items():
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not math.isfinite(rate) or rate <= 0:
            raise InputError(f"expected a finite number > 0, got {rate!r}", file=path, field=f"peak_tflops.{dtype}")
        peak_flops[str(dtype)] = float(rate) * 1e12
    native = data.get("native_dtypes", [])
    if not isinstance(native, list) or not all(isinstance(d, str) for d in native):
        raise InputError("expected a list of dtype names", file=path, field="native_dtypes")
    sources = data.get("sources", {})
    if not isinstance(sources, dict):
        raise InputError("expected a mapping of field -> source", file=path, field="sources")
    unsourced = [k for k in list(_SCALARS) + ["peak_tflops"] if k in data and k not in sources]
    if unsourced:
        raise InputError(f"numbers without a source: {', '.join(unsourced)}", file=path, field="sources",
                         hint="add a datasheet reference or 'measured YYYY-MM-DD ...' for each")
    known = set(_SCALARS) | {"name", "vendor", "description", "peak_tflops", "native_dtypes",
                             "compute_capability", "default_stack", "sources", "calibration"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise InputError(f"unknown field(s): {', '.join(unknown)}", file=path, field=unknown[0],
                         hint=f"known fields: {', '.join(sorted(known))}")
    return Target(
        name=str(data.get("name", path.stem)), path=str(path), vendor=str(data.get("vendor", "unknown")),
        description=str(data.get("description", "")),
        devices_per_node=int(values["devices_per_node"]), max_nodes=int(values.get("max_nodes", 1)),
        memory_bytes=int(values["memory_gib"]), hbm_bandwidth=values["hbm_bandwidth_tbs"],
        peak_flops=peak_flops, native_dtypes=tuple(native),
        intra_node_bandwidth=values["intra_node_bandwidth_gbs"],
        inter_node_bandwidth=values["inter_node_bandwidth_gbs"],
        intra_node_latency=values["intra_node_latency_us"], inter_node_latency=values["inter_node_latency_us"],
        compute_capability=str(data.get("compute_capability", "unknown")),
        default_stack=str(data.get("default_stack", "vllm-cuda")), sources={str(k): str(v) for k, v in sources.items()},
        calibration=_calibration(data, path),
    )


def _calibration(data: dict[str, Any], path: Path) -> dict[str, Any]:
    """The ``calibration`` section of a calibrated target (a mapping; {} when absent)."""
    section = data.get("calibration", {})
    if not isinstance(section, dict):
        raise InputError("expected the mapping `adapt calibrate` writes", file=path, field="calibration")
    return section


# ---------------------------------------------------------------- stack support tables


@dataclass(frozen=True)
class Support:
    """How a stack provides one semantic operator.

    status: native | composable | adapt_kernel | missing
    reason: why (what it is composed from, which adapt kernel and its test, what is missing)
    requires: dtypes / capabilities the op needs from the target (e.g. ["fp8"], or "sm90" for an
        NVIDIA compute capability of at least 9.0); when the target lacks one, the entry turns into a gap
    kernel / test: for adapt_kernel, the function ("adapt.kernels.dsa.index_topk") and its tolerance test
    plan: what closes the gap when the op is missing or a requirement is unmet ("" = no plan)
    """

    op: str
    status: str
    reason: str
    requires: tuple[str, ...] = ()
    kernel: str = ""
    test: str = ""
    plan: str = ""


@dataclass(frozen=True)
class StackTable:
    name: str
    path: str
    description: str
    ops: dict[str, Support]

    def lookup(self, op: str) -> Support | None:
        return self.ops.get(op)


def stack_names() -> list[str]:
    return sorted(p.stem for p in (HERE / "stacks").glob("*.yaml"))


def load_stack(name_or_path: str) -> StackTable:
    """A stack's operator support table by name (stacks/<name>.yaml) or a user's YAML path."""
    path = _resolve(name_or_path, HERE / "stacks", "stack", stack_names())
    data = _read_yaml(path, "stack table")
    ops = data.get("ops")
    if not isinstance(ops, dict) or not ops:
        raise InputError("expected a non-empty mapping of operator -> {status, reason}", file=path, field="ops")
    table = {}
    for op, entry in ops.items():
        where = f"ops.{op}"
        if not isinstance(entry, dict):
            raise InputError("expected a mapping with status and reason", file=path, field=where)
        status = entry.get("status")
        if status not in SUPPORT_STATUSES:
            raise InputError(f"status must be one of {', '.join(SUPPORT_STATUSES)}, got {status!r}",
                             file=path, field=f"{where}.status")
        reason = entry.get("reason")
        if not isinstance(reason, str) or not reason.strip():
            raise InputError("every entry needs a reason", file=path, field=f"{where}.reason")
        requires = entry.get("requires", [])
        if not isinstance(requires, list):
            raise InputError("expected a list", file=path, field=f"{where}.requires")
        if status == "adapt_kernel" and not (entry.get("kernel") and entry.get("test")):
            raise InputError("an adapt_kernel entry names its kernel and its tolerance test", file=path,
                             field=f"{where}.kernel" if not entry.get("kernel") else f"{where}.test")
        table[str(op)] = Support(op=str(op), status=status, reason=reason.strip(),
                                 requires=tuple(str(r) for r in requires),
                                 kernel=str(entry.get("kernel", "")), test=str(entry.get("test", "")),
                                 plan=str(entry.get("plan", "")).strip())
    return StackTable(name=str(data.get("name", path.stem)), path=str(path),
                      description=str(data.get("description", "")), ops=table)
