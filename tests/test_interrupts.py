"""SIGINT/SIGTERM at any moment: exit 130/143, one "interrupted" line, and no report written after
the signal. Deterministic: ADAPT_TEST_PAUSE makes the child wait at a named point until signalled."""

from __future__ import annotations

import json
import signal
import time

import pytest

from tests.cli_run import adapt_process


def _wait_for(path, proc, timeout_s: float = 240.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the child never reached the pause point"
        time.sleep(0.05)


PLAN = ["plan-memory", "qwen3-30b-a3b", "--target", "h200", "--devices", "1", "--context", "8192"]
VALIDATE = ["validate", "qwen3-30b-a3b", "--stage", "2", "--target", "h200", "--devices", "1"]
CASES = {  # name -> (command, pause point, signal, exit code, stage reports on disk afterwards)
    # inside RunDir.write, under the lock, before any file is written
    "write-sigint": (PLAN, "write", signal.SIGINT, 130, set()),
    "write-sigterm": (PLAN, "write", signal.SIGTERM, 143, set()),
    # the same, with the signal's exception dropped inside a __del__ (as rich's Group.__del__ did)
    "swallowed-sigint": (PLAN, "in-del-write", signal.SIGINT, 130, set()),
    # validate: stage 1 written, stage 2 computed and interrupted before its report is written
    "between-stages-sigterm": (VALIDATE, "before-write-memory", signal.SIGTERM, 143, {"inventory"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_interrupt_exits_with_one_line_and_writes_no_pass(tmp_path, case):
    command, point, signum, code, left = CASES[case]
    ready = tmp_path / "ready"
    proc = adapt_process(*command, "--output", tmp_path / "reports", "--run", "i", "--json",
                         env={"ADAPT_TEST_PAUSE": f"{point}:{ready}"})
    _wait_for(ready, proc)
    proc.send_signal(signum)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == code, stderr
    assert stderr.strip().splitlines() == ["interrupted"], stderr
    assert stdout == ""  # nothing claims a result
    run = tmp_path / "reports" / "i"
    assert {p.stem for p in run.glob("*.json") if p.name != "manifest.json"} == left
    assert not (run / "memory.md").exists() and not list(run.glob(".*.tmp"))
    if left:
        assert set(json.loads((run / "manifest.json").read_text())["stages"]) == left
