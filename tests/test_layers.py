"""The floors (docs/how-it-works.md): core/ is the ground floor and imports nothing of the project; the
trainer (train/) and eval (eval/) never import the scheduler layer (slurm/); no module imports itself back
through others. Read from the source (every import, a function's own included), not from what one run
happens to import."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROJECT = ("core", "train", "eval", "slurm", "demo", "bench", "launch")
# What each floor may import of the project, besides itself: the ground floor (core) only, except the
# edges named in CROSSING. bench and demo sit beside the product and may use its floors.
ALLOWED = {
    "core": set(),
    "train": {"core"},
    "eval": {"core"},
    "demo": {"core", "train"},
    "slurm": {"core"},
    "launch": set(),
    "bench": {"core", "train", "eval", "slurm", "demo"},
}
# Every import from one product floor into another, by name: anything else fails the test below.
CROSSING = {
    ("launch", "slurm.cli"),  # the door
    ("slurm.queueing.jobs", "train.stage"),  # a job's entry points, run on the node
    ("slurm.queueing.jobs", "train.libraries"),  # what a job may import, decided before it imports it
    ("slurm.queueing.jobs", "eval.job"),
    ("slurm.queueing.jobs", "eval.export"),
    ("slurm.queueing.jobs", "eval.shared"),  # one process scoring several adapters of one base
    ("slurm.planning.preflight", "train.preflight"),  # login-node preflight (torch on a cache miss only)
    ("slurm.planning.preflight", "train.hub_cache"),
    ("slurm.planning.checks", "train.hub_cache"),  # a cached hub model's own template, for the dry run
    ("slurm.watching.reporting", "eval.report"),  # the report renderer, handed core/runs.py records
    ("eval.export", "train.data"),  # eval loads models and data as the trainer does
    ("eval.export", "train.model"),
    ("eval.export", "train.chat"),  # the text tokenizer of a processor, one address
    ("eval.generate", "train.chat"),  # prompts rendered and stopped as in training
    ("eval.preference", "train.pairs"),  # pairs scored as the DPO stage tokenizes them
    ("eval.generate", "train.device"),
    ("eval.generate", "train.model"),
    ("eval.generate", "train.vl"),
    ("eval.job", "train.callbacks"),
    ("eval.job", "train.libraries"),  # `python -m eval generate` hides what the job would
    ("eval.job", "train.data"),
    ("slurm.planning.checks", "eval.reward_check"),  # a GRPO stage's rewards checked in a bounded child
    ("train.grpo", "eval.rewards"),  # a GRPO reward is the eval's own per-example score
    ("train.grpo", "eval.generate"),  # completions cleaned as the eval cleans a prediction
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


def test_each_floor_imports_only_the_floors_below_it_and_the_named_crossings():
    wrong = sorted(
        f"{module} imports {imported}"
        for module, imported_set in graph().items()
        for imported in imported_set
        if (floor := module.split(".")[0]) != (below := imported.split(".")[0])
        and below not in ALLOWED[floor]
        and (module, imported) not in CROSSING
    )
    assert wrong == []


# The wings of slurm/, lowest first (docs/how-it-works.md): a wing imports core/ and the wings below it,
# the commands import any wing, the door (slurm/cli.py) anything of slurm/.
WINGS = ("slurm.cluster", "slurm.planning", "slurm.watching", "slurm.queueing", "slurm.commands", "slurm.cli")


def wing_of(module: str) -> str | None:
    return next((w for w in WINGS if module == w or module.startswith(f"{w}.")), None)


def test_every_module_of_slurm_lives_in_a_wing():
    # A module dropped at slurm/'s top level is a room outside every wing: nobody can tell which floor it is on.
    assert sorted(m for m in project_modules() if m.startswith("slurm.") and wing_of(m) is None) == []


def test_each_wing_of_slurm_imports_only_the_wings_below_it():
    wrong = sorted(
        f"{module} imports {imported}"
        for module, imported_set in graph().items()
        if (wing := wing_of(module))
        for imported in imported_set
        if (below := wing_of(imported)) and WINGS.index(below) > WINGS.index(wing)
    )
    assert wrong == []


def test_no_command_imports_another_command():
    # What two commands share lives in the wing that owns it; a command calling a command drags in its
    # whole verb (its tables, its exit codes) and ties their changes together.
    edges = graph()
    commands = [m for m in edges if m.startswith("slurm.commands.")]
    wrong = sorted(
        f"{m} imports {i}" for m in commands for i in edges[m] if i.startswith("slurm.commands.") and i != m
    )
    assert wrong == []


def test_every_named_crossing_is_still_used():
    # A crossing no module makes any more is a door left open for the next one that should not.
    edges = {(m, i) for m, imported in graph().items() for i in imported}
    assert sorted(CROSSING - edges) == []


def test_train_and_eval_never_import_the_scheduler_layer():
    wrong = [
        f"{m} imports {i}"
        for m, imported in graph().items()
        if m.split(".")[0] in ("train", "eval", "core")
        for i in imported
        if i.split(".")[0] in ("slurm", "launch")
    ]
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
    "tb",
    "wandb",
    "report.md",  # the run root's (RunRoot), spelt only by core/layout.py
    "report.csv",
    "loss_curves.png",
    "loss.png",
}


def test_only_the_run_folders_owner_spells_its_file_names():
    """core/rundir.py's RunDir names each file; a module that spells one itself (`run_dir / "summary.json"`,
    or the name alone) is a second owner whose copy can drift."""
    spelt = set()
    for name, path in project_modules().items():
        if name in ("core.rundir", "core.layout") or name.split(".")[0] in ("bench", "demo"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            joined = isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and node.right
            constant = joined if isinstance(joined, ast.Constant) else node
            if isinstance(constant, ast.Constant) and isinstance(constant.value, str):
                named = constant.value in RUN_FOLDER_NAMES and (joined or "." in constant.value)
                if named:
                    spelt.add(f"{path.relative_to(ROOT)}:{node.lineno}: {constant.value}")
    assert sorted(spelt) == []


ROOT_FILE_NAMES = {
    "SPEED_BOOK",
    "PREFLIGHT_TOKENS",
    "PREFLIGHT_SPLITS",
    "LAUNCH_LOCK",
    "RUNGS",
    "PACKS",
    "CODE_SNAPSHOTS",
}


def test_only_the_roots_owner_joins_the_run_and_log_roots_files():
    """core/rundir.py's RunRoot and LogRoot name the files and folders of the run root and the log root, as
    RunDir does a stage folder's; a module joining `run_root / RUNGS` itself is a second owner (estimate.py
    once joined the preflight books in five places, backends.py and usage.py LOG_DIR/packs each)."""
    used = sorted(
        f"{name}: {alias.name}"
        for name, path in project_modules().items()
        if name not in ("core.rundir", "core.layout") and name.split(".")[0] not in ("bench", "demo")
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.ImportFrom) and node.module == "core.layout"
        for alias in node.names
        if alias.name in ROOT_FILE_NAMES
    )
    assert used == []


def test_no_test_module_imports_another():
    """What test modules share lives in tests/helpers.py and tests/train_helpers.py (fixtures in conftest.py):
    a test module that imports another (its EXPERIMENT, its `configs()`) breaks with it, and the copies a
    third module keeps drift. Imports in code, and in the `-c` text a test hands a child process."""
    import re

    test_modules = {f"tests.{path.stem}" for path in (ROOT / "tests").glob("test_*.py")}
    found = []
    for path in sorted((ROOT / "tests").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                module = f"tests.{node.module or ''}".rstrip(".") if node.level else node.module or ""
                names = [module, *(f"{module}.{alias.name}" for alias in node.names)]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names = re.findall(r"\btests\.test_\w+", node.value)
            else:
                continue
            found += [
                f"{path.relative_to(ROOT)}:{node.lineno}: {name}" for name in names if name in test_modules
            ]
    assert found == []
