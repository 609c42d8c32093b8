"""Reading YAML safely, remembering on which line every key was written, and merging `inherits:` chains."""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from core.files import NotARegularFile, read_regular
from core.problems import Problem

KeyPath = tuple  # e.g. ("train", "learning_rate") or ("stages", 1, "name")
COMMAND_LINE = "command line"


@dataclass
class YamlFile:
    path: Path
    data: dict
    lines: dict[KeyPath, int | None] = field(default_factory=dict)  # None: a command-line override


# libyaml's parser when PyYAML was built with it: the pure-Python one is ~10x slower on a login node.
Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
# (path, mtime, size) → parsed file, or why it was refused: a fragment is read once per command.
_parsed: dict[tuple, YamlFile | YamlProblem] = {}

# What loading one YAML may cost. A config is a few kB, nests a handful of levels and holds hundreds of values;
# the bounds sit far above that and far below what stops every command on a login node: an alias bomb
# ("billion laughs") is a few hundred bytes whose aliases expand to 10^9 values in every reader after the
# parser (line numbers, merging, validation), and nesting near Python's recursion limit (1000) crashes them.
MAX_BYTES = 1_000_000
MAX_VALUES = 100_000  # scalars, lists and mappings, keys included, each alias counted at every use
MAX_DEPTH = 64


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
        try:
            _parsed[key] = _parse(path)
        except YamlProblem as exc:  # a broken fragment is refused once, however many files inherit it
            _parsed[key] = exc
    cached = _parsed[key]
    if isinstance(cached, YamlProblem):
        raise YamlProblem(cached.problem)
    return YamlFile(cached.path, copy.deepcopy(cached.data), cached.lines)


def _parse(path: Path) -> YamlFile:
    text = _read_text(path)
    try:
        node, data = load_bounded(text, str(path))
    except yaml.MarkedYAMLError as exc:
        # A flow mapping's mistake is found at its end; where it started is where to look.
        mark = exc.context_mark or exc.problem_mark
        line = mark.line + 1 if mark else None
        what = " ".join(str(p) for p in (exc.context, exc.problem) if p)
        raise YamlProblem(Problem(str(path), "", f"is not valid YAML: {what}", line)) from None
    except yaml.YAMLError as exc:
        raise YamlProblem(Problem(str(path), "", f"is not valid YAML: {exc}")) from None
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


def _read_text(path: Path) -> str:
    """The file's text, read no further than MAX_BYTES, and only from a regular file (a FIFO named *.yaml
    would block the launch: core/files.py read_regular)."""
    try:
        raw = read_regular(path, MAX_BYTES)
    except NotARegularFile as exc:
        if str(exc).startswith("larger than"):
            exc = NotARegularFile(
                f"is larger than {MAX_BYTES:,} bytes, the most a config may be (one is a few kB; examples "
                "belong in data files, named by data.train)"
            )
            raise YamlProblem(Problem(str(path), "", str(exc))) from None
        raise YamlProblem(Problem(str(path), "", f"cannot be read: {exc}")) from None
    except OSError as exc:
        raise YamlProblem(Problem(str(path), "", f"cannot be read ({exc})")) from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise YamlProblem(Problem(str(path), "", f"cannot be read ({exc})", line)) from None


def load_bounded(text: str, source: str) -> tuple[yaml.Node | None, object]:
    """(node tree, data) of one YAML document, with safe_load semantics. Raises yaml.YAMLError for text that
    is not YAML, and YamlProblem (naming `source` and a line) for YAML that costs more than a config may:
    the bounds are checked on the node tree, before anything is built from it."""
    loader = Loader(text)
    try:
        # One parse gives both the data and the node tree the line numbers come from.
        node = loader.get_single_node()
        if node is None:
            return None, None
        check_cost(node, source)
        check_duplicate_keys(node, source)
        return node, loader.construct_document(node)
    except RecursionError:  # composing recurses in the pure-Python parser (PyYAML built without libyaml)
        what = f"nests deeper than {MAX_DEPTH} levels ({LEVELS})"
        raise YamlProblem(Problem(source, "", what)) from None
    finally:
        loader.dispose()


