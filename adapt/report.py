"""Stage reports, gate verdicts, run directories and atomic writers.

A stage returns a ``StageReport``; ``RunDir.write(report)`` puts
``<stage>.json``, ``<stage>.md`` and ``<stage>.junit.xml`` into ``reports/<run-id>/`` and
updates ``manifest.json``. Every file is written to a temp file in the same directory
and renamed into place, so an interrupted run never leaves a half-written report.

Verdicts: "pass" (warnings allowed), "warn", "fail". Exit codes: 0 pass or warn,
1 gate failed, 2 bad input or usage (``adapt.errors.InputError``).
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import subprocess
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

import yaml

from adapt import __version__
from adapt.errors import InputError

SEVERITIES = ("info", "warn", "error")
VERDICTS = ("pass", "warn", "fail")
EXIT_PASS, EXIT_GATE_FAILED, EXIT_BAD_INPUT = 0, 1, 2
DEFAULT_GATES = Path(__file__).with_name("gates.yaml")


@dataclass
class Finding:
    """One observation: severity "info" | "warn" | "error", a stable code, a message, a hint."""

    severity: str
    code: str
    message: str
    hint: str = ""

    def __post_init__(self):
        if self.severity not in SEVERITIES:
            raise ValueError(f"severity must be one of {SEVERITIES}, got {self.severity!r}")


@dataclass
class StageReport:
    """The result of one stage.

    stage: "inventory" | "memory" | "kernels" | "parallel" | "precision" | "bench" | ...
    number: the pipeline stage number (1..6; 0 for auxiliary reports such as info)
    verdict: "pass" | "warn" | "fail" (``decide`` derives it from findings when unset)
    metrics: flat or nested JSON-able numbers; findings: list of Finding
    tables: named tables (list of row dicts) rendered into Markdown
    artifacts: name -> relative path of extra files the stage wrote
    fingerprint: inputs that produced the report (spec hash, target, gates, version, commit)
    """

    stage: str
    number: int
    title: str
    verdict: str = ""
    summary: str = ""
    metrics: dict[str, Any] = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)
    tables: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    artifacts: dict[str, str] = field(default_factory=dict)
    fingerprint: dict[str, Any] = field(default_factory=dict)
    started: str = ""
    finished: str = ""

    def add(self, severity: str, code: str, message: str, hint: str = "") -> Finding:
        finding = Finding(severity, code, message, hint)
        self.findings.append(finding)
        return finding

    def decide(self) -> str:
        """Set the verdict from the findings unless a stage already set it: any error -> fail,
        any warning -> warn, else pass."""
        if not self.verdict:
            severities = {f.severity for f in self.findings}
            self.verdict = "fail" if "error" in severities else "warn" if "warn" in severities else "pass"
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict must be one of {VERDICTS}, got {self.verdict!r}")
        return self.verdict

    @property
    def exit_code(self) -> int:
        return EXIT_GATE_FAILED if self.decide() == "fail" else EXIT_PASS

    def to_dict(self) -> dict[str, Any]:
        self.decide()
        data = asdict(self)
        data["schema"] = "adapt.stage-report/1"
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False, default=_json_default)

    def to_markdown(self) -> str:
        self.decide()
        lines = [f"# Stage {self.number}: {self.title}", "", f"**Verdict: {self.verdict.upper()}**", ""]
        if self.summary:
            lines += [self.summary, ""]
        if self.metrics:
            lines += ["## Metrics", "", "| metric | value |", "|---|---|"]
            for key, value in _flatten(self.metrics):
                lines.append(f"| {key} | {_fmt(value)} |")
            lines.append("")
        for name, rows in self.tables.items():
            lines += [f"## {name}", ""] + markdown_table(rows) + [""]
        if self.findings:
            lines += ["## Findings", "", "| severity | code | message | hint |", "|---|---|---|---|"]
            for f in self.findings:
                lines.append(f"| {f.severity} | {f.code} | {_cell(f.message)} | {_cell(f.hint)} |")
            lines.append("")
        if self.fingerprint:
            lines += ["## Inputs", ""]
            lines += [f"- {k}: `{_fmt(v)}`" for k, v in self.fingerprint.items()]
            lines.append("")
        lines.append(f"Started {self.started}, finished {self.finished}.")
        return "\n".join(lines) + "\n"

    def to_junit(self) -> str:
        """JUnit XML: one testcase per finding code group, failures for errors."""
        self.decide()
        errors = [f for f in self.findings if f.severity == "error"]
        cases = [f'  <testcase classname="adapt.stage{self.number}" name="{escape(self.stage)}.gate">']
        if errors:
            body = "\n".join(f"[{f.code}] {f.message}" for f in errors)
            cases.append(f'    <failure message="{escape(errors[0].message, {chr(34): "&quot;"})}">'
                         f"{escape(body)}</failure>")
        cases.append("  </testcase>")
        for f in self.findings:
            if f.severity == "error":
                continue
            cases.append(f'  <testcase classname="adapt.stage{self.number}.{escape(self.stage)}" '
                         f'name="{escape(f.code)}"><system-out>{escape(f.message)}</system-out></testcase>')
        count = len(cases) - (2 if errors else 1)
        head = (f'<?xml version="1.0" encoding="utf-8"?>\n<testsuite name="adapt.{escape(self.stage)}" '
                f'tests="{max(count, 1)}" failures="{1 if errors else 0}" errors="0">')
        return head + "\n" + "\n".join(cases) + "\n</testsuite>\n"


def markdown_table(rows: list[dict[str, Any]]) -> list[str]:
    """Rows of dicts as Markdown table lines (columns from the first row, in order)."""
    if not rows:
        return ["(none)"]
    columns = list(rows[0].keys())
    for row in rows[1:]:
        columns += [c for c in row if c not in columns]
    out = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        out.append("| " + " | ".join(_cell(_fmt(row.get(c, ""))) for c in columns) + " |")
    return out


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10_000:
        return f"{value:,}"
    return str(value)


def _flatten(metrics: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out = []
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out += _flatten(value, name + ".")
        else:
            out.append((name, value))
    return out


def _json_default(obj: Any) -> Any:
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, (set, tuple)):
        return list(obj)
    if hasattr(obj, "to_dict"):
        return obj.to_dict()
    return str(obj)


def now_iso() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


def atomic_write(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temp file in the same directory and a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def git_commit() -> str:
    """The adapt source tree's commit (with '+dirty' when it has changes), or 'unknown'."""
    root = Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"],
                             capture_output=True, text=True, timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if not sha:
        return "unknown"
    return sha + ("+dirty" if dirty else "")


