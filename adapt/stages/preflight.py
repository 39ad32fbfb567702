"""Stage 0: the pre-adaptation checklist.

Each item is checked where this machine can check it and listed where it cannot; an item that
cannot be checked here never fails the gate, it says what to run where.

Items:
- driver and CUDA: ``nvidia-smi`` (driver version, GPUs, their compute capability and memory)
  and torch's CUDA build; for Gaudi and Ascend targets the vendor's tool (``hl-smi``, ``npu-smi``):
  device count and HBM per device against the profile, or what could not be checked without it;
- software: torch, triton and vLLM versions; whether the installed triton is the one torch
  was built against; whether the vLLM version has the model's features (DSA: >= 0.11.0,
  gpt-oss MXFP4: >= 0.10.1);
- formats: the target's compute capability and native dtypes against the formats the model
  needs (fp8 compute: sm89+, DeepSeek sparse attention: sm90+, native MXFP4 MMA: sm100+; on
  sm90 MXFP4 experts are decoded in-kernel or converted to FP8; NVFP4 experts need native fp4:
  sm100+ with "fp4" among the target's native dtypes, on older NVIDIA GPUs vLLM falls back to
  weight-only Marlin FP4, elsewhere there is no NVFP4 path), and a local GPU against the target profile;
- memory: the headroom rule of stages 2 and 4 (``adapt.plan.headroom.assess``) applied to the
  run directory's stage-2 plan (``memory.json``);
- evaluation data for stage 5 (``eval_data``): parsed, items counted per task (``eval_items``).
"""

from __future__ import annotations

import importlib.metadata
import json
import platform
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from adapt.errors import InputError
from adapt.report import StageReport, fingerprint, load_gates, now_iso
from adapt.targets.target import Target, load_target

OK, FAIL, WARN, ELSEWHERE, NOT_RUN = "ok", "fail", "warn", "cannot check here", "not run"
# vLLM releases that added the model features adapt hands over (vLLM blogs: gpt-oss 2025-08-05
# with 0.10.1; DeepSeek-V3.2-Exp day-0 support 2025-09-29 with 0.11.0).
VLLM_MIN_FOR = {"mla+dsa": (0, 11, 0), "mxfp4": (0, 10, 1)}
# Compute capability each format needs on NVIDIA: fp8 tensor cores (Ada/Hopper+, vLLM FP8 docs),
# FlashMLA sparse kernels (Hopper/Blackwell, vllm#31480), fp4 tensor cores (Blackwell) for MXFP4 and
# NVFP4 (vLLM quantization/modelopt.py: CUTLASS / FlashInfer FP4 GEMM and MoE on sm100; older GPUs
# run utils/marlin_utils_fp4.py, weight-only FP4 Marlin, as the vllm-cuda stack table records).
MIN_CC = {"fp8": 8.9, "mla+dsa": 9.0, "mxfp4_mma": 10.0, "nvfp4_mma": 10.0}


@dataclass
class Check:
    """One checklist item: status ok | fail | warn | cannot check here | not run."""

    item: str
    status: str
    detail: str

    def row(self) -> dict[str, str]:
        return {"check": self.item, "status": self.status, "detail": self.detail}


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _release(version: str) -> tuple[int, ...]:
    """Leading numeric release of a version string ("0.11.2.dev3+g12" -> (0, 11, 2))."""
    parts = []
    for piece in re.split(r"[.+-]", version):
        if not piece.isdigit():
            break
        parts.append(int(piece))
    return tuple(parts)


