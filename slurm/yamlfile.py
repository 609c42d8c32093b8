"""Reading YAML safely, remembering on which line every key was written, and merging `inherits:` chains."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from slurm.problems import Problem

KeyPath = tuple  # e.g. ("train", "learning_rate") or ("stages", 1, "name")
COMMAND_LINE = "command line"


@dataclass
class YamlFile:
    path: Path
    data: dict
    lines: dict[KeyPath, int | None] = field(default_factory=dict)  # None: a command-line override


# libyaml's parser when PyYAML was built with it: the pure-Python one is ~10x slower on a login node.
Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_parsed: dict[tuple, YamlFile] = {}  # (path, mtime, size) → parsed file: a fragment is read once per command


def read_yaml(path: Path) -> YamlFile:
    """Parse one file with safe_load semantics; raise YamlProblem on a file that is not YAML.

    Files shared by many experiments (base.yaml, fragments) are parsed once per command; each caller gets
    its own copy of the data, so merging into it never changes another experiment's view."""
    try:
        stat = path.stat()
    except OSError as exc:
        raise YamlProblem(Problem(str(path), "", f"cannot be read ({exc})")) from None
    key = (str(path), stat.st_mtime_ns, stat.st_size)
    if key not in _parsed:
        _parsed[key] = _parse(path)
    cached = _parsed[key]
    return YamlFile(cached.path, copy.deepcopy(cached.data), cached.lines)


def _parse(path: Path) -> YamlFile:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise YamlProblem(Problem(str(path), "", f"cannot be read ({exc})")) from None
    loader = Loader(text)
    try:
        # One parse gives both the data and the node tree the line numbers come from.
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else None
    except yaml.MarkedYAMLError as exc:
        # A flow mapping's mistake is found at its end; where it started is where to look.
        mark = exc.context_mark or exc.problem_mark
        line = mark.line + 1 if mark else None
        what = " ".join(str(p) for p in (exc.context, exc.problem) if p)
        raise YamlProblem(Problem(str(path), "", f"is not valid YAML: {what}", line)) from None
    except yaml.YAMLError as exc:
        raise YamlProblem(Problem(str(path), "", f"is not valid YAML: {exc}")) from None
    finally:
        loader.dispose()
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise YamlProblem(
            Problem(str(path), "", f"must be a mapping of keys, not a {type(data).__name__}", 1)
        )
    lines: dict[KeyPath, int] = {}
    _collect_lines(node, (), lines)
    return YamlFile(path, data, lines)


class YamlProblem(Exception):
    def __init__(self, problem: Problem):
        self.problem = problem
        super().__init__(str(problem))


def _collect_lines(node, prefix: KeyPath, lines: dict[KeyPath, int]) -> None:
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            path = (*prefix, key_node.value)
            lines[path] = key_node.start_mark.line + 1
            _collect_lines(value_node, path, lines)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            path = (*prefix, index)
            lines[path] = item.start_mark.line + 1
            _collect_lines(item, path, lines)


def deep_merge(base: dict, override: dict) -> dict:
    """The deeper file wins key by key; lists and scalars are replaced whole, mappings merge."""
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def find_inherited(name: str, start: Path, stop: Path) -> Path | None:
    """`inherits: base.yaml` means the nearest such file, from the child's folder up to `stop`."""
    candidate = Path(name)
    if candidate.is_absolute():
        return candidate if candidate.is_file() else None
    folder = start
    while True:
        if (folder / candidate).is_file():
            return (folder / candidate).resolve()
        if folder == stop or folder.parent == folder:
            return None
        folder = folder.parent


def load_chain(path: Path, stop: Path) -> tuple[dict, list[YamlFile]]:
    """Follow `inherits:` from an experiment file to its root; return the merged dict and the files,
    most derived first (where a key's line is looked up)."""
    chain: list[YamlFile] = []
    current = path.resolve()
    while True:
        if any(f.path == current for f in chain):
            names = " -> ".join(f.path.name for f in chain) + f" -> {current.name}"
            raise YamlProblem(Problem(str(chain[0].path), "inherits", f"inherits itself in a loop: {names}"))
        yf = read_yaml(current)
        chain.append(yf)
        parent = yf.data.pop("inherits", None)
        if parent is None:
            break
        if not isinstance(parent, str):
            raise YamlProblem(
                Problem(str(current), "inherits", "must be a file name", yf.lines.get(("inherits",)))
            )
        found = find_inherited(parent, current.parent, stop)
        if found is None:
            raise YamlProblem(
                Problem(
                    str(current),
                    "inherits",
                    f"'{parent}' not found next to this file or in a folder above it (up to {stop})",
                    yf.lines.get(("inherits",)),
                )
            )
        current = found
    merged: dict = {}
    for yf in reversed(chain):
        merged = deep_merge(merged, yf.data)
    return merged, chain


def command_line_files(overrides: dict) -> tuple[YamlFile, YamlFile]:
    """`key=value` overrides as two "files" of a chain, so a mistake in one is reported as coming from the
    command line, not from the YAML line it replaced: the keys they set (put first: they win over every
    YAML line) and the sections they reach into (put last: a check of a whole section, like
    `eval.resources` for `eval.resources.time=…`, is theirs only when no YAML file wrote that section)."""
    keys: dict[KeyPath, int | None] = {}
    sections: dict[KeyPath, int | None] = {}

    def collect(value: dict, prefix: KeyPath) -> None:
        for key, item in value.items():
            if isinstance(item, dict) and item:
                sections[(*prefix, key)] = None
                collect(item, (*prefix, key))
            else:
                keys[(*prefix, key)] = None

    collect(overrides, ())
    return YamlFile(Path(COMMAND_LINE), overrides, keys), YamlFile(Path(COMMAND_LINE), {}, sections)


def where(chain: list[YamlFile], key: KeyPath) -> tuple[str, int | None]:
    """The file and line that wrote `key` (or its nearest written parent), most derived file first."""
    for length in range(len(key), 0, -1):
        prefix = tuple(key[:length])
        for yf in chain:
            if prefix in yf.lines:
                return str(yf.path), yf.lines[prefix]
    written = next(yf for yf in chain if str(yf.path) != COMMAND_LINE)  # unplaced: the experiment's file
    return str(written.path), None
