"""The import rules of DESIGN.md, checked on the source (AST, no import runs): stages never import
each other or the hand-off; kernels know tensors, not models (no runtime, stage, model or target);
model, targets and plan import no stage, runtime or hand-off; nothing imports another module's private
name; only ``python -m adapt`` imports the CLI. A test on a copy with injected imports proves the
checker fails when a rule is broken."""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# stage modules that run other stages by design: the gate pipeline and the demo
ORCHESTRATORS = {"adapt.stages.pipeline", "adapt.stages.demo"}
# stage 6 serves the handed-off model: it starts and stops vLLM through the hand-off's launcher
SERVES_THE_HANDOFF = {"adapt.stages.serve"}
OUTSIDE_MODELS = ("adapt.runtime", "adapt.stages", "adapt.model", "adapt.targets", "adapt.plan", "adapt.handoff",
                  "adapt.cli", "adapt.report", "adapt.bench", "adapt.eval")
SHARED_FACTS = ("adapt.stages", "adapt.runtime", "adapt.handoff", "adapt.cli", "adapt.bench", "adapt.eval")
# (importer, imported): why it is allowed for now. An entry no longer used fails the test, so it goes
# when the import goes.
KNOWN = {("adapt.targets.calibrate", "adapt.handoff.vllm"):
         "`adapt calibrate` (issue #17) takes free_port (a free TCP port for its NCCL rendezvous) from the "
         "hand-off; the port helper belongs in a module both can import"}


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.AST, module: str) -> list[tuple[str, list[str], int]]:
    """(imported module, names taken from it, line) for every import statement, relative ones resolved."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, [], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(module.split(".")[: -node.level] + ([base] if base else []))
            found.append((base, [alias.name for alias in node.names], node.lineno))
    return found


def _within(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _forbidden(importer: str, imported: str) -> str:
    """Why ``importer`` may not import ``imported`` ("" when it may)."""
    if imported == "adapt.cli" and importer not in ("adapt.__main__", "adapt.cli"):
        return "only `python -m adapt` imports the CLI"
    if _within(importer, ("adapt.stages",)) and importer not in ORCHESTRATORS:
        if _within(imported, ("adapt.stages",)) and imported != importer:
            return "stages never import each other (share adapt/plan, adapt/model, adapt/targets)"
        if _within(imported, ("adapt.handoff",)) and importer not in SERVES_THE_HANDOFF:
            return "stages do not import the hand-off (vLLM launch rules live in adapt/plan/launch.py)"
    if _within(importer, ("adapt.kernels",)) and _within(imported, OUTSIDE_MODELS):
        return "kernels know tensors, not models (formats live in adapt/kernels/formats.py)"
    if _within(importer, ("adapt.model", "adapt.targets", "adapt.plan")) and _within(imported, SHARED_FACTS):
        return "model, targets and plan are shared facts; they import no stage, runtime or hand-off"
    if _within(importer, ("adapt.runtime",)) and _within(imported, ("adapt.stages", "adapt.handoff")):
        return "the runtime imports no stage or hand-off"
    return ""


def import_violations(root: Path) -> tuple[list[str], set[tuple[str, str]]]:
    """Broken rules under ``root`` (the folder holding ``adapt/``), and the KNOWN exceptions seen."""
    problems, seen = [], set()
    for path in sorted((root / "adapt").rglob("*.py")):
        module = _module_name(path, root)
        for imported, names, line in _imports(ast.parse(path.read_text(), str(path)), module):
            if not _within(imported, ("adapt",)):
                continue
            where = f"{path.relative_to(root)}:{line}"
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private and imported != module:
                problems.append(f"{where}: imports private {', '.join(private)} of {imported}")
            why = _forbidden(module, imported)
            if why and (module, imported) in KNOWN:
                seen.add((module, imported))
            elif why:
                problems.append(f"{where}: {module} imports {imported}: {why}")
    return problems, seen


def test_import_rules_hold():
    problems, seen = import_violations(ROOT)
    assert problems == []
    assert seen == set(KNOWN), f"exceptions no longer needed, remove them from KNOWN: {set(KNOWN) - seen}"


def _inject(copy: Path, relative: str, line: str) -> None:
    path = copy / relative
    text = path.read_text()
    marker = "from __future__ import annotations\n"
    assert marker in text, relative
    path.write_text(text.replace(marker, marker + line + "\n", 1))


def test_checker_fails_on_injected_imports(tmp_path):
    shutil.copytree(ROOT / "adapt", tmp_path / "adapt", ignore=shutil.ignore_patterns("__pycache__"))
    assert import_violations(tmp_path)[0] == []
    _inject(tmp_path, "adapt/stages/parallel.py", "from adapt.stages.inventory import build_inventory")
    _inject(tmp_path, "adapt/kernels/dsa.py", "import adapt.runtime.kv_cache")
    _inject(tmp_path, "adapt/model/spec.py", "from adapt.runtime import engine")
    _inject(tmp_path, "adapt/stages/kernels.py", "from adapt.plan.layout import _cdiv")
    problems, _ = import_violations(tmp_path)
    assert len(problems) == 4, problems
    joined = "\n".join(problems)
    assert "adapt/stages/parallel.py" in joined and "stages never import each other" in joined
    assert "adapt/kernels/dsa.py" in joined and "kernels know tensors" in joined
    assert "adapt/model/spec.py" in joined and "shared facts" in joined
    assert "private _cdiv" in joined
