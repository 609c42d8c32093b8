"""A `sweep:` block: one experiment expanded into many ordinary experiments, its points.

    sweep:
      grid: {train.learning_rate: [1.0e-4, 3.0e-4], adapter.rank: [8, 16]}   # the product, as written
      zip: [{train.warmup_ratio: [0.0, 0.1], train.weight_decay: [0.0, 0.01]}]  # a group changes together
      random: {train.learning_rate: {loguniform: [1.0e-5, 1.0e-3]}, adapter.rank: {choice: [4, 8]}}
      samples: 4          # random's draws: required with random, refused without it
      seed: 0             # the draws' seed (default 0): the same file gives the same draws
      seeds: [1, 2, 3]    # training seeds: every point trained once per seed, into train.seed
      select: {metric: eval_loss, mode: min}   # kept for the report

Points are grid's product (first key slowest) x the zip groups' product x random's draws, each replicated
over `seeds`. A point is the experiment's raw config with `nested(point.values)` deep-merged in, named
`{experiment}-{point.suffix}`. Random floats are rounded to 3 significant digits before use, and ints
drawn from `int` include both bounds. At most MAX_POINTS points; every problem is reported at once.

Names. A suffix is `label+value` for each key the block sweeps, joined by '-', then `-s{seed}`
(`lr3e-04-r8-s1`); labels come from SHORT_KEYS, else the key's last part, lengthened (`rank`, then
`adapter_rank`, ...) where two keys would share one. Values: ints as written, floats in the shorter of
`0.0003` and `3e-04` that reads back as the value trained, text after its last '/' with anything
outside [A-Za-z0-9_.] turned into '_', true/false, none, lists joined by '_'. Where any name would pass
64 characters, every point drops its labels (`3e-04-8-s1`), and if that is still too long, becomes
`p{n}-{hash of its values}` (`p3-1a2b3c-s1`). A repeated suffix (equal draws, or text that slugs alike,
compared without case) gets `_2`, `_3`, ... in order of appearance. Replicates of a point share
`point`, the suffix without its seed part.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import random
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from decimal import Decimal
from typing import Literal

from spec.config import SAFE_NAME
from spec.problems import did_you_mean

BLOCK_KEYS = ("grid", "zip", "random", "samples", "seed", "seeds", "select")
DISTRIBUTIONS = ("uniform", "loguniform", "choice", "int")
BOUNDS_EXAMPLE = {"uniform": "[0.0, 0.2]", "loguniform": "[1.0e-5, 1.0e-3]", "int": "[1, 3]"}
SELECT_KEYS = ("metric", "mode")
MAX_POINTS = 1000  # more is almost always a typo in a grid, and each point is a queued job
SEED_KEY = "train.seed"
DOTTED_KEY = re.compile(r"[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*")
# A swept key's first part that cannot vary from point to point, and why.
UNSWEPT = {
    "name": "each point's name is made from the experiment's name",
    "sweep": "a sweep cannot vary its own block",
}
# Labels for the keys swept most, so names stay short and readable: lr3e-04-r8-s1.
SHORT_KEYS = {
    "learning_rate": "lr",
    "rank": "r",
    "alpha": "a",
    "dropout": "do",
    "batch_size": "bs",
    "grad_accum": "ga",
    "epochs": "ep",
    "weight_decay": "wd",
    "warmup_ratio": "wu",
    "max_length": "len",
    "seed": "s",
    "name_or_path": "m",
    "target_modules": "tm",
    "gradient_checkpointing": "gc",
    "max_steps": "steps",
}
HASH_CHARS = 6
NAME_MAX = 64  # SAFE_NAME's limit: a name becomes a folder and a SLURM job name

KeyPath = tuple  # keys and list indices inside the sweep block, e.g. ("zip", 0)
Problems = list[tuple[tuple, str]]


@dataclass(frozen=True)
class SweepPoint:
    suffix: str  # the name's part after the experiment's: unique within the sweep
    values: dict  # dotted key -> value: grid keys, zip keys, random keys, then train.seed with seeds
    seed: int | None  # this replicate's training seed; None without `seeds:`
    point: str  # the suffix without its seed part: what the replicates of one point share


@dataclass(frozen=True)
class SweepSelect:
    metric: str
    mode: Literal["min", "max"]


@dataclass(frozen=True)
class Sweep:
    points: tuple[SweepPoint, ...]
    swept: tuple[str, ...]  # the keys grid, zip and random vary (train.seed from seeds is not one)
    select: SweepSelect | None


class SweepError(Exception):
    """Every problem found in a sweep block, each (key path inside the block, message)."""

    def __init__(self, problems: Problems):
        self.problems = list(problems)
        super().__init__("\n".join(f"{shown_path(path)}: {message}" for path, message in self.problems))


@dataclass(frozen=True)
class Axis:
    """Keys that change together and the rows of values they take: a grid key, a zip group, the draws."""

    keys: tuple[str, ...]
    rows: tuple[tuple, ...]
    where: KeyPath


@dataclass(frozen=True)
class Distribution:
    kind: str
    args: tuple  # (low, high), or the choices


@dataclass
class Block:
    """What the block says, as far as it could be read."""

    axes: list[Axis]  # grid keys, then zip groups
    draws: list[tuple[str, Distribution]]
    samples: int | None
    seed: int
    seeds: tuple[int, ...]
    select: SweepSelect | None


def expand(block: object, experiment_name: str) -> Sweep:
    """The points of `experiment_name`'s sweep block; SweepError lists every problem in it."""
    problems: Problems = []
    if not SAFE_NAME.fullmatch(experiment_name):
        problems.append(((), f"the experiment's name {experiment_name!r} is not a valid name to extend"))
    read = read_block(block, problems)
    check_size(read, problems)
    if problems:
        raise SweepError(problems)
    axes = read.axes + ([drawn(read.draws, read.samples, read.seed)] if read.draws else [])
    points = name_points(list(combinations(axes)), read.seeds, experiment_name, problems)
    if problems:
        raise SweepError(problems)
    swept = tuple(key for axis in axes for key in axis.keys)
    return Sweep(points=tuple(points), swept=swept, select=read.select)


