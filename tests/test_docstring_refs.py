"""Docstrings and docs/how-it-works.md name code as `path/module.py name` or `package.module.name`; a rename
or a move leaves such a reference pointing at nothing (core/split.py once named `train/device.py split_for_job`,
which never existed). This reads the product's docstrings and that page and resolves every reference
against the source with `ast` (nothing is imported: the trainer's modules need torch)."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("core", "slurm", "train", "eval")
PACKAGES = (*PRODUCT, "bench", "demo")
_PATH_REF = re.compile(
    rf"(?P<path>(?:{'|'.join(PACKAGES)})(?:/[a-z_]+)*/[a-z_]+\.py)`? `?(?P<name>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)?)(?P<call>\()?"
)
_DOTTED_REF = re.compile(rf"\b(?P<dotted>(?:{'|'.join(PRODUCT)})(?:\.[a-z_]+)+\.[A-Za-z_]\w*)")


def _looks_like_code(name: str, call: bool) -> bool:
    """A word after a path is a reference when it reads as code: snake_case with an underscore, CamelCase,
    a dotted attribute or a call; 'train/recipe.py passes ...' is prose."""
    return call or "_" in name or "." in name or any(c.isupper() for c in name[1:]) or name[:1].isupper()


@cache
def _names(path: Path) -> dict[str, set[str]]:
    """Top-level names defined in a module, each with its attributes (a class's methods and fields)."""
    tree = ast.parse(path.read_text())
    names: dict[str, set[str]] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names[node.name] = set()
        elif isinstance(node, ast.ClassDef):
            members = set()
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    members.add(item.name)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    members.add(item.target.id)
                elif isinstance(item, ast.Assign):
                    members |= {t.id for t in item.targets if isinstance(t, ast.Name)}
            names[node.name] = members
        elif isinstance(node, ast.Assign):
            names.update({t.id: set() for t in node.targets if isinstance(t, ast.Name)})
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = set()
    return names


def _resolves(path: Path, name: str) -> bool:
    if not path.is_file():
        return False
    head, _, attribute = name.partition(".")
    names = _names(path)
    return head in names and (not attribute or attribute in names[head])


def _dotted_resolves(dotted: str) -> bool:
    """`train.chat.text_tokenizer` (or a module `train.chat`): the longest prefix that is a module file, then at
    most a name and its attribute. `eval.resources.time` is a config key: `eval/resources.py` is no module."""
    parts = dotted.split(".")
    if not (ROOT / parts[0] / f"{parts[1]}.py").is_file() and not (ROOT / parts[0] / parts[1]).is_dir():
        return True  # a config key (`eval.resources.time`, `train.micro_batch`), not a module
    for cut in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:cut])
        module = base.with_suffix(".py") if not base.is_dir() else base / "__init__.py"
        if module.is_file():
            rest = parts[cut:]
            return not rest or (len(rest) <= 2 and _resolves(module, ".".join(rest)))
    return False


def _docstrings(path: Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                yield getattr(node, "lineno", 1), doc


def _how_it_works() -> str:
    return (ROOT / "docs" / "how-it-works.md").read_text()


def _broken(text: str) -> list[str]:
    broken = []
    for match in _PATH_REF.finditer(text):
        name, call = match["name"], bool(match["call"])
        if _looks_like_code(name, call) and not _resolves(ROOT / match["path"], name):
            broken.append(f"{match['path']} {name}")
    for match in _DOTTED_REF.finditer(text):
        if not _dotted_resolves(match["dotted"]):
            broken.append(match["dotted"])
    return broken


def test_no_docstring_names_a_function_or_file_that_does_not_exist():
    broken = []
    for package in PRODUCT:
        for path in sorted((ROOT / package).rglob("*.py")):
            for line, doc in _docstrings(path):
                broken += [f"{path.relative_to(ROOT)}:{line}: {ref}" for ref in _broken(doc)]
    assert not broken, "docstring references that do not resolve:\n" + "\n".join(broken)


def test_readme_how_it_works_names_only_code_that_exists():
    broken = _broken(_how_it_works())
    assert not broken, "docs/how-it-works.md references that do not resolve:\n" + "\n".join(broken)


def test_reference_checker_catches_a_renamed_function():
    # The checker itself: a reference to a function that was renamed away must be reported, the real one not.
    assert _broken("the job applies it (train/device.py split_for_job)") == ["train/device.py split_for_job"]
    assert _broken("the table `train/device.py` `decide(hardware, ...)`") == []
    assert _broken("see core.split.no_such_thing") == ["core.split.no_such_thing"]
    assert _broken("`eval.resources.time` and train.micro_batch are config keys") == []
