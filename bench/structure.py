"""The figures issue 30 asked for, of a checkout (default: this one), printed: lines of the door module
(slurm/cli.py) and how many other slurm modules it imports; functions over 50 lines in core/ slurm/
train/ eval/ and launch.py; string literals equal to a state's value outside core/states.py.

    python bench/structure.py [REPO]

(Pairs of places that repeat six or more lines come from the tool library's `duplicates`.)
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PRODUCT = ("core", "slurm", "train", "eval")
STATE_WORDS = {
    "PLANNED", "PENDING", "RUNNING", "COMPLETED", "FAILED", "TIMEOUT", "CANCELLED", "BLOCKED", "UNKNOWN",
}  # fmt: skip


def product_files(root: Path) -> list[Path]:
    return [
        root / "launch.py",
        *(p for d in PRODUCT if (root / d).is_dir() for p in sorted((root / d).rglob("*.py"))),
    ]


def door_imports(door: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(door.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("slurm"):
            found.add(node.module)
    return found


def long_functions(files: list[Path], root: Path, limit: int = 50) -> list[str]:
    return [
        f"{path.relative_to(root)}:{node.name} ({node.end_lineno - node.lineno + 1})"
        for path in files
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > limit
    ]


def state_literals(files: list[Path], root: Path) -> list[str]:
    return [
        f"{path.relative_to(root)}:{node.lineno}: {node.value}"
        for path in files
        if path.name != "states.py"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and node.value in STATE_WORDS
    ]


def main(root: Path) -> None:
    door = root / "slurm" / "cli.py"
    files = product_files(root)
    print(
        f"door: {len(door.read_text().splitlines())} lines, imports {len(door_imports(door))} slurm modules"
    )
    long = long_functions(files, root)
    print(f"functions over 50 lines: {len(long)}" + "".join(f"\n  {f}" for f in long))
    literals = state_literals(files, root)
    print(
        f"state words spelt outside core/states.py: {len(literals)}" + "".join(f"\n  {s}" for s in literals)
    )


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent))