def nested(values: dict) -> dict:
    """{"train.learning_rate": 1e-4} -> {"train": {"learning_rate": 1e-4}}, ready to deep-merge."""
    tree: dict = {}
    for key, value in values.items():
        *sections, leaf = key.split(".")
        branch = tree
        for section in sections:
            branch = branch.setdefault(section, {})
            if not isinstance(branch, dict):
                raise ValueError(f"{key} lies inside {section}, which has a value of its own")
        if leaf in branch:
            raise ValueError(f"{key} is given twice, or also as a section")
        branch[leaf] = list(value) if isinstance(value, list) else value  # each point owns its lists
    return tree


# Reading the block: each reader keeps what is right and adds a problem for the rest.


def read_block(block: object, problems: Problems) -> Block:
    read = Block(axes=[], draws=[], samples=None, seed=0, seeds=(), select=None)
    if not isinstance(block, dict):
        problems.append(
            ((), f"sweep must be a mapping with some of {', '.join(BLOCK_KEYS)}; got {shown(block)}")
        )
        return read
    for key in block:
        if key not in BLOCK_KEYS:
            hint = did_you_mean(str(key), BLOCK_KEYS)
            problems.append(
                ((key,), f"unknown key {key!r} in sweep{hint}; it may hold {', '.join(BLOCK_KEYS)}")
            )
    if "grid" in block:
        read.axes += read_grid(block["grid"], problems)
    if "zip" in block:
        read.axes += read_zip(block["zip"], problems)
    if "random" in block:
        read.draws = read_random(block["random"], problems)
    read.samples = read_samples(block, problems)
    read.seed = read_seed(block, problems)
    if "seeds" in block:
        read.seeds = read_seeds(block["seeds"], problems)
    if "select" in block:
        read.select = read_select(block["select"], problems)
    check_swept_once(swept_keys(read), "seeds" in block, problems)
    if not any(part in block for part in ("grid", "zip", "random", "seeds")):
        problems.append(((), "a sweep needs something to vary: grid, zip, random or seeds"))
    return read