def fingerprint(**inputs: Any) -> dict[str, Any]:
    """Inputs that identify a report: the caller's (spec_hash, target, ...) plus version and commit."""
    out = {k: v for k, v in inputs.items() if v is not None}
    out["adapt_version"] = __version__
    out["git_commit"] = git_commit()
    return out


# ---------------------------------------------------------------- gates


def load_gates(path: str | Path | None = None) -> dict[str, dict[str, Any]]:
    """Gate thresholds: the defaults file (adapt/gates.yaml) overlaid with the user's ``--gates FILE``.

    The user's file may set any subset of keys; unknown stages or keys are an InputError so a
    typo cannot silently disable a gate.
    """
    gates = yaml.safe_load(DEFAULT_GATES.read_text())
    if path is None:
        return gates
    path = Path(path)
    if not path.is_file():
        raise InputError("file not found", file=path, hint="pass an existing YAML file to --gates")
    try:
        override = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise InputError(f"invalid YAML: {str(exc).splitlines()[0]}", file=path) from None
    if not isinstance(override, dict):
        raise InputError("expected a mapping of stage -> thresholds", file=path)
    for stage, values in override.items():
        if stage not in gates:
            raise InputError(f"unknown stage; expected one of {sorted(gates)}", file=path, field=str(stage))
        if not isinstance(values, dict):
            raise InputError("expected a mapping of threshold -> value", file=path, field=str(stage))
        for key, value in values.items():
            if key not in gates[stage]:
                raise InputError(f"unknown threshold; expected one of {sorted(gates[stage])}",
                                 file=path, field=f"{stage}.{key}")
            default = gates[stage][key]
            if isinstance(default, (int, float)) and not isinstance(default, bool):
                if not isinstance(value, (int, float)) or isinstance(value, bool):
                    raise InputError(f"expected a number, got {value!r}", file=path, field=f"{stage}.{key}")
            gates[stage][key] = value
    return gates


# ---------------------------------------------------------------- run directories


class RunDir:
    """reports/<run-id>/: one report per stage plus manifest.json listing them with verdicts."""

    def __init__(self, root: str | Path = "reports", run_id: str | None = None):
        self.run_id = run_id or _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        if not self.run_id.replace("-", "").replace("_", "").replace(".", "").isalnum():
            raise InputError(f"run id {self.run_id!r} may hold only letters, digits, '-', '_' and '.'",
                             field="--run")
        self.path = Path(root) / self.run_id

    @property
    def manifest_path(self) -> Path:
        return self.path / "manifest.json"

    def manifest(self) -> dict[str, Any]:
        if not self.manifest_path.is_file():
            return {"run_id": self.run_id, "stages": {}}
        try:
            return json.loads(self.manifest_path.read_text())
        except json.JSONDecodeError:
            raise InputError("manifest is not valid JSON; delete the run directory and run again",
                             file=self.manifest_path) from None

    def write(self, report: StageReport, extra: dict[str, str] | None = None) -> dict[str, Path]:
        """Write the report's JSON, Markdown and JUnit files and record it in the manifest.

        extra: more files to write alongside (name -> text), e.g. a serve command.
        """
        report.decide()
        if not report.finished:
            report.finished = now_iso()
        written = {}
        files = {f"{report.stage}.json": report.to_json(), f"{report.stage}.md": report.to_markdown(),
                 f"{report.stage}.junit.xml": report.to_junit()}
        files.update(extra or {})
        for name, text in files.items():
            atomic_write(self.path / name, text)
            written[name] = self.path / name
        manifest = self.manifest()
        manifest["stages"][report.stage] = {
            "number": report.number, "verdict": report.verdict, "finished": report.finished,
            "files": sorted(files), "fingerprint": report.fingerprint,
        }
        manifest["updated"] = now_iso()
        atomic_write(self.manifest_path, json.dumps(manifest, indent=2, default=_json_default))
        return written

    def verdict_of(self, stage: str) -> str | None:
        """The recorded verdict of a stage in this run, or None if it has not run here."""
        entry = self.manifest()["stages"].get(stage)
        return entry["verdict"] if entry else None


def digest(obj: Any) -> str:
    """Short sha256 of a JSON-able object (for fingerprints)."""
    blob = json.dumps(obj, sort_keys=True, default=_json_default).encode()
    return hashlib.sha256(blob).hexdigest()[:16]