def nvidia_smi() -> list[dict[str, str]] | None:
    """GPUs as nvidia-smi reports them (name, driver_version, memory.total, compute_cap), or None
    when nvidia-smi is absent or fails."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    fields = ("name", "driver_version", "memory.total", "compute_cap")
    try:
        out = subprocess.run(
            [exe, f"--query-gpu={','.join(fields)}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return [
        dict(zip(fields, (v.strip() for v in line.split(",")), strict=False))
        for line in out.strip().splitlines()
        if line.strip()
    ]


# Vendor tools of accelerators that are not NVIDIA GPUs: target vendor -> (tool, what it would show).
VENDOR_TOOLS = {
    "intel": ("hl-smi", "Gaudi cards, driver version and HBM size per card"),
    "huawei": ("npu-smi", "Ascend NPUs, their chip names and HBM size per NPU"),
}


def vendor_tool_check(target: Target, which=shutil.which, timeout_s: float = 20) -> Check | None:
    """Read the target vendor's device tool (hl-smi for Gaudi, npu-smi for Ascend) when present:
    device count and HBM per device against the target profile. None for vendors without such a
    tool here (NVIDIA is read through nvidia-smi above; a CPU has none)."""
    if target.vendor not in VENDOR_TOOLS:
        return None
    tool, what = VENDOR_TOOLS[target.vendor]
    exe = which(tool)
    if exe is None:
        return Check(f"{tool}", ELSEWHERE, f"{tool} not found: {what} cannot be checked here; run "
                     f"`adapt preflight --target {target.name}` on a {target.name} node")
    argv = ([exe, "-Q", "name,driver_version,memory.total", "-f", "csv,noheader"] if tool == "hl-smi"
            else [exe, "info"])
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=True).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return Check(tool, FAIL, f"`{' '.join(argv[1:])}` failed: {str(exc)[:200]}")
    devices = _hl_smi_devices(out) if tool == "hl-smi" else _npu_smi_devices(out)
    if not devices:
        return Check(tool, WARN, f"{tool} ran but listed no device adapt could read: {out.strip()[:200]!r}")
    mib = [d["memory_mib"] for d in devices if d.get("memory_mib")]
    detail = (f"{len(devices)} device(s): {', '.join(sorted({d['name'] for d in devices}))}"
              + (f", {min(mib):,} MiB each" if mib else "") + (f", driver {devices[0]['driver']}"
                                                              if devices[0].get("driver") else ""))
    expected = target.memory_bytes / 2**20
    if mib and abs(min(mib) - expected) > 0.05 * expected:
        return Check(tool, WARN, f"{detail}; the {target.name} profile says {expected:,.0f} MiB per device")
    return Check(tool, OK, detail)


def _hl_smi_devices(text: str) -> list[dict]:
    """Rows of ``hl-smi -Q name,driver_version,memory.total -f csv,noheader`` ("HL-325L, 1.20.0, 131072 MiB")."""
    rows = []
    for line in text.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 3 and parts[0]:
            size = re.match(r"(\d+)", parts[2])
            rows.append({"name": parts[0], "driver": parts[1], "memory_mib": int(size.group(1)) if size else None})
    return rows


def _npu_smi_devices(text: str) -> list[dict]:
    """NPUs of ``npu-smi info``: a "| <id> <chip name> | <health> | ..." line per NPU, then a line whose
    last "<used> / <total>" pair is its HBM in MB."""
    rows: list[dict] = []
    for line in text.splitlines():
        name = re.match(r"^\|\s*\d+\s+(\w*9\d\d\w*)\s*\|", line)
        if name:
            rows.append({"name": name.group(1), "memory_mib": None})
            continue
        pairs = re.findall(r"(\d+)\s*/\s*(\d+)", line)
        if rows and rows[-1]["memory_mib"] is None and len(pairs) >= 2:
            rows[-1]["memory_mib"] = int(pairs[-1][1])
    return rows


def _driver_checks(gpus: list[dict[str, str]] | None) -> list[Check]:
    import torch

    checks = []
    if gpus is None:
        checks.append(
            Check(
                "driver",
                ELSEWHERE,
                "nvidia-smi not found: no NVIDIA driver on this machine; "
                "run `adapt preflight` on the target node",
            )
        )
    else:
        names = sorted({g.get("name", "?") for g in gpus})
        checks.append(
            Check(
                "driver",
                OK,
                f"driver {gpus[0].get('driver_version', '?')}, {len(gpus)} GPU(s): {', '.join(names)}",
            )
        )
    cuda = torch.version.cuda
    if cuda is None:
        checks.append(Check("cuda", ELSEWHERE, f"torch {torch.__version__} is a CPU build (no CUDA runtime)"))
    elif not torch.cuda.is_available():
        checks.append(Check("cuda", FAIL, f"torch built for CUDA {cuda} but no CUDA device is usable"))
    else:
        checks.append(Check("cuda", OK, f"torch CUDA {cuda}, {torch.cuda.device_count()} device(s) visible"))
    return checks


def _software_checks(needs: set[str]) -> list[Check]:
    import torch

    checks = [Check("python", OK, platform.python_version())]
    triton = _version("triton")
    checks.append(Check("torch", OK, torch.__version__))
    pinned = [r for r in (importlib.metadata.requires("torch") or []) if r.startswith("triton")]
    if triton is None:
        checks.append(Check("triton", FAIL, "triton is not installed; adapt's kernels need it"))
    elif not pinned:
        checks.append(Check("triton", OK, f"{triton} (this torch build pins no triton version)"))
    else:
        wanted = re.search(r"==\s*([\w.]+)", pinned[0])
        good = wanted is None or _release(wanted.group(1)) == _release(triton)
        checks.append(
            Check("triton", OK if good else FAIL, f"{triton}; torch requires {pinned[0].split(';')[0]}")
        )
    vllm = _version("vllm")
    if vllm is None:
        checks.append(
            Check(
                "vllm",
                ELSEWHERE,
                "vLLM is not installed in this environment (the serve extra); check on the serving node",
            )
        )
        return checks
    problems = [
        f"{feature} needs vLLM >= {'.'.join(map(str, least))}"
        for feature, least in VLLM_MIN_FOR.items()
        if feature in needs and _release(vllm) < least
    ]
    checks.append(
        Check("vllm", FAIL if problems else OK, vllm + (": " + "; ".join(problems) if problems else ""))
    )
    return checks


def model_needs(model: str | None) -> tuple[set[str], str]:
    """Formats and features the model needs ({"fp8", "mxfp4", "mla+dsa", ...}) and its model_type."""
    if model is None:
        return set(), ""
    from adapt.model.spec import COMPONENTS, load_spec

    spec = load_spec(model)
    needs = {spec.quant.format_of(c).method for c in COMPONENTS} - {"bf16", "fp16", "fp32"}
    needs = {"fp8" if n == "fp8_block" else n for n in needs}
    needs |= {layer.attention.kind for layer in spec.layers if layer.attention.kind == "mla+dsa"}
    return needs, spec.model_type


def _capability(cc: str) -> float | None:
    try:
        return float(cc)
    except ValueError:
        return None


def _format_checks(target: Target, needs: set[str], gpus: list[dict[str, str]] | None) -> list[Check]:
    checks = []
    cc = _capability(target.compute_capability)
    if "fp8" in needs:
        if "fp8" not in target.native_dtypes:
            checks.append(
                Check(
                    "fp8 weights",
                    FAIL,
                    f"{target.name} has no native fp8; dequantize to bf16 (weights x2, re-plan stage 2)",
                )
            )
        elif cc is not None and cc < MIN_CC["fp8"]:
            checks.append(
                Check("fp8 weights", FAIL, f"fp8 compute needs sm{MIN_CC['fp8']:g}+, {target.name} is {cc:g}")
            )
        else:
            checks.append(
                Check("fp8 weights", OK, f"{target.name} ({target.compute_capability}) computes fp8")
            )
    if "mla+dsa" in needs:
        if cc is None:
            checks.append(
                Check(
                    "sparse attention (DSA)",
                    WARN,
                    f"{target.name} is not NVIDIA ({target.compute_capability}): vLLM's FlashMLA "
                    "sparse path does not apply; see the stage-1 inventory for its stack",
                )
            )
        elif cc < MIN_CC["mla+dsa"]:
            checks.append(
                Check(
                    "sparse attention (DSA)",
                    FAIL,
                    f"FlashMLA sparse needs sm90+, {target.name} is {cc:g}; adapt's Triton DSA kernels "
                    "are the path (stage 3)",
                )
            )
        else:
            checks.append(
                Check("sparse attention (DSA)", OK, f"sm{cc * 10:g} runs FlashMLA sparse + DeepGEMM indexer")
            )
    if "mxfp4" in needs:
        native = "mxfp4" in target.native_dtypes and (cc is None or cc >= MIN_CC["mxfp4_mma"])
        detail = (
            f"{target.name} has native MXFP4 MMA"
            if native
            else f"{target.name} ({target.compute_capability}) has no native MXFP4 MMA (needs sm100): "
            "experts "
            "are decoded in-kernel to bf16, or converted online MXFP4 -> FP8 "
            "(adapt.kernels.mxfp4.mxfp4_to_fp8)"
        )
        checks.append(Check("mxfp4 experts", OK, detail))
    if "nvfp4" in needs:
        checks.append(_nvfp4_check(target, cc))
    if gpus:
        local = {g.get("compute_cap", "") for g in gpus}
        matches = target.compute_capability in local
        checks.append(
            Check(
                "local GPU vs target",
                OK if matches else WARN,
                f"local compute capability {', '.join(sorted(local))}, target {target.name} is "
                f"{target.compute_capability}",
            )
        )
    else:
        checks.append(
            Check(
                "local GPU vs target",
                ELSEWHERE,
                f"no GPU here; {target.name} profile says compute capability {target.compute_capability}",
            )
        )
    return checks


def _nvfp4_check(target: Target, cc: float | None) -> Check:
    """NVFP4 experts (E2M1 values, e4m3 scale per 16, fp32 global scale) against the target's native fp4.

    ok: "fp4" is a native dtype (and, on NVIDIA, sm100+); warn: an NVIDIA GPU without fp4 units, where
    vLLM runs the experts through weight-only Marlin FP4 (W4A16); fail: any other target without fp4,
    which has no NVFP4 path in its vLLM stack."""
    item = "nvfp4 experts"
    has_fp4 = "fp4" in target.native_dtypes
    if has_fp4 and (cc is None or cc >= MIN_CC["nvfp4_mma"]):
        return Check(item, OK, f"{target.name} ({target.compute_capability}) has native fp4 for NVFP4 GEMMs")
    if cc is not None:
        return Check(
            item,
            WARN,
            f"{target.name} (sm{cc * 10:g}) has no fp4 units (NVFP4 GEMMs need sm{MIN_CC['nvfp4_mma'] * 10:g} and "
            "fp4 among the native dtypes): vLLM falls back to weight-only Marlin FP4 (bf16 compute); time it in "
            "stage 3, or requantize the experts to fp8",
        )
    return Check(
        item,
        FAIL,
        f"{target.name} ({target.compute_capability}) has no native fp4 and its stack has no NVFP4 path; "
        "dequantize the experts to bf16 (about 3.6x their stored bytes) or requantize to a format the target "
        "computes, then re-plan stage 2",
    )


def _memory_check(run_dir: Path | None) -> Check:
    """The headroom rule (``adapt.plan.headroom.assess``) on the run's stage-2 plan, from ``memory.json``."""
    from adapt.plan.headroom import assess

    path = run_dir / "memory.json" if run_dir is not None else None
    if path is None or not path.is_file():
        return Check(
            "memory headroom",
            NOT_RUN,
            "no stage-2 report in the run directory; run `adapt plan-memory ... --run <id>` first",
        )
    try:
        data = json.loads(path.read_text())
        metrics = data["metrics"]
        terms = {k: int(v) for k, v in metrics["terms"].items() if k != "kv_cache"}
        budget = int(metrics["budget_bytes"])
        rule = assess(terms, budget_bytes=budget, kv_bytes_per_sequence=int(metrics["kv_bytes_per_sequence"]),
                      requested_sequences=int(metrics["sequences_per_replica"]))
    except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
        raise InputError(
            "stage-2 report lacks metrics terms / budget_bytes / kv_bytes_per_sequence / sequences_per_replica",
            file=path, hint="run stage 2 again with this adapt version",
        ) from None
    return Check("memory headroom", OK if rule.passes else FAIL,
                 f"stage 2 verdict {data.get('verdict', '?')}; {rule.verdict}: {rule.describe(budget)}")