def read_grid(grid: object, problems: Problems) -> list[Axis]:
    if not isinstance(grid, dict) or not grid:
        problems.append(
            (
                ("grid",),
                f"grid maps keys to lists, e.g. {{train.learning_rate: [1.0e-4, 3.0e-4]}}; got {shown(grid)}",
            )
        )
        return []
    axes = []
    for key, values in grid.items():
        path = ("grid", key)
        if key_is_sweepable(key, path, problems) and values_are_usable(values, path, problems):
            rows = tuple((value,) for value in values)
            if rows_are_distinct(rows, path, problems):
                axes.append(Axis((key,), rows, path))
    return axes


def read_zip(groups: object, problems: Problems) -> list[Axis]:
    if not isinstance(groups, list) or not groups:
        problems.append(
            (
                ("zip",),
                "zip is a list of groups, each mapping keys to lists that change together, e.g. "
                f"[{{train.warmup_ratio: [0.0, 0.1], train.weight_decay: [0.0, 0.01]}}]; got {shown(groups)}",
            )
        )
        return []
    axes = [read_zip_group(group, ("zip", index), problems) for index, group in enumerate(groups)]
    return [axis for axis in axes if axis]


def read_zip_group(group: object, path: KeyPath, problems: Problems) -> Axis | None:
    if not isinstance(group, dict) or not group:
        problems.append((path, f"a zip group maps keys to lists of one length; got {shown(group)}"))
        return None
    lists = {
        key: values
        for key, values in group.items()
        if key_is_sweepable(key, (*path, key), problems) and values_are_usable(values, (*path, key), problems)
    }
    if len(lists) < len(group):
        return None
    if len({len(values) for values in lists.values()}) > 1:
        lengths = ", ".join(f"{key} has {len(values)}" for key, values in lists.items())
        problems.append(
            (
                path,
                f"the lists of a zip group change together, so they need one length; here {lengths} "
                "(keys that vary independently belong in grid)",
            )
        )
        return None
    rows = tuple(zip(*lists.values(), strict=True))
    return Axis(tuple(lists), rows, path) if rows_are_distinct(rows, path, problems) else None


def read_random(block: object, problems: Problems) -> list[tuple[str, Distribution]]:
    if not isinstance(block, dict) or not block:
        problems.append(
            (
                ("random",),
                f"random maps keys to distributions, e.g. {{adapter.rank: {{choice: [4, 8]}}}}; got {shown(block)}",
            )
        )
        return []
    draws = []
    for key, spec in block.items():
        path = ("random", key)
        if key_is_sweepable(key, path, problems):
            distribution = read_distribution(spec, path, problems)
            if distribution:
                draws.append((key, distribution))
    return draws


def read_distribution(spec: object, path: KeyPath, problems: Problems) -> Distribution | None:
    if not isinstance(spec, dict) or len(spec) != 1:
        problems.append(
            (
                path,
                f"expected one distribution of {', '.join(DISTRIBUTIONS)}, e.g. {{uniform: [0.0, 0.2]}}; got {shown(spec)}",
            )
        )
        return None
    ((kind, args),) = spec.items()
    if kind not in DISTRIBUTIONS:
        hint = did_you_mean(str(kind), DISTRIBUTIONS)
        problems.append((path, f"unknown distribution {kind!r}{hint}; use one of {', '.join(DISTRIBUTIONS)}"))
        return None
    if kind == "choice":
        usable = values_are_usable(args, path, problems, example="{choice: [4, 8, 16]}")
        return Distribution(kind, tuple(args)) if usable else None
    wrong = bounds_problem(kind, args)
    if wrong:
        problems.append((path, wrong))
        return None
    low, high = args
    return Distribution(kind, (low, high) if kind == "int" else (float(low), float(high)))


