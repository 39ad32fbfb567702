"""Stage reports, gate verdicts, run directories and atomic writers.

A stage returns a ``StageReport``; ``RunDir.write(report)`` puts
``<stage>.json``, ``<stage>.md`` and ``<stage>.junit.xml`` into ``reports/<run-id>/`` and
updates ``manifest.json``. Every file is written to a temp file in the same directory
and renamed into place, so an interrupted run never leaves a half-written report.

Verdicts: "pass" (warnings allowed), "warn" (measured its core, with caveats), "unmeasured" (nothing was
measured: an ``unmeasured`` finding says what and how to measure it), "fail". Exit codes: 0 pass or warn,
1 gate failed or unmeasured, 2 bad input or usage (``adapt.errors.InputError``).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import functools
import hashlib
import json
import math
import os
import re
import secrets
import subprocess
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

import yaml

from adapt import __version__
from adapt.errors import InputError, check_interrupt

SEVERITIES = ("info", "warn", "error")
VERDICTS = ("pass", "warn", "unmeasured", "fail")
UNMEASURED = "unmeasured"  # the finding code (and verdict) of a stage that measured nothing
EXIT_PASS, EXIT_GATE_FAILED, EXIT_BAD_INPUT = 0, 1, 2
DEFAULT_GATES = Path(__file__).with_name("gates.yaml")
PACKAGE_ROOT = Path(__file__).resolve().parent  # the adapt package (a checkout's or an installed wheel's)
RUN_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
REPORT_SCHEMA = "adapt.stage-report/1"
MANIFEST_SCHEMA = "adapt.run-manifest/1"
LOCK_NAME = ".lock"


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
    verdict: "pass" | "warn" | "unmeasured" | "fail" (``decide`` derives it from findings when unset)
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

    def not_measured(self, what: str, how: str) -> Finding:
        """Record that the stage measured nothing (``what``: what was not measured and why; ``how``: how to
        measure it). The verdict becomes "unmeasured" (unless an error fails it): exit 1, never reused by
        ``validate``, refused by the hand-off; a stage that measured its core and has caveats warns instead."""
        return self.add("warn", UNMEASURED, f"nothing measured: {what}", how)

    def decide(self) -> str:
        """Set the verdict from the findings unless a stage already set it: any error -> fail, an
        ``unmeasured`` finding -> unmeasured, any warning -> warn, else pass."""
        if not self.verdict:
            severities = {f.severity for f in self.findings}
            self.verdict = ("fail" if "error" in severities else UNMEASURED
                            if any(f.code == UNMEASURED for f in self.findings)
                            else "warn" if "warn" in severities else "pass")
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict must be one of {VERDICTS}, got {self.verdict!r}")
        return self.verdict

    @property
    def exit_code(self) -> int:
        return EXIT_GATE_FAILED if self.decide() in ("fail", UNMEASURED) else EXIT_PASS

    def to_dict(self) -> dict[str, Any]:
        self.decide()
        data = asdict(self)
        data["schema"] = REPORT_SCHEMA
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
        errors = [f for f in self.findings if f.severity == "error" or f.code == UNMEASURED]
        cases = [f'  <testcase classname="adapt.stage{self.number}" name="{escape(self.stage)}.gate">']
        if errors:
            body = "\n".join(f"[{f.code}] {f.message}" for f in errors)
            cases.append(f'    <failure message="{escape(errors[0].message, {chr(34): "&quot;"})}">'
                         f"{escape(body)}</failure>")
        cases.append("  </testcase>")
        for f in self.findings:
            if f in errors:
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


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write(path: Path, text: str, executable: bool = False) -> None:
    """Write ``text`` to ``path`` through a temp file in the same directory and a rename.

    The file gets the mode a plain ``open`` would give it under the process umask (0644 under
    umask 022), or 0755 under 022 when ``executable``.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, (0o777 if executable else 0o666) & ~_umask())
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


