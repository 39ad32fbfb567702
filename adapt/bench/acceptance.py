"""Benchmark results as a stage-6 StageReport: acceptance lines computed from measured rows only.

A benchmark yields rows (dicts; a timed row has ``time_us``) and a list of ``Criterion``. Each
criterion computes its value from the rows; a value it cannot compute (its row is missing, was
skipped or failed) makes the line unmet, never silently absent. A timed row must carry
``twin_rel_error`` (||kernel - twin|| / ||twin|| of the output it timed, against the torch twin with
the same signature); one that lacks it, or whose error exceeds its ``twin_tolerance``, or that
carries ``twin_mismatch`` (a check that is not a norm, e.g. a top-k selection that differs), is an
error: a fast wrong kernel is not a result. A row with ``baseline`` set (torch or a peer library timed
beside adapt) gets the same checks as warnings: a baseline that computes something else makes its
comparison doubtful, but it is not adapt's kernel failing.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from adapt.report import StageReport, now_iso

_OPS = {">=": operator.ge, "<=": operator.le}


@dataclass
class Criterion:
    """One acceptance line: ``value(rows)`` (None when a needed row is missing) ``op`` ``bound``."""

    text: str
    value: Callable[[list[dict[str, Any]]], float | None]
    op: str
    bound: float


def find_row(rows: list[dict[str, Any]], **match: Any) -> dict[str, Any] | None:
    """The first measured row whose fields equal ``match`` (rows with ``error`` or ``skipped`` never match)."""
    for row in rows:
        if "error" in row or row.get("skipped"):
            continue
        if all(row.get(k) == v for k, v in match.items()):
            return row
    return None


def evaluate(criteria: list[Criterion], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One line per criterion: criterion (its text), value (None when its row is missing), bound, met."""
    lines = []
    for c in criteria:
        if c.op not in _OPS:
            raise ValueError(f"criterion {c.text!r}: op must be one of {sorted(_OPS)}")
        try:
            value = c.value(rows)
        except (KeyError, TypeError, ZeroDivisionError):
            value = None
        met = value is not None and not math.isnan(value) and _OPS[c.op](value, c.bound)
        lines.append({"criterion": c.text, "value": value, "bound": f"{c.op} {c.bound:g}", "met": bool(met)})
    return lines


def benchmark_report(name: str, title: str, rows: list[dict[str, Any]], criteria: list[Criterion], *,
                     provenance: dict[str, Any], ceilings: dict[str, Any] | None = None,
                     started: str = "") -> StageReport:
    """A StageReport (stage ``bench-<name>``, number 6) with the rows as a table, one line per
    criterion (met / unmet with its measured value), and the twin-error check of every timed row."""
    report = StageReport(stage=f"bench-{name}", number=6, title=title, started=started or now_iso(),
                         fingerprint=dict(provenance))
    lines = evaluate(criteria, rows)
    for line in lines:
        c, value, met = line["criterion"], line["value"], line["met"]
        if value is None:
            report.add("error", "bench.acceptance", f"{c}: unmet, its measured row is missing")
        elif not met:
            report.add("error", "bench.acceptance", f"{c}: unmet, measured {value:.4g}")
        else:
            report.add("info", "bench.acceptance", f"{c}: met, measured {value:.4g}")
    for row in rows:
        if "time_us" not in row or "error" in row or row.get("skipped"):
            continue
        label = ", ".join(f"{k}={row[k]}" for k in ("shape", "tokens", "context", "batch", "variant", "phase")
                          if k in row)
        severity = "warn" if row.get("baseline") else "error"
        err = row.get("twin_rel_error")
        if row.get("twin_mismatch"):
            report.add(severity, "bench.twin", f"{label}: differs from the twin: {row['twin_mismatch']}")
        if err is None:
            report.add(severity, "bench.untwinned", f"{label}: timed without its error against the twin")
        elif math.isnan(err) or ("twin_tolerance" in row and err > row["twin_tolerance"]):
            report.add(severity, "bench.twin", f"{label}: error against the twin {err:.3g} "
                       f"(tolerance {row.get('twin_tolerance')})")
    report.tables["acceptance"] = lines
    report.tables["rows"] = rows
    report.metrics = {**provenance, "ceilings": ceilings or {},
                      "acceptance_met": sum(line["met"] for line in lines), "acceptance_lines": len(lines)}
    report.finished = now_iso()
    report.decide()
    return report