def bounds_problem(kind: str, bounds: object) -> str | None:
    """What is wrong with a uniform, loguniform or int distribution's [low, high]; None when nothing is."""
    example = f"e.g. {{{kind}: {BOUNDS_EXAMPLE[kind]}}}"
    if not isinstance(bounds, list) or len(bounds) != 2:
        return f"{kind} takes two bounds [low, high], {example}; got {shown(bounds)}"
    low, high = bounds
    if kind == "int" and not (is_int(low) and is_int(high)):
        return f"int's bounds must be whole numbers (both included), {example}; got {shown(bounds)}"
    if not all(is_number(bound) and math.isfinite(bound) for bound in bounds):
        return f"{kind}'s bounds must be finite numbers, {example}; got {shown(bounds)}{yaml_number_hint(bounds)}"
    if low >= high:
        return f"{kind}'s low bound must be below its high bound; got [{low}, {high}]"
    if kind == "loguniform" and low <= 0:
        return (
            f"loguniform's bounds must be above 0 (it draws their logarithm uniformly); got [{low}, {high}]"
        )
    return None


def yaml_number_hint(values: list) -> str:
    # YAML 1.1 reads 1e-5 (no dot) as text: the commonest way a learning rate goes wrong.
    texts = [value for value in values if isinstance(value, str) and looks_like_number(value)]
    return f" (YAML reads {texts[0]} as text: write it with a dot, e.g. 1.0e-5)" if texts else ""


def read_samples(block: dict, problems: Problems) -> int | None:
    has_random = "random" in block
    if "samples" not in block:
        if has_random:
            problems.append((("random",), "random needs samples: how many draws to make, e.g. samples: 8"))
        return None
    samples = block["samples"]
    if not is_int(samples) or samples < 1:
        problems.append(
            (("samples",), f"samples must be a whole number of draws, 1 or more; got {shown(samples)}")
        )
        return None
    if not has_random:
        problems.append(
            (
                ("samples",),
                "samples counts random's draws and there is no random: add random, or remove samples",
            )
        )
        return None
    return samples


def read_seed(block: dict, problems: Problems) -> int:
    if "seed" not in block:
        return 0
    seed = block["seed"]
    if not is_int(seed):
        problems.append(
            (("seed",), f"seed (the random draws' seed) must be a whole number; got {shown(seed)}")
        )
        return 0
    if "random" not in block:
        problems.append(
            (
                ("seed",),
                "seed is the seed of random's draws and there is no random; training seeds go in seeds: [1, 2, 3]",
            )
        )
    return seed


def read_seeds(seeds: object, problems: Problems) -> tuple[int, ...]:
    example = "e.g. seeds: [1, 2, 3] (each point is trained once per seed)"
    if not isinstance(seeds, list) or not seeds:
        problems.append(
            (("seeds",), f"seeds must be a non-empty list of whole numbers, {example}; got {shown(seeds)}")
        )
        return ()
    if not all(is_int(seed) for seed in seeds):
        problems.append((("seeds",), f"seeds must be whole numbers, {example}; got {shown(seeds)}"))
        return ()
    repeated = sorted({seed for seed in seeds if seeds.count(seed) > 1})
    if repeated:
        problems.append(
            (("seeds",), f"seeds lists {shown(repeated)} more than once: each replicate needs its own seed")
        )
        return ()
    return tuple(seeds)


def read_select(select: object, problems: Problems) -> SweepSelect | None:
    example = "e.g. select: {metric: eval_loss, mode: min}"
    if not isinstance(select, dict):
        problems.append(
            (("select",), f"select must be a mapping of metric and mode, {example}; got {shown(select)}")
        )
        return None
    count = len(problems)
    for key in select:
        if key not in SELECT_KEYS:
            hint = did_you_mean(str(key), SELECT_KEYS)
            problems.append(
                (("select", key), f"unknown key {key!r} in select{hint}; it holds metric and mode")
            )
    metric, mode = select.get("metric"), select.get("mode")
    if not isinstance(metric, str) or not metric.strip():
        where = ("select", "metric") if "metric" in select else ("select",)
        problems.append(
            (where, f"select needs metric: the name of the score that picks the best point, {example}")
        )
    if mode not in ("min", "max"):
        where = ("select", "mode") if "mode" in select else ("select",)
        problems.append(
            (
                where,
                f"select needs mode: min or max (is a lower or a higher score better?); got {shown(mode)}",
            )
        )
    return SweepSelect(metric=metric, mode=mode) if len(problems) == count else None