EVAL_SUFFIXES = (".jsonl", ".json", ".txt")


def eval_items(path: Path) -> dict[str, int]:
    """Items per task in one evaluation file (InputError on a file that does not parse).

    ``.jsonl``: one JSON object per non-empty line, its task from a ``"task"`` field or the file
    name; ``.json``: a list of objects (task: the file name or each ``"task"``) or an object of
    task -> list; ``.txt``: one prompt per non-empty line (task: the file name). An item must be
    a non-empty object or non-empty text.
    """
    counts: dict[str, int] = {}

    def add(task: str, item) -> None:
        if not item or not isinstance(item, (dict, str)):
            raise InputError(f"expected a non-empty JSON object or text per item, got {item!r:.60}", file=path)
        key = str(item.get("task", task)) if isinstance(item, dict) else task
        counts[key] = counts.get(key, 0) + 1

    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read evaluation data: {exc}", file=path, field="--eval-data") from None
    if path.suffix == ".txt":
        for line in text.splitlines():
            if line.strip():
                add(path.stem, line.strip())
    elif path.suffix == ".jsonl":
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                add(path.stem, json.loads(line))
            except json.JSONDecodeError as exc:
                raise InputError(f"line {number} is not JSON: {exc.msg}", file=path, field="--eval-data") from None
    elif path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InputError(f"not valid JSON: {exc.msg} at line {exc.lineno}", file=path,
                             field="--eval-data") from None
        groups = data.items() if isinstance(data, dict) else [(path.stem, data)]
        for task, items in groups:
            if not isinstance(items, list):
                raise InputError(f"expected a list of items for task {task!r}", file=path, field="--eval-data")
            for item in items:
                add(task, item)
    else:
        raise InputError(f"unknown evaluation file type; expected {', '.join(EVAL_SUFFIXES)}", file=path,
                         field="--eval-data")
    return counts