def code_files(root: Path = PACKAGE_ROOT) -> list[Path]:
    """The files of the adapt package under ``root`` that its code digest covers, sorted: every file except
    bytecode caches (``__pycache__``, ``*.pyc``), hidden files and Markdown notes. These are the files a wheel
    ships (``*.py`` and pyproject's package-data: presets, targets, stacks, gates.yaml, eval data)."""
    out = []
    for path in root.rglob("*"):
        parts = path.relative_to(root).parts
        if (path.is_file() and path.suffix not in (".pyc", ".pyo", ".md")
                and not any(p == "__pycache__" or p.startswith(".") for p in parts)):
            out.append(path)
    return sorted(out, key=lambda p: p.relative_to(root).as_posix())


@functools.lru_cache(maxsize=4)
def code_digest(root: Path = PACKAGE_ROOT) -> str:
    """sha256 (16 hex digits) over the relative path and bytes of every ``code_files(root)`` file: the adapt
    code that wrote a report. Needs no git (an installed wheel digests as its checkout does); computed once
    per process (about 1.5 MB read)."""
    h = hashlib.sha256()
    for path in code_files(root):
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def fingerprint(**inputs: Any) -> dict[str, Any]:
    """Inputs that identify a report: the caller's (spec_hash, target, ...) plus version, code digest and
    commit."""
    out = {k: v for k, v in inputs.items() if v is not None}
    out["adapt_version"] = __version__
    out["code"] = code_digest()
    out["git_commit"] = git_commit()
    return out


# ---------------------------------------------------------------- gates


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a mapping with the same key twice (PyYAML keeps the last)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (line {key_node.start_mark.line + 1})", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_yaml(path: str | Path, what: str) -> Any:
    """Parse a user's YAML file; unreadable files, YAML errors and duplicate keys are InputErrors."""
    path = Path(path)
    try:
        return yaml.load(path.read_text(), Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader subclass)
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read {what}: {getattr(exc, 'strerror', None) or exc}", file=path) from None
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise InputError(f"invalid YAML: {problem}", file=path) from None


def _check_gate_value(path: Path, where: str, default: Any, value: Any) -> None:
    if not (isinstance(default, (int, float)) and not isinstance(default, bool)):
        return
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise InputError(f"expected a number, got {value!r}", file=path, field=where)
    if not math.isfinite(value) or value < 0:
        raise InputError(f"expected a finite number >= 0, got {value!r}", file=path, field=where)
    if isinstance(default, int) and value != int(value):
        raise InputError(f"expected a whole number, got {value!r}", file=path, field=where)
    if where.endswith("_fraction") and value >= 1:
        raise InputError(f"expected a fraction in [0, 1), got {value!r}", file=path, field=where)


def load_gates(path: str | Path | None = None) -> dict[str, dict[str, Any]]:
    """Gate thresholds: the defaults file (adapt/gates.yaml) overlaid with the user's ``--gates FILE``.

    The user's file may set any subset of keys; unknown stages or keys, duplicate keys and values
    that are not finite non-negative numbers (fractions below 1) are an InputError naming the
    gates file and the key, so a typo cannot silently disable a gate.
    """
    gates = yaml.safe_load(DEFAULT_GATES.read_text())
    if path is None:
        return gates
    path = Path(path)
    if not path.is_file():
        raise InputError("file not found", file=path, field="--gates", hint="pass an existing YAML file to --gates")
    override = load_yaml(path, "gates file") or {}
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
            _check_gate_value(path, f"{stage}.{key}", gates[stage][key], value)
            gates[stage][key] = value
    return gates


# ---------------------------------------------------------------- run directories



def default_run_id() -> str:
    """A run id that two invocations never share: local time, process id and 32 random bits
    (``20261130-154501-12345-9f3a0c1e``)."""
    return f"{_dt.datetime.now().strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{secrets.token_hex(4)}"


def _writable_root(root: Path) -> None:
    """InputError (field --output) unless ``root`` is, or can become, a writable directory."""
    probe = root
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise InputError("not a directory", file=probe, field="--output",
                         hint="pass a directory (it is created when missing) to --output")
    if probe.exists() and (not os.access(probe, os.W_OK | os.X_OK) or not probe.stat().st_mode & 0o222):
        raise InputError("directory is not writable", file=probe, field="--output",
                         hint="pass a writable directory to --output")