# Checks shared by the readers.


def key_is_sweepable(key: object, path: KeyPath, problems: Problems) -> bool:
    if not isinstance(key, str) or not DOTTED_KEY.fullmatch(key):
        problems.append(
            (
                path,
                f"{shown(key)} is not a dotted key: names of letters, digits and '_' joined by single dots, "
                "e.g. train.learning_rate",
            )
        )
        return False
    section = key.split(".")[0]
    if section in UNSWEPT:
        problems.append((path, f"{key} cannot be swept: {UNSWEPT[section]}"))
        return False
    if index := next((part for part in key.split(".") if part.isdigit()), None):
        problems.append(
            (
                path,
                f"{key} goes into a list ({index} is a list item's position): list items cannot be swept; "
                "sweep a key of the experiment (e.g. train.learning_rate), which every stage inherits",
            )
        )
        return False
    return True


def values_are_usable(values: object, path: KeyPath, problems: Problems, example: str = "[8, 16]") -> bool:
    if not isinstance(values, list) or not values:
        one = (
            f" (one value is written [{values}], or set in the experiment itself)"
            if isinstance(values, (str, int, float)) and not isinstance(values, bool)
            else ""
        )
        problems.append(
            (path, f"expected a non-empty list of values, e.g. {example}; got {shown(values)}{one}")
        )
        return False
    unusable = [f"item {index}: {shown(value)}" for index, value in enumerate(values) if not is_value(value)]
    if unusable:
        problems.append(
            (
                path,
                "values must be numbers, text, true/false, null or lists of those (sweep a section's keys "
                f"one by one); got {'; '.join(unusable)}",
            )
        )
        return False
    return True


def rows_are_distinct(rows: tuple[tuple, ...], path: KeyPath, problems: Problems) -> bool:
    # Two equal rows would train the same run twice under two names.
    seen: set[tuple] = set()
    repeated = []
    for row in rows:
        key = row_key(row)
        if key in seen:
            repeated.append(row)
        seen.add(key)
    if repeated:
        shown_row = shown(repeated[0][0] if len(repeated[0]) == 1 else list(repeated[0]))
        problems.append((path, f"lists {shown_row} more than once: two points would train the same thing"))
    return not repeated


def swept_keys(read: Block) -> list[tuple[str, KeyPath]]:
    # A grid axis's path ends with its key already; a zip group's ends with the group's index.
    on_axes = [
        (key, axis.where if axis.where[-1] == key else (*axis.where, key))
        for axis in read.axes
        for key in axis.keys
    ]
    return on_axes + [(key, ("random", key)) for key, _ in read.draws]


def check_swept_once(swept: list[tuple[str, KeyPath]], has_seeds: bool, problems: Problems) -> None:
    first: dict[str, KeyPath] = {}
    for key, path in swept:
        if key in first:
            problems.append(
                (
                    path,
                    f"{key} is swept already at {shown_path(first[key])}: a key may vary in one place only",
                )
            )
        first.setdefault(key, path)
        if key == SEED_KEY and has_seeds:
            problems.append(
                (path, f"{SEED_KEY} is what seeds sets (once per replicate): list the seeds in seeds")
            )
        elif has_seeds and SEED_KEY.startswith(key + "."):
            problems.append(
                (
                    path,
                    f"{key} is swept whole, and seeds sets {SEED_KEY} inside it: sweep the keys inside "
                    f"{key} (e.g. {key}.learning_rate) instead",
                )
            )
    for inner, path in first.items():
        outer = next((key for key in first if inner.startswith(key + ".")), None)
        if outer:
            problems.append(
                (path, f"{inner} lies inside {outer}, which is swept too: sweep one or the other")
            )


