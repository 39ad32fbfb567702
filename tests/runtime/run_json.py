"""`adapt run ... --json` through typer's test runner, for the runtime tests of the reference families."""

from __future__ import annotations

import json
from pathlib import Path


def adapt_run_json(model_dir: Path, *options: str) -> dict:
    """The JSON summary of ``adapt run MODEL_DIR --max-new-tokens 4 --dtype float32 --json OPTIONS``
    (its exit code asserted 0)."""
    from typer.testing import CliRunner

    from adapt.cli import app

    result = CliRunner().invoke(app, ["run", str(model_dir), "--max-new-tokens", "4", "--dtype", "float32",
                                      "--json", *options])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)