class RunDir:
    """reports/<run-id>/: one report per stage plus manifest.json listing them with verdicts.

    The stage files are the truth. ``manifest.json`` is derived from them on every write, under
    an exclusive ``flock`` on ``<run>/.lock`` (so concurrent writers into one run serialize), and
    is never read back to decide anything: ``verdict_of`` and ``stage_report`` read the stage's
    own JSON. A run id holds 1-64 letters, digits, '.', '_' or '-' and starts with a letter or
    digit; without one, ``default_run_id`` makes one that does not collide.
    """

    def __init__(self, root: str | Path = "reports", run_id: str | None = None):
        self.run_id = run_id if run_id is not None else default_run_id()
        if not RUN_ID_PATTERN.match(self.run_id):
            shown = self.run_id if len(self.run_id) <= 40 else self.run_id[:40] + "..."
            raise InputError(f"run id {shown!r} ({len(self.run_id)} characters) is not 1-64 letters, digits, "
                             "'.', '_' or '-' starting with a letter or digit", field="--run")
        self.root = Path(root)
        _writable_root(self.root)
        self.path = self.root / self.run_id
        if self.path.exists() and not self.path.is_dir():
            raise InputError("run path exists and is not a directory", file=self.path, field="--run",
                             hint="choose another --run")

    @property
    def manifest_path(self) -> Path:
        return self.path / "manifest.json"

    @contextlib.contextmanager
    def lock(self):
        """Exclusive lock on the run directory (``fcntl.flock`` on ``<run>/.lock``)."""
        import fcntl

        try:
            self.path.mkdir(parents=True, exist_ok=True)
            handle = open(self.path / LOCK_NAME, "a")
        except OSError as exc:
            raise InputError(f"cannot write the run directory: {exc.strerror}", file=self.path,
                             field="--output", hint="pass a writable directory to --output") from None
        with handle:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle.fileno(), fcntl.LOCK_UN)

    def stage_report(self, stage: str) -> dict[str, Any] | None:
        """The stage's report as written (``<stage>.json``), or None when it has not run here.

        A file that is not a stage report of this stage (bad JSON, wrong shape) is an InputError.
        """
        path = self.path / f"{stage}.json"
        if not path.is_file():
            return None
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise InputError("stage report is not valid JSON; delete it and run the stage again",
                             file=path) from None
        if (not isinstance(data, dict) or data.get("schema") != REPORT_SCHEMA or data.get("stage") != stage
                or data.get("verdict") not in VERDICTS or not isinstance(data.get("fingerprint", {}), dict)):
            raise InputError(f"not an adapt stage report of stage {stage!r}; delete it and run the stage again",
                             file=path)
        derived = _verdict_of_findings(data.get("findings"))
        if derived is None or VERDICTS.index(data["verdict"]) < VERDICTS.index(derived):
            raise InputError(f"its verdict {data['verdict']!r} contradicts its findings ({derived or 'unreadable'}): "
                             "not a report adapt wrote; delete it and run the stage again", file=path)
        return data

    def _scan(self) -> dict[str, dict[str, Any]]:
        """Manifest entries derived from the stage reports on disk (``*.json`` with the report schema)."""
        stages = {}
        for path in sorted(self.path.glob("*.json")):
            if path.name == self.manifest_path.name:
                continue
            try:
                data = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError, UnicodeDecodeError):
                continue
            if not isinstance(data, dict) or data.get("schema") != REPORT_SCHEMA or path.stem != data.get("stage"):
                continue
            verdict, derived = data.get("verdict"), _verdict_of_findings(data.get("findings")) or "fail"
            if verdict not in VERDICTS or VERDICTS.index(verdict) < VERDICTS.index(derived):
                verdict = derived  # a verdict more lenient than its findings (not written by adapt) is not listed
            stages[data["stage"]] = {
                "number": data.get("number"), "verdict": verdict, "finished": data.get("finished"),
                "files": sorted(data.get("files") or [path.name]), "fingerprint": data.get("fingerprint", {}),
            }
        return stages

    def manifest(self) -> dict[str, Any]:
        """The run's manifest as derived from its stage files now (what ``manifest.json`` holds
        after every write). A ``manifest.json`` of the wrong shape is an InputError."""
        if self.manifest_path.is_file():
            try:
                stored = json.loads(self.manifest_path.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise InputError("manifest is not valid JSON; delete it (it is rebuilt from the stage reports)",
                                 file=self.manifest_path) from None
            if not isinstance(stored, dict) or not isinstance(stored.get("stages", {}), dict):
                raise InputError("manifest is not an adapt run manifest (expected an object with a 'stages' "
                                 "object); delete it (it is rebuilt from the stage reports)",
                                 file=self.manifest_path)
        return {"schema": MANIFEST_SCHEMA, "run_id": self.run_id, "stages": self._scan() if self.path.is_dir() else {}}

    def write(self, report: StageReport, extra: dict[str, str] | None = None) -> dict[str, Path]:
        """Write the report's JSON, Markdown and JUnit files and rebuild the manifest, under the lock.

        extra: more files to write alongside (name -> text), e.g. a serve command; names ending
        in ``.sh`` are made executable. Raises ``Interrupted`` (and writes nothing) once SIGINT or
        SIGTERM has arrived, so no pass is written after an interrupt.
        """
        check_interrupt()
        report.decide()
        if not report.finished:
            report.finished = now_iso()
        files = {f"{report.stage}.md": report.to_markdown(), f"{report.stage}.junit.xml": report.to_junit()}
        files.update(extra or {})
        data = report.to_dict()
        data["files"] = sorted([f"{report.stage}.json", *files])
        files[f"{report.stage}.json"] = json.dumps(data, indent=2, default=_json_default)
        written = {}
        self.manifest()  # a manifest of the wrong shape is refused before anything is written
        with self.lock():
            pause_for_test("write")
            check_interrupt()
            try:
                # the old JSON goes first, and the manifest without it: a process killed before the new one
                # lands leaves no report (the stage did not run here), never the old verdict beside the new
                # Markdown and JUnit, in the stage files or in manifest.json
                old_json = self.path / f"{report.stage}.json"
                if old_json.exists():
                    old_json.unlink()
                    atomic_write(self.manifest_path, json.dumps({**self.manifest(), "updated": now_iso()},
                                                                indent=2, default=_json_default))
                for name, text in files.items():
                    if name == f"{report.stage}.json":
                        continue
                    atomic_write(self.path / name, text, executable=name.endswith(".sh"))
                    written[name] = self.path / name
                # the stage JSON last: it is what makes the report count
                atomic_write(self.path / f"{report.stage}.json", files[f"{report.stage}.json"])
                written[f"{report.stage}.json"] = self.path / f"{report.stage}.json"
                manifest = self.manifest()
                manifest["updated"] = now_iso()
                atomic_write(self.manifest_path, json.dumps(manifest, indent=2, default=_json_default))
            except OSError as exc:
                raise InputError(f"cannot write the report: {exc.strerror or exc}", file=exc.filename or self.path,
                                 field="--output", hint="pass a writable directory to --output") from None
        return written

    def verdict_of(self, stage: str) -> str | None:
        """The verdict in the stage's own report in this run, or None if it has not run here."""
        data = self.stage_report(stage)
        return data["verdict"] if data else None


def _verdict_of_findings(findings: Any) -> str | None:
    """The least verdict a report's findings (as written to JSON) allow (``StageReport.decide``'s rule), or None
    when they are not a list of findings."""
    if not isinstance(findings, list) or not all(isinstance(f, dict) for f in findings):
        return None
    if any(f.get("severity") == "error" for f in findings):
        return "fail"
    if any(f.get("code") == UNMEASURED for f in findings):
        return UNMEASURED
    return "warn" if any(f.get("severity") == "warn" for f in findings) else "pass"


def pause_for_test(point: str) -> None:
    """Test hook for the interrupt tests. ``ADAPT_TEST_PAUSE=<point>:<file>`` makes the process
    create ``<file>`` here and sleep until a signal arrives (the handler raises ``Interrupted``);
    ``in-del-<point>:<file>`` does the same inside an object's ``__del__``, where Python drops
    the exception (as it did when rich's ``Group.__del__`` ran at the wrong moment)."""
    name, _, path = os.environ.get("ADAPT_TEST_PAUSE", "").partition(":")
    if name == point:
        _wait_for_signal(Path(path))
    elif name == f"in-del-{point}":
        _SwallowingDel(Path(path))


def _wait_for_signal(ready: Path) -> None:
    import time

    ready.write_text(str(os.getpid()))
    while True:
        time.sleep(0.05)
        check_interrupt()


class _SwallowingDel:
    def __init__(self, ready: Path):
        self.ready = ready

    def __del__(self):
        _wait_for_signal(self.ready)


CONTENT_DIGEST_MAX_BYTES = 2 * 1024**3  # checkpoints up to this size are hashed whole (tiny models: a few MiB)
CONTENT_DIGEST_FILE_BYTES = 64 * 2**20  # above it, files up to this size (tokenizer, config, index) still whole
SAMPLE_BLOCKS = 32  # blocks hashed per larger file, first and last included
SAMPLE_BLOCK_BYTES = 64 * 2**10
MAX_HEADER_BYTES = 100 * 2**20  # the safetensors library's ceiling on a header (adapt.model.checkpoint too)


def _hash_sampled(path: Path, size: int, h: Any) -> None:
    """Feed ``h`` a large file's size, its safetensors header in full (8-byte length + JSON: tensor names,
    dtypes, shapes, offsets) and ``SAMPLE_BLOCKS`` blocks of ``SAMPLE_BLOCK_BYTES`` at offsets spread evenly
    over the data after the header, the first and last block included. Reads the header + 2 MiB per file,
    whatever its size; no modification time, so a copy digests the same as its original."""
    h.update(f"{size}\0".encode())
    with open(path, "rb") as handle:
        start = 0
        if path.suffix == ".safetensors":
            length = handle.read(8)
            header = int.from_bytes(length, "little") if len(length) == 8 else 0
            if 0 < header <= MAX_HEADER_BYTES and 8 + header <= size:
                h.update(length + handle.read(header))
                start = 8 + header
        last = max(size - start - SAMPLE_BLOCK_BYTES, 0)
        for index in range(SAMPLE_BLOCKS):
            handle.seek(start + last * index // (SAMPLE_BLOCKS - 1))
            h.update(hashlib.sha256(handle.read(SAMPLE_BLOCK_BYTES)).digest())


def checkpoint_data_digest(model: str) -> str | None:
    """Digest of a model directory's top-level files themselves (tensors, tokenizer, config), or None
    when ``model`` is not a directory. Up to ``CONTENT_DIGEST_MAX_BYTES`` in all, sha256 of every byte
    ("sha256:"); above ("sampled:"), files up to ``CONTENT_DIGEST_FILE_BYTES`` whole and larger ones by
    size, safetensors header and sampled blocks (``_hash_sampled``): about header + 2 MiB read per shard,
    so a 600 GB checkpoint in ~5 GB shards costs ~0.3 GB of reads (reckoned), not 600 GB. Names, sizes and bytes
    only, never modification times: a copy elsewhere digests the same, a same-size rewrite whose tensors
    change does not (a change confined to bytes no block samples is not seen)."""
    directory = Path(model)
    if not directory.is_dir():
        return None
    files = sorted(p for p in directory.iterdir() if p.is_file() and not p.name.startswith("."))
    whole = sum(p.stat().st_size for p in files) <= CONTENT_DIGEST_MAX_BYTES
    h = hashlib.sha256()
    for path in files:
        size = path.stat().st_size
        h.update(path.name.encode() + b"\0")
        if whole or size <= CONTENT_DIGEST_FILE_BYTES:
            with open(path, "rb") as handle:
                while chunk := handle.read(16 * 2**20):
                    h.update(chunk)
        else:
            _hash_sampled(path, size, h)
        h.update(b"\0")
    return ("sha256:" if whole else "sampled:") + h.hexdigest()[:16]


def digest(obj: Any) -> str:
    """Short sha256 of a JSON-able object (for fingerprints)."""
    blob = json.dumps(obj, sort_keys=True, default=_json_default).encode()
    return hashlib.sha256(blob).hexdigest()[:16]