def check_size(read: Block, problems: Problems) -> None:
    factors = [(len(axis.rows), " ".join(str(part) for part in axis.where)) for axis in read.axes]
    factors += [(read.samples, "samples")] if read.samples else []
    factors += [(len(read.seeds), "seeds")] if read.seeds else []
    total = math.prod(count for count, _ in factors)
    if total > MAX_POINTS:
        product = " x ".join(f"{count} ({where})" for count, where in factors)
        problems.append(
            (
                (),
                f"this sweep would make {total} runs = {product}, over the limit of {MAX_POINTS}: narrow it, "
                "or sample it with random and samples",
            )
        )


# Making the points.


def drawn(draws: list[tuple[str, Distribution]], samples: int, seed: int) -> Axis:
    rng = random.Random(seed)  # one generator, drawn in written order: the same block gives the same draws
    rows = tuple(tuple(draw(distribution, rng) for _, distribution in draws) for _ in range(samples))
    return Axis(tuple(key for key, _ in draws), rows, ("random",))


def draw(distribution: Distribution, rng: random.Random):
    kind, args = distribution.kind, distribution.args
    if kind == "choice":
        return rng.choice(args)
    if kind == "int":
        return rng.randint(*args)
    low, high = args
    if kind == "uniform":
        value = rng.uniform(low, high)
    else:
        value = math.exp(rng.uniform(math.log(low), math.log(high)))
    # Rounded before use, so the name shows exactly the value trained; rounding must not leave the bounds.
    return min(max(float(f"{value:.2e}"), low), high)


def combinations(axes: list[Axis]) -> Iterable[dict]:
    for rows in itertools.product(*(axis.rows for axis in axes)):
        yield {
            key: value
            for axis, row in zip(axes, rows, strict=True)
            for key, value in zip(axis.keys, row, strict=True)
        }


def name_points(
    combos: list[dict], seeds: tuple[int, ...], experiment: str, problems: Problems
) -> list[SweepPoint]:
    keys = list(combos[0]) + ([SEED_KEY] if seeds else [])
    label = labels(keys)
    styles: list[Callable[[int, dict], str]] = [
        lambda _, values: "-".join(label[key] + value_text(value) for key, value in values.items()),
        lambda _, values: "-".join(value_text(value) for value in values.values()),
        lambda index, values: f"p{index + 1}-{values_hash(values)}",
    ]
    for style in styles:
        texts = made_unique([style(index, values) for index, values in enumerate(combos)])
        points = replicated(combos, texts, seeds, label.get(SEED_KEY, ""))
        if all_names_fit(experiment, points):
            return points
    longest = max((point.suffix for point in points), key=len)  # of the shortest style
    room = NAME_MAX - 1 - len(longest)
    problems.append(
        (
            (),
            f"the experiment's name {experiment!r} ({len(experiment)} characters) leaves no room for its "
            f"points' names: with the shortest suffixes, such as {longest!r}, names pass {NAME_MAX} "
            f"characters; shorten the experiment's name to {room} or fewer",
        )
    )
    return []


def replicated(
    combos: list[dict], texts: list[str], seeds: tuple[int, ...], seed_label: str
) -> list[SweepPoint]:
    if not seeds:
        return [
            SweepPoint(suffix=text, values=dict(values), seed=None, point=text)
            for values, text in zip(combos, texts, strict=True)
        ]
    return [
        SweepPoint(
            suffix="-".join(part for part in (text, f"{seed_label}{seed}") if part),
            values={**values, SEED_KEY: seed},
            seed=seed,
            point=text,
        )
        for values, text in zip(combos, texts, strict=True)
        for seed in seeds
    ]


def all_names_fit(experiment: str, points: list[SweepPoint]) -> bool:
    names = [f"{experiment}-{point.suffix}" for point in points]
    distinct = len({name.casefold() for name in names}) == len(names)
    return distinct and all(SAFE_NAME.fullmatch(name) for name in names)