def _eval_check(eval_data: Path | None) -> Check:
    """Parse the evaluation data (a file, or every evaluation file under a directory) and count
    items per task: none, or a file that does not parse, fails; a missing path is bad input."""
    item = "evaluation data (stage 5)"
    if eval_data is None:
        return Check(item, WARN, "not given; pass --eval-data with the prompts stage 5 scores")
    if not eval_data.exists():
        raise InputError("no such file or directory", file=eval_data, field="--eval-data",
                         hint="pass the evaluation data file or directory stage 5 will read")
    files = sorted(p for p in eval_data.rglob("*") if p.is_file() and p.suffix in EVAL_SUFFIXES) \
        if eval_data.is_dir() else [eval_data]
    counts: dict[str, int] = {}
    for path in files:
        try:
            found = eval_items(path)
        except InputError as exc:
            return Check(item, FAIL, exc.line())
        for task, n in found.items():
            counts[task] = counts.get(task, 0) + n
    if not counts:
        return Check(item, FAIL, f"{eval_data}: no evaluation items in {len(files)} file(s)")
    per_task = ", ".join(f"{task} {n}" for task, n in sorted(counts.items()))
    return Check(item, OK, f"{eval_data}: {sum(counts.values())} items ({per_task})")


def run_preflight(
    target: str,
    model: str | None,
    run_dir: Path | None,
    *,
    eval_data: Path | None = None,
    gates: dict | None = None,
    gpus: list[dict[str, str]] | None | str = "detect",
) -> StageReport:
    """Stage 0 as a gated report (stage "preflight", number 0).

    target: name or YAML; model: preset, config.json or directory (None: no format checks);
    run_dir: the run directory holding a stage-2 report (None: not checked); eval_data: file or
    directory for stage 5; gates: full gates dict (recorded; the headroom rule reads the stage-2 plan);
    gpus: nvidia-smi rows to use instead of detecting them ("detect"), None for no GPU.
    """
    started = now_iso()
    gates = gates if gates is not None else load_gates()
    headroom = float(gates.get("memory", {}).get("headroom_fraction", 0.2))
    tgt = load_target(target)
    needs, model_type = model_needs(model)
    found = nvidia_smi() if gpus == "detect" else gpus
    vendor = vendor_tool_check(tgt)
    checks = (
        _driver_checks(found)
        + ([vendor] if vendor else [])
        + _software_checks(needs)
        + _format_checks(tgt, needs, found)
        + [_memory_check(run_dir), _eval_check(eval_data)]
    )
    report = StageReport(stage="preflight", number=0, title="Preflight checklist", started=started)
    for check in checks:
        if check.status == FAIL:
            report.add("error", f"preflight.{_code(check.item)}", check.detail)
        elif check.status == WARN:
            report.add("warn", f"preflight.{_code(check.item)}", check.detail)
        elif check.status in (ELSEWHERE, NOT_RUN):
            report.add("info", f"preflight.{_code(check.item)}", f"{check.status}: {check.detail}")
    counts = {s: sum(1 for c in checks if c.status == s) for s in (OK, FAIL, WARN, ELSEWHERE, NOT_RUN)}
    report.tables["checklist"] = [c.row() for c in checks]
    report.metrics = {
        "checks": counts,
        "needs": sorted(needs),
        "target": tgt.name,
        "compute_capability": tgt.compute_capability,
    }
    report.summary = f"{len(checks)} checks for {model_type or 'no model'} on {tgt.name}: " + ", ".join(
        f"{v} {k}" for k, v in counts.items() if v
    )
    report.fingerprint = fingerprint(
        target=tgt.name, model=model, eval_data=str(eval_data) if eval_data else None, headroom=headroom
    )
    report.finished = now_iso()
    report.decide()
    return report


def _code(item: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", item.lower()).strip("_")
