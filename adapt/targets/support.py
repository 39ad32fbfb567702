"""Operators against a target's stack table: native, composable, adapt_kernel or missing, each
refusal with its reason. Shared by stage 1 (the inventory) and stage 3 (which kernels to test).
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adapt.model.operators import SemanticOp
from adapt.targets.target import StackTable, Support, Target

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class GapRow:
    """One operator classified against a stack.

    status: native | composable | adapt_kernel | missing (after the target's requirements)
    provided: what provides it, or why it is missing; plan: what would close a gap ("" = no plan)
    """

    op: SemanticOp
    status: str
    provided: str
    plan: str = ""
    kernel: str = ""
    test: str = ""
    stack_status: str = ""

    def row(self) -> dict[str, Any]:
        text = self.provided + (f" | plan: {self.plan}" if self.status == "missing" and self.plan else "")
        return {
            "op": self.op.name,
            "kind": self.op.kind,
            "status": self.status,
            "provided by / reason": text,
            "count": self.op.count,
            "layers": format_layers(self.op.layers),
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.op.to_dict(),
            "status": self.status,
            "provided": self.provided,
            "plan": self.plan,
            "kernel": self.kernel,
            "test": self.test,
            "stack_status": self.stack_status,
        }


def format_layers(layers) -> str:
    """Layer indices as ranges ("0-2, 3-60", "1-35 every 2"); "model" for model-level operators."""
    items = sorted(layers)
    if not items:
        return "model"
    ranges, start, prev = [], items[0], items[0]
    for value in items[1:]:
        if value != prev + 1:
            ranges.append((start, prev))
            start = value
        prev = value
    ranges.append((start, prev))
    steps = {b - a for a, b in zip(items, items[1:], strict=False)}
    if len(items) >= 3 and len(steps) == 1 and min(steps) > 1:
        return f"{items[0]}-{items[-1]} every {steps.pop()}"
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in ranges)


def unmet_requirements(requires: tuple[str, ...], target: Target) -> list[str]:
    """Requirements of a stack entry the target lacks, each as a reason.

    A requirement is a dtype the matrix units must take natively ("fp8", "mxfp4", ...: checked
    against ``native_dtypes``) or "sm<NN>" (NVIDIA compute capability at least NN/10).
    """
    reasons = []
    for need in requires:
        match = re.fullmatch(r"sm(\d+)", need)
        if match:
            wanted = int(match.group(1)) / 10
            try:
                have = float(target.compute_capability)
            except ValueError:
                reasons.append(
                    f"needs NVIDIA compute capability >= {wanted:g}; {target.name} is "
                    f"{target.compute_capability}"
                )
                continue
            if have < wanted:
                reasons.append(f"needs compute capability >= {wanted:g}; {target.name} has {have:g}")
        elif need not in target.native_dtypes:
            reasons.append(
                f"needs native {need}; {target.name} native dtypes are {', '.join(target.native_dtypes)}"
            )
    return reasons


def _kernel_problem(kernel: str) -> str:
    """Why an adapt kernel named "adapt.kernels.module.function" is not usable here ("" when it is)."""
    module_name, _, function = kernel.rpartition(".")
    if not module_name.startswith("adapt."):
        return f"{kernel!r} is not an adapt module path"
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        return f"{module_name} does not import here ({exc})"
    if not callable(getattr(module, function, None)):
        return f"{module_name} has no function {function}"
    return ""


def classify(op: SemanticOp, stack: StackTable, target: Target) -> GapRow:
    """One operator against a stack table and a target: every refusal says why."""
    entry: Support | None = stack.lookup(op.name)
    if entry is None:
        return GapRow(op, "missing", f"stack {stack.name} has no entry for {op.name}", stack_status="absent")
    unmet = unmet_requirements(entry.requires, target)
    if unmet:
        return GapRow(
            op,
            "missing",
            f"{entry.status} in {stack.name} but " + "; ".join(unmet),
            plan=entry.plan,
            kernel=entry.kernel,
            test=entry.test,
            stack_status=entry.status,
        )
    if entry.status == "adapt_kernel":
        problem = _kernel_problem(entry.kernel)
        if problem:
            return GapRow(
                op,
                "missing",
                f"adapt kernel {entry.kernel}: {problem}",
                plan=entry.plan,
                kernel=entry.kernel,
                test=entry.test,
                stack_status=entry.status,
            )
        test_note = "" if (REPO_ROOT / entry.test).is_file() else " (test file not in this checkout)"
        return GapRow(
            op,
            "adapt_kernel",
            f"{entry.kernel}, tolerance test {entry.test}{test_note}: {entry.reason}",
            kernel=entry.kernel,
            test=entry.test,
            stack_status=entry.status,
        )
    return GapRow(
        op,
        entry.status,
        entry.reason,
        plan=entry.plan,
        kernel=entry.kernel,
        test=entry.test,
        stack_status=entry.status,
    )