def made_unique(texts: list[str]) -> list[str]:
    """Later repeats get _2, _3, ...; case is ignored, as a case-insensitive disk would."""
    taken = {text.casefold() for text in texts}
    seen: set[str] = set()
    unique = []
    for text in texts:
        candidate, number = text, 2
        # A renamed repeat must not take the name another point has by right.
        while candidate.casefold() in seen or (candidate != text and candidate.casefold() in taken):
            candidate, number = f"{text}_{number}", number + 1
        seen.add(candidate.casefold())
        unique.append(candidate)
    return unique


def labels(keys: list[str]) -> dict[str, str]:
    """Each key's label in a name: short, and distinct from the others' where lengthening can make it so."""
    depth = dict.fromkeys(keys, 0)
    while True:
        label = {key: label_at(key, depth[key]) for key in keys}
        folded = [text.casefold() for text in label.values()]
        clashing = [
            key
            for key in keys
            if folded.count(label[key].casefold()) > 1 and depth[key] <= key.count(".") + 1
        ]
        if not clashing:
            return label
        for key in clashing:
            depth[key] += 1


def label_at(key: str, depth: int) -> str:
    """0: the short form of the last part; 1: the last part; n: the last n parts; past them all: the key."""
    parts = key.split(".")
    if depth == 0:
        return SHORT_KEYS.get(parts[-1], parts[-1])
    return "_".join(parts[-depth:]) if depth <= len(parts) else key


def value_text(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return float_text(value)
    if value is None:
        return "none"
    if isinstance(value, list):
        return "_".join(value_text(item) for item in value) or "empty"
    # A hub id or a path is named by its last part: Qwen/Qwen2.5-0.5B -> Qwen2.5_0.5B.
    return re.sub(r"[^A-Za-z0-9_.]", "_", str(value).rsplit("/", 1)[-1]) or "_"


def float_text(value: float) -> str:
    """The shorter of 0.0003 and 3e-04 that reads back as exactly `value` (the decimal one on a tie)."""
    if not math.isfinite(value):
        return str(value)
    decimal = repr(value)
    if "e" in decimal:
        decimal = format(Decimal(decimal), "f")
    return min(decimal, scientific_text(value), key=len)


def scientific_text(value: float) -> str:
    """The fewest digits that read back as `value`: 3e-04, 1.5e-05, 1e06."""
    for digits in range(17):
        text = f"{value:.{digits}e}"
        if float(text) == value:
            break
    return text.replace("e+", "e")  # '+' cannot be in a name, and 1e06 reads back as 1e+06 does


def values_hash(values: dict) -> str:
    return hashlib.sha1(repr(list(values.items())).encode()).hexdigest()[:HASH_CHARS]


# Small predicates and how things are shown in messages.


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_scalar(value: object) -> bool:
    return value is None or isinstance(value, (str, int, float, bool))


def is_value(value: object) -> bool:
    return is_scalar(value) or (isinstance(value, list) and all(is_scalar(item) for item in value))


def row_key(row: tuple) -> tuple:
    # With each value's type: 1 == 1.0 == True in Python, but they are three different settings.
    return tuple((type(value).__name__, tuple(value) if isinstance(value, list) else value) for value in row)


def looks_like_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def shown_path(path: KeyPath) -> str:
    return ".".join(["sweep", *(str(part) for part in path)])


@dataclass(frozen=True)
class SweepMember:
    """What an experiment made from a sweep point carries beside its config (never in its hash): the report
    groups replicates by `point` and compares points on `values`; `--exp SWEEP` selects every point."""

    sweep: str  # the experiment's name in its file
    point: str  # the point's name without the seed: its replicates share it
    values: dict  # swept key -> value (train.seed from `seeds:` is `seed`, not here)
    seed: int | None
    swept: tuple[str, ...]
    select: SweepSelect | None


def source_of(block: dict, key: str, seeded: bool) -> KeyPath:
    """Where in the block `key`'s values were written: for a problem's file:line."""
    if seeded and key == SEED_KEY:
        return ("seeds",)
    for part in ("grid", "random"):
        if isinstance(block.get(part), dict) and key in block[part]:
            return (part, key)
    for index, group in enumerate(block.get("zip") or []):
        if isinstance(group, dict) and key in group:
            return ("zip", index, key)
    return ()
