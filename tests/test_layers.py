"""The floors (README "How it works"): spec/ is the ground floor and imports nothing of the project; the
trainer (train/) and eval (eval/) never import the scheduler layer (slurm/); no module imports itself back
through others. Read from the source (every import, a function's own included), not from what one run
happens to import."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROJECT = ("spec", "train", "eval", "slurm", "demo", "bench", "launch")
# What each floor may import of the project, besides itself.
ALLOWED = {
    "spec": set(),
    "train": {"spec"},
    "eval": {"spec", "train"},
    "demo": {"spec", "train"},
    "slurm": {"spec", "train", "eval"},  # train/eval only by a job's entry point and login-node preflight
    "launch": {"slurm"},
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    found = {"launch": ROOT / "launch.py"}
    for package in ALLOWED:
        if package != "launch":
            found |= {module_name(p): p for p in (ROOT / package).rglob("*.py")}
    return found


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules `path` imports (`from pkg import mod` counts as pkg.mod when that is a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                for a in node.names
            ]
        else:
            continue
        found |= {name for name in names if name.split(".")[0] in PROJECT}
    return found


def graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imports_of(path, modules) for name, path in modules.items()}


def test_each_floor_imports_only_the_floors_below_it():
    wrong = sorted(
        f"{module} imports {imported}"
        for module, imported_set in graph().items()
        for imported in imported_set
        if (floor := module.split(".")[0]) != (below := imported.split(".")[0])
        and below not in ALLOWED[floor]
    )
    assert wrong == []


def test_no_module_imports_itself_back_through_others():
    edges = graph()
    cycles = []

    def visit(module: str, path: list[str], seen: set[str]) -> None:
        for nxt in sorted(edges.get(module, ())):
            if nxt == path[0]:
                cycles.append(" -> ".join([*path, nxt]))
            elif nxt not in seen and nxt in edges:
                seen.add(nxt)
                visit(nxt, [*path, nxt], seen)

    for start in sorted(edges):
        visit(start, [start], {start})
    assert cycles == []


RUN_FOLDER_NAMES = {
    "config.yaml",
    "job.json",
    "progress.json",
    "metrics.jsonl",
    "checkpoints",
    "adapter",
    "summary.json",
    "lane.json",
    "predictions.jsonl",
    "predictions.partial.jsonl",
    "results.json",
    "DONE",
}


def test_only_the_run_folders_owner_spells_its_file_names():
    """spec/rundir.py's RunDir names each file; a module that spells one itself (`run_dir / "summary.json"`,
    or the name alone) is a second owner whose copy can drift."""
    spelt = set()
    for name, path in project_modules().items():
        if name == "spec.rundir" or name.split(".")[0] in ("bench", "demo"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            joined = isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and node.right
            constant = joined if isinstance(joined, ast.Constant) else node
            if isinstance(constant, ast.Constant) and isinstance(constant.value, str):
                named = constant.value in RUN_FOLDER_NAMES and (joined or "." in constant.value)
                if named:
                    spelt.add(f"{path.relative_to(ROOT)}:{node.lineno}: {constant.value}")
    assert sorted(spelt) == []