def check_cost(root: yaml.Node, source: str) -> None:
    """Refuse a node tree with lists and mappings nested deeper than MAX_DEPTH, one larger than MAX_VALUES
    once its aliases are expanded, or one that contains itself. Walked in document order without
    recursion, each node once: an alias reuses its anchor's counts (an anchor comes before its aliases),
    so a bomb is measured in microseconds."""
    size: dict[int, int] = {}  # id(collection) → values in it, itself included, aliases expanded
    height: dict[int, int] = {}  # id(collection) → levels of collections in it, itself included
    open_nodes: set[int] = set()  # on the path from the root: meeting one again is a cycle
    # (collection, its level, trail: (parent's trail, collection), its children once it is entered)
    stack: list[tuple[yaml.Node, int, tuple, list | None]] = [(root, 1, (None, root), None)]
    while stack:
        node, level, trail, children = stack.pop()
        ident = id(node)
        if children is not None:  # every child counted: count the node (a scalar is 1 value, 0 levels)
            size[ident] = 1 + sum(size.get(id(child), 1) for child in children)
            height[ident] = 1 + max((height.get(id(child), 0) for child in children), default=0)
            open_nodes.discard(ident)
            if size[ident] > MAX_VALUES:
                raise _too_costly(trail, False, source, f"holds more than {MAX_VALUES:,} values", ALIASES)
        elif ident in open_nodes:
            raise _too_costly(trail, True, source, "contains itself through an alias", CYCLE)
        elif ident in size:  # an alias: as deep here as its anchor's levels reach
            if level + height[ident] - 1 > MAX_DEPTH:
                raise _too_costly(trail, True, source, f"nests deeper than {MAX_DEPTH} levels", LEVELS)
        elif level > MAX_DEPTH:
            raise _too_costly(trail, False, source, f"nests deeper than {MAX_DEPTH} levels", LEVELS)
        elif not isinstance(node, yaml.ScalarNode):
            open_nodes.add(ident)
            children = (
                [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else node.value
            )
            stack.append((node, level, trail, children))
            stack.extend(
                (child, level + 1, (trail, child), None)
                for child in reversed(children)
                if not isinstance(child, yaml.ScalarNode)
            )


def check_duplicate_keys(root: yaml.Node, source: str) -> None:
    """Refuse a mapping that writes one key twice. YAML's loaders keep the last silently: a second `train:`
    block erased the first one's `epochs: 1`, a repeated key in a sweep grid dropped its values. Every
    duplicate of the file is named, each with both lines; the problem points at the first one's second
    line. Merge keys (`<<`) are YAML's own way to repeat and are left alone."""
    found: list[tuple[tuple, int, int]] = []  # (key path, first line, second line)
    stack: list[tuple[yaml.Node, tuple]] = [(root, ())]
    visited: set[int] = set()  # an alias is its anchor's node: walked once
    while stack:
        node, path = stack.pop()
        if id(node) in visited or isinstance(node, yaml.ScalarNode):
            continue
        visited.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            stack.extend((item, (*path, i)) for i, item in enumerate(node.value))
            continue
        first: dict[tuple, int] = {}
        for key, value in node.value:
            name = key.value if isinstance(key, yaml.ScalarNode) else "?"
            if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                line = key.start_mark.line + 1
                if (key.tag, name) in first:
                    found.append(((*path, name), first[(key.tag, name)], line))
                else:
                    first[(key.tag, name)] = line
            stack.append((value, (*path, name)))
    if not found:
        return
    found.sort(key=lambda item: item[2])
    (key, line_a, line_b), others = found[0], found[1:]
    message = (
        f"is written twice, at lines {line_a} and {line_b} (YAML would keep the second and silently drop "
        "the first: write the key once, merging the two)"
    )
    if others:
        message += "; also written twice: " + ", ".join(
            f"{'.'.join(map(str, k))} (lines {a} and {b})" for k, a, b in others
        )
    raise YamlProblem(Problem(source, ".".join(map(str, key)), message, line_b))


ALIASES = (
    "a config holds hundreds of values; an alias (*name) repeats its anchor's whole value wherever it is "
    "used, so a few lines of aliases can stand for billions"
)
CYCLE = "an alias inside its own anchor's value repeats that value without end"
LEVELS = "a config nests a few levels deep; write this value flatter"


def _too_costly(trail: tuple, used: bool, source: str, what: str, hint: str) -> YamlProblem:
    """The problem at the node a trail ends on, or where it is `used` (an alias has no line of its own: the
    key before it has, or the list holding it)."""
    nodes = []
    while trail is not None:
        trail, node = trail
        nodes.append(node)
    nodes.reverse()
    keys, line = [], nodes[-1].start_mark.line + 1
    for parent, child in itertools.pairwise(nodes):
        if isinstance(parent, yaml.MappingNode):
            key = next(k for k, v in parent.value if child is v or child is k)
            keys.append(key.value if isinstance(key, yaml.ScalarNode) else "?")
            line = key.start_mark.line + 1
        else:
            keys.append(next(i for i, item in enumerate(parent.value) if item is child))
            line = parent.start_mark.line + 1
    if not used:
        line = nodes[-1].start_mark.line + 1
    shown = ".".join(map(str, keys[:4])) + (f"… ({len(keys)} levels)" if len(keys) > 4 else "")
    return YamlProblem(Problem(source, shown, f"{what} ({hint})", line))


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


# The project's own configs: a file of one's own folder may inherit them by path.
SHIPPED_CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def shipped_hint(name: str) -> str:
    """`; the project's own base.yaml is …: write inherits: …` where the project ships a file of that name
    (before: a folder of one's own, outside configs/, got only "not found")."""
    shipped = SHIPPED_CONFIGS / name
    if Path(name).is_absolute() or not shipped.is_file():
        return ""
    return f"; the project's own {name} is {shipped}: write inherits: {shipped}"


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
                    f"'{parent}' not found next to this file or in a folder above it (up to {stop})"
                    + shipped_hint(parent),
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
