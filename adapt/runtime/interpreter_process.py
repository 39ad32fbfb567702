"""Run a stage in a fresh Python under the Triton interpreter and bring its report back.

Triton decides interpreter or compiled when it is first imported (``adapt.kernels.formats.interpreting``);
a process that imported it without ``TRITON_INTERPRET=1`` cannot interpret ``@triton.jit`` code any
more, so a stage that needs the interpreter there reruns itself with ``python -m <module>``.

Protocol: the parent writes one JSON request on the child's stdin. The child (``serve_request``)
prints the ``StageReport``'s JSON and exits 0, or on bad input prints ``{"message", "file", "field",
"hint"}`` and exits ``EXIT_BAD_INPUT`` (the parent raises the same ``InputError``). Any other exit
becomes a report with one ``<stage>.crashed`` error finding carrying the last 3 lines of stderr.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable

from adapt.errors import InputError
from adapt.report import EXIT_BAD_INPUT, Finding, StageReport, now_iso


def run_in_interpreter_process(module: str, request: dict, *, stage: str, number: int, title: str,
                               timeout_s: float) -> StageReport:
    """Run ``python -m module`` with TRITON_INTERPRET=1, ``request`` (JSON-able) on its stdin, and
    rebuild the StageReport it prints. ``stage``/``number``/``title`` name the report made when the
    child crashes; ``timeout_s``: seconds before the child is killed (subprocess.TimeoutExpired)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-m", module], input=json.dumps(request), capture_output=True,
                          text=True, env=env, timeout=timeout_s)
    if done.returncode == EXIT_BAD_INPUT:
        data = json.loads(done.stdout)
        raise InputError(data["message"], file=data.get("file"), field=data.get("field"),
                         hint=data.get("hint"))
    if done.returncode != 0:
        tail = " | ".join(done.stderr.strip().splitlines()[-3:])
        report = StageReport(stage=stage, number=number, title=title, started=now_iso())
        report.add("error", f"{stage}.crashed", f"the interpreter process exited {done.returncode}: {tail}")
        report.finished = now_iso()
        return report
    data = json.loads(done.stdout)
    data.pop("schema", None)
    data["findings"] = [Finding(**f) for f in data["findings"]]
    return StageReport(**data)


def serve_request(run: Callable[[dict], StageReport]) -> None:
    """The child's side: read the request (JSON on stdin), print ``run(request)``'s report as JSON;
    on InputError print its fields and exit EXIT_BAD_INPUT."""
    request = json.loads(sys.stdin.read())
    try:
        report = run(request)
    except InputError as exc:
        print(json.dumps({"message": exc.message, "file": str(exc.file) if exc.file else None,
                          "field": exc.field, "hint": exc.hint}))
        sys.exit(EXIT_BAD_INPUT)
    print(report.to_json())
