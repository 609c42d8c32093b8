"""A `sweep:` block: one experiment expanded into many ordinary experiments, its points.

    sweep:
      grid: {train.learning_rate: [1.0e-4, 3.0e-4], adapter.rank: [8, 16]}   # the product, as written
      zip: [{train.warmup_ratio: [0.0, 0.1], train.weight_decay: [0.0, 0.01]}]  # a group changes together
      random: {train.learning_rate: {loguniform: [1.0e-5, 1.0e-3]}, adapter.rank: {choice: [4, 8]}}
      samples: 4          # random's draws: required with random, refused without it
      seed: 0             # the draws' seed (default 0): the same file gives the same draws
      seeds: [1, 2, 3]    # training seeds: every point trained once per seed, into train.seed
      select: {metric: eval_loss, mode: min}   # kept for the report
      prune: {rungs: [1, 2], keep: 0.33, min_points: 3, eval_pruned: true}  # stop losing runs early
      parallel: 4         # on SLURM, at most 4 tasks of each of its job arrays run at once

Points are grid's product (first key slowest) x the zip groups' product x random's draws, each replicated
over `seeds`. A point is the experiment's raw config with `nested(point.values)` deep-merged in, named
`{experiment}-{point.suffix}`. Random floats are rounded to 3 significant digits before use, and ints
drawn from `int` include both bounds. At most MAX_POINTS points.

The block is a pydantic model, SweepSpec, like every other block of an experiment: unknown keys are refused,
and every problem is reported at once, in pydantic's shape (SweepError), so the loader shows each like any
other block's, at `file:line: sweep.KEY: what (hint)` (slurm/planning/validation.py to_problem).

Names. A point's name comes from its own values alone, never from its neighbours' (adding, removing or
reordering values renames no other point, and no finished point is planned again under a new name). Its
suffix is `label+value` for each key the block sweeps, joined by '-', then `-s{seed}` (`lr3e-04-r8-s1`);
labels come from SHORT_KEYS, else the key's last part, lengthened (`rank`, then `adapter_rank`, ...) where
two keys would share one. Values: ints as written, floats in the shorter of `0.0003` and `3e-04` that
reads back as the value trained, true/false, none, text after its last '/' with anything outside
[A-Za-z0-9_.] turned into '_', lists joined by '_'; where that loses something (`org1/m` and `org2/m`), 4
characters of the value's own hash follow (`m_1a2b`). A point whose name would pass 64 characters drops
its labels (`3e-04-8-s1`), and if that is still too long is named by its values' hash (`h1a2b3c-s1`).
Replicates of a point share `point`, the suffix without its seed part. Names of sweeps launched before
names were stable are still found (`SweepPoint.legacy`, slurm/planning/sweeps.py point_name).
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
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    Field,
    PlainValidator,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails

from core.config import SAFE_NAME, Int, PruneSpec, Section

DISTRIBUTIONS = ("uniform", "loguniform", "choice", "int")
BOUNDS_EXAMPLE = {"uniform": "[0.0, 0.2]", "loguniform": "[1.0e-5, 1.0e-3]", "int": "[1, 3]"}
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
# What a key needs of another: (key, the key it needs, what is wrong without it).
PARTNERS = (
    ("random", "samples", "needs samples: how many draws to make, e.g. samples: 8"),
    ("samples", "random", "counts random's draws, and there is no random: add random, or remove samples"),
    ("seed", "random", "is random's seed, and there is no random; training seeds go in seeds: [1, 2, 3]"),
)
HASH_CHARS = 6
NAME_MAX = 64  # SAFE_NAME's limit: a name becomes a folder and a SLURM job name

KeyPath = tuple  # keys and list indices inside the sweep block, e.g. ("zip", 0)
Problems = list[tuple[KeyPath, str]]  # what a check across keys found: where in the block, and what


@dataclass(frozen=True)
class SweepPoint:
    suffix: str  # the name's part after the experiment's: unique within the sweep
    values: dict  # dotted key -> value: grid keys, zip keys, random keys, then train.seed with seeds
    seed: int | None  # this replicate's training seed; None without `seeds:`
    point: str  # the suffix without its seed part: what the replicates of one point share
    legacy: str | None = None  # the suffix this point had before names were stable (None: no such name)


@dataclass(frozen=True)
class Sweep:
    points: tuple[SweepPoint, ...]
    swept: tuple[str, ...]  # the keys grid, zip and random vary (train.seed from seeds is not one)
    select: SweepSelect | None
    prune: PruneSpec | None = None
    parallel: int | None = None


@dataclass(frozen=True)
class Axis:
    """Keys that change together and the rows of values they take: a grid key, a zip group, the draws."""

    keys: tuple[str, ...]
    rows: tuple[tuple, ...]


@dataclass(frozen=True)
class Distribution:
    kind: str
    args: tuple  # (low, high), or the choices


class SweepError(Exception):
    """Every problem found in a sweep block, as pydantic reports one (`loc` inside the block, `type`, `msg`,
    `input`): the loader turns each into a problem at its file and line, as it does any block's."""

    def __init__(self, errors: list[dict]):
        self.errors = list(errors)
        lines = (f"{shown_path(e['loc'])}: {e['msg'].removeprefix('Value error, ')}" for e in self.errors)
        super().__init__("\n".join(lines))


# What one key of the block may hold: each check raises ValueError saying what is wrong, at that key.


def sweepable(key: object) -> str:
    if not isinstance(key, str) or not DOTTED_KEY.fullmatch(key):
        raise ValueError(
            f"{shown(key)} is not a dotted key: names of letters, digits and '_' joined by single dots, "
            "e.g. train.learning_rate"
        )
    section = key.split(".")[0]
    if section in UNSWEPT:
        raise ValueError(f"{key} cannot be swept: {UNSWEPT[section]}")
    if index := next((part for part in key.split(".") if part.isdigit()), None):
        raise ValueError(
            f"{key} goes into a list ({index} is a list item's position): list items cannot be swept; "
            "sweep a key of the experiment (e.g. train.learning_rate), which every stage inherits"
        )
    return key


def plain_values(values: object, example: str = "[8, 16]") -> list:
    if not isinstance(values, list) or not values:
        one = (
            f" (one value is written [{values}], or set in the experiment itself)"
            if isinstance(values, (str, int, float)) and not isinstance(values, bool)
            else ""
        )
        raise ValueError(f"expected a non-empty list of values, e.g. {example}; got {shown(values)}{one}")
    unusable = [f"item {index}: {shown(value)}" for index, value in enumerate(values) if not is_value(value)]
    if unusable:
        raise ValueError(
            "values must be numbers, text, true/false, null or lists of those (sweep a section's keys "
            f"one by one); got {'; '.join(unusable)}"
        )
    return values


def listed_once(rows: list[tuple]) -> None:
    # Two equal rows would train the same run twice under two names.
    seen: set[tuple] = set()
    for row in rows:
        if row_key(row) in seen:
            repeated = shown(row[0] if len(row) == 1 else list(row))
            raise ValueError(f"lists {repeated} more than once: two points would train the same thing")
        seen.add(row_key(row))


def grid_values(values: object) -> list:
    listed_once([(value,) for value in plain_values(values)])
    return values


def changing_together(group: dict) -> dict:
    """A zip group: lists of one length, their rows each listed once."""
    if not group:
        raise ValueError("is empty: give it keys to vary together, or leave it out")
    if len({len(values) for values in group.values()}) > 1:
        lengths = ", ".join(f"{key} has {len(values)}" for key, values in group.items())
        raise ValueError(
            f"the lists of a zip group change together, so they need one length; here {lengths} "
            "(keys that vary independently belong in grid)"
        )
    listed_once(list(zip(*group.values(), strict=True)))
    return group


def distribution(spec: object) -> Distribution:
    if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in DISTRIBUTIONS:
        raise ValueError(
            f"expected one distribution of {', '.join(DISTRIBUTIONS)}, e.g. {{uniform: [0.0, 0.2]}}; "
            f"got {shown(spec)}"
        )
    ((kind, args),) = spec.items()
    if kind == "choice":
        return Distribution(kind, tuple(plain_values(args, example="{choice: [4, 8, 16]}")))
    wrong = bounds_problem(kind, args)
    if wrong:
        raise ValueError(wrong)
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


def distinct_seeds(seeds: object) -> tuple[int, ...]:
    if not isinstance(seeds, list) or not seeds or not all(is_int(seed) for seed in seeds):
        raise ValueError(
            "must be a non-empty list of whole numbers, e.g. seeds: [1, 2, 3] (each point is trained once "
            f"per seed); got {shown(seeds)}"
        )
    repeated = sorted({seed for seed in seeds if seeds.count(seed) > 1})
    if repeated:
        raise ValueError(f"lists {shown(repeated)} more than once: each replicate needs its own seed")
    return tuple(seeds)


SweptKey = Annotated[str, PlainValidator(sweepable)]
ZipGroup = Annotated[
    dict[SweptKey, Annotated[list, PlainValidator(plain_values)]], AfterValidator(changing_together)
]


class SweepSelect(Section):
    """Which score picks the best point in the report, and whether a lower or a higher one is better."""

    metric: str = Field(
        description="The score that picks the best point, judged on the eval split: `eval_loss` (the in-training eval's best loss) or a score that `eval.metrics` compute (e.g. `rouge_l`, `sql_exec_accuracy`, `bertscore`); preference pairs add `preference_accuracy` and `preference_margin`."
    )
    mode: Literal["min", "max"] = Field(
        description="`min` or `max`: whether a lower or a higher `metric` is better."
    )

    @field_validator("metric")
    @classmethod
    def _named(cls, value):
        if not value.strip():
            raise ValueError("is empty: name the score that picks the best point, e.g. eval_loss")
        return value


class SweepSpec(Section):
    """The `sweep:` block as written; the module's docstring says what each key does."""

    grid: dict[SweptKey, Annotated[list, PlainValidator(grid_values)]] = Field(
        default_factory=dict,
        description="Dotted key → non-empty list of values; the points are the product of all lists, first key slowest. Keys are the experiment's (`train.learning_rate`), not `name`, `sweep` or list items; a value is listed once and a key swept in one place only.",
    )
    zip: list[ZipGroup] = Field(
        default_factory=list,
        description="Groups of dotted key → list that change together: a group's lists have one length and give its rows in order; the groups multiply with `grid` and `random`.",
    )
    random: dict[SweptKey, Annotated[Distribution, PlainValidator(distribution)]] = Field(
        default_factory=dict,
        description="Dotted key → one distribution, drawn `samples` times: `uniform: [lo, hi]`, `loguniform: [lo, hi]` (lo > 0), `int: [lo, hi]` (both included) or `choice: [...]`. Drawn floats are rounded to 3 significant digits. Needs `samples`.",
    )
    samples: Annotated[Int, Field(ge=1)] = Field(
        0, description="How many draws `random` makes (≥ 1); required with `random` and refused without it."
    )  # 0: no random, no draws
    seed: Int = Field(
        0,
        description="The seed of `random`'s draws: the same file always gives the same points. Only with `random`; training seeds go in `seeds`.",
    )
    seeds: Annotated[tuple[int, ...], PlainValidator(distinct_seeds)] = Field(
        (),
        description="Training seeds (distinct whole numbers): every point is trained once per seed, into `train.seed`. A sweep makes at most 1000 runs (points × seeds).",
    )
    select: SweepSelect | None = Field(
        None,
        description="`{metric, mode}`: the score by which the report marks the best point, and whether lower or higher wins.",
    )
    prune: PruneSpec | None = Field(
        None,
        description="Stops losing runs early (asynchronous successive halving) on their in-training `eval_loss`. Needs `data.eval`, `train.eval_every_epochs`, one stage, no `train.max_steps` and no GRPO stage.",
    )
    # On SLURM: at most this many of the points' jobs of one array run at once (sbatch --array=...%K);
    # None: as many as the cluster's GPU cap lets this user hold.
    parallel: Annotated[Int, Field(ge=1)] | None = Field(
        None,
        description="On SLURM, at most this many tasks of each of the sweep's job arrays run at once (≥ 1; a second stage's array, or a relaunch's new points, are arrays of their own); unset, as many as the QOS GPU cap lets this user hold, else all.",
    )

    @field_validator("grid", "zip", "random")
    @classmethod
    def _not_empty(cls, value):
        if not value:
            raise ValueError("is empty: give it keys to vary, or leave it out")
        return value

    @model_validator(mode="wrap")
    @classmethod
    def _every_problem_at_once(cls, written: object, handler) -> SweepSpec:
        # Pydantic checks across fields only once every field is valid: here what one key needs of another is
        # known from the keys written, and the checks across values run on the sections that are valid.
        if not isinstance(written, dict):
            return handler(written)
        errors = [value_error(*problem) for problem in unpaired(written)]
        try:
            block = handler(written)
        except ValidationError as exc:
            errors = exc.errors() + errors
            wrong = {error["loc"][0] for error in exc.errors() if error["loc"]}
            block = handler({key: value for key, value in written.items() if key not in wrong})
        errors += [value_error(*problem) for problem in block.overlaps() + block.size_problems()]
        if errors:
            raise in_written_order(cls.__name__, errors, written)
        return block

    def swept_at(self) -> list[tuple[str, KeyPath]]:
        """Each key grid, zip and random vary, and where in the block it is written."""
        return (
            [(key, ("grid", key)) for key in self.grid]
            + [(key, ("zip", index, key)) for index, group in enumerate(self.zip) for key in group]
            + [(key, ("random", key)) for key in self.random]
        )

    def overlaps(self) -> Problems:
        found: Problems = []
        first: dict[str, KeyPath] = {}
        for key, path in self.swept_at():
            if key in first:
                message = (
                    f"{key} is swept already at {shown_path(first[key])}: a key may vary in one place only"
                )
                found.append((path, message))
            first.setdefault(key, path)
            if key == SEED_KEY and self.seeds:
                found.append(
                    (path, f"{SEED_KEY} is what seeds sets (once per replicate): list the seeds in seeds")
                )
            elif self.seeds and SEED_KEY.startswith(key + "."):
                found.append(
                    (
                        path,
                        f"{key} is swept whole, and seeds sets {SEED_KEY} inside it: sweep the keys inside "
                        f"{key} (e.g. {key}.learning_rate) instead",
                    )
                )
        for inner, path in first.items():
            if outer := next((key for key in first if inner.startswith(key + ".")), None):
                found.append(
                    (path, f"{inner} lies inside {outer}, which is swept too: sweep one or the other")
                )
        return found

    def size_problems(self) -> Problems:
        factors = [(len(values), f"grid {key}") for key, values in self.grid.items()]
        factors += [(len(next(iter(group.values()))), f"zip {index}") for index, group in enumerate(self.zip)]
        factors += [(self.samples, "samples")] if self.random else []
        factors += [(len(self.seeds), "seeds")] if self.seeds else []
        total = math.prod(count for count, _ in factors)
        if total <= MAX_POINTS:
            return []
        product = " x ".join(f"{count} ({where})" for count, where in factors)
        return [
            (
                (),
                f"this sweep would make {total} runs = {product}, over the limit of {MAX_POINTS}: narrow it, "
                "or sample it with random and samples",
            )
        ]

    def axes(self) -> list[Axis]:
        """Grid's keys, the zip groups, then random's draws: the points are their product, first slowest."""
        axes = [Axis((key,), tuple((value,) for value in values)) for key, values in self.grid.items()]
        axes += [Axis(tuple(group), tuple(zip(*group.values(), strict=True))) for group in self.zip]
        return axes + ([drawn(self.random, self.samples, self.seed)] if self.random else [])


def unpaired(written: dict) -> Problems:
    """What one key needs of another, known from the keys written alone."""
    found: Problems = [
        ((key,), message) for key, needs, message in PARTNERS if key in written and needs not in written
    ]
    if not any(part in written for part in ("grid", "zip", "random", "seeds")):
        found.append(((), "a sweep needs something to vary: grid, zip, random or seeds"))
    return found


def value_error(loc: KeyPath, message: str) -> dict:
    """A problem found by a check across keys, in the shape pydantic gives a field's."""
    return {"type": "value_error", "loc": loc, "msg": f"Value error, {message}", "ctx": {"error": message}}


def in_written_order(title: str, errors: list[dict], written: object) -> ValidationError:
    """The errors by the block's keys as written, a section's unknown keys first (a typo explains what follows
    it), the whole block's last; a problem with a mapping's key is at that key, not pydantic's `KEY.[key]`."""
    order = list(written) if isinstance(written, dict) else []

    def rank(error: dict) -> tuple[int, bool]:
        loc = error["loc"]
        return (
            order.index(loc[0]) if loc and loc[0] in order else len(order),
            error["type"] != "extra_forbidden",
        )

    details = [
        InitErrorDetails(
            type=e["type"],
            loc=e["loc"][:-1] if e["loc"][-1:] == ("[key]",) else e["loc"],
            input=e.get("input"),
            ctx=e.get("ctx", {}),
        )
        for e in sorted(errors, key=rank)
    ]
    return ValidationError.from_exception_data(title, details)


def expand(block: object, experiment_name: str) -> Sweep:
    """The points of `experiment_name`'s sweep block; SweepError holds every problem in it."""
    named = []
    if not SAFE_NAME.fullmatch(experiment_name):
        named = [value_error((), f"the experiment's name {experiment_name!r} is not a valid name to extend")]
    try:
        spec = SweepSpec.model_validate(block)
    except ValidationError as exc:
        raise SweepError(named + exc.errors(include_url=False)) from None
    if named:
        raise SweepError(named)
    axes = spec.axes()
    points = name_points(list(combinations(axes)), spec.seeds, experiment_name)
    swept = tuple(key for axis in axes for key in axis.keys)
    return Sweep(
        points=tuple(points), swept=swept, select=spec.select, prune=spec.prune, parallel=spec.parallel
    )


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


# Making the points.


def drawn(draws: dict[str, Distribution], samples: int, seed: int) -> Axis:
    rng = random.Random(seed)  # one generator, drawn in written order: the same block gives the same draws
    rows = tuple(tuple(draw(distribution, rng) for distribution in draws.values()) for _ in range(samples))
    return Axis(tuple(draws), rows)


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


def name_points(combos: list[dict], seeds: tuple[int, ...], experiment: str) -> list[SweepPoint]:
    """Each point named from its own values alone, never from its neighbours': adding, removing or
    reordering other values never renames a point (a finished one would be planned again under its new
    name). Its `legacy` suffix is the one it had before (slurm/planning/sweeps.py point_name finds a run
    folder by it)."""
    keys = list(combos[0]) + ([SEED_KEY] if seeds else [])
    label = labels(keys)
    seed_label = label.get(SEED_KEY, "")
    longest_seed = max((f"-{seed_label}{seed}" for seed in seeds), key=len, default="")
    texts = [own_text(values, label, experiment, longest_seed) for values in combos]
    points = replicated(combos, texts, seeds, seed_label, legacy_texts(combos, seeds, experiment))
    names: dict[str, int] = {}
    for index, point in enumerate(points):
        other = names.setdefault(f"{experiment}-{point.suffix}".casefold(), index)
        if other != index:
            first = points[other]
            message = (
                f"points {experiment}-{first.suffix} ({first.values}) and {experiment}-{point.suffix} "
                f"({point.values}) "
                + (
                    "are the same values: list each value once, or draw fewer samples"
                    if first.values == point.values
                    else "get names that differ only in case, which one folder holds on some disks: write the values apart"
                )
            )
            raise SweepError([value_error((), message)])
    if not all(SAFE_NAME.fullmatch(f"{experiment}-{point.suffix}") for point in points):
        longest = max((point.suffix for point in points), key=len)
        room = NAME_MAX - 1 - len(longest)
        message = (
            f"the experiment's name {experiment!r} ({len(experiment)} characters) leaves no room for its "
            f"points' names: with the shortest suffixes, such as {longest!r}, names pass {NAME_MAX} "
            f"characters; shorten the experiment's name to {room} or fewer"
        )
        raise SweepError([value_error((), message)])
    return points


def own_text(values: dict, label: dict[str, str], experiment: str, longest_seed: str) -> str:
    """The first of `lr1e-04-r8`, `1e-04-8` and `h{hash of the values}` whose name fits, for this point
    alone (with its longest seed part)."""
    styles = (
        "-".join(label[key] + value_text(value) for key, value in values.items()),
        "-".join(value_text(value) for value in values.values()),
        f"h{values_hash(values)}",
    )
    return next((t for t in styles if SAFE_NAME.fullmatch(f"{experiment}-{t}{longest_seed}")), styles[-1])


def replicated(
    combos: list[dict], texts: list[str], seeds: tuple[int, ...], seed_label: str, legacy: list[str] | None
) -> list[SweepPoint]:
    legacy = legacy or [None] * len(combos)
    if not seeds:
        return [
            SweepPoint(suffix=text, values=dict(values), seed=None, point=text, legacy=old)
            for values, text, old in zip(combos, texts, legacy, strict=True)
        ]
    return [
        SweepPoint(
            suffix="-".join(part for part in (text, f"{seed_label}{seed}") if part),
            values={**values, SEED_KEY: seed},
            seed=seed,
            point=text,
            legacy=old and "-".join(part for part in (old, f"{seed_label}{seed}") if part),
        )
        for values, text, old in zip(combos, texts, legacy, strict=True)
        for seed in seeds
    ]


# Names as they were before they were stable, read to find the run folders of sweeps launched then: the
# style was chosen for all points at once (one long value dropped every point's labels), a repeated text
# got _2, _3 in order of appearance, and the last style numbered the points.


def legacy_texts(combos: list[dict], seeds: tuple[int, ...], experiment: str) -> list[str] | None:
    keys = list(combos[0]) + ([SEED_KEY] if seeds else [])
    label = labels(keys)
    seed_label = label.get(SEED_KEY, "")
    styles: list[Callable[[int, dict], str]] = [
        lambda _, values: "-".join(label[key] + slug(value) for key, value in values.items()),
        lambda _, values: "-".join(slug(value) for value in values.values()),
        lambda index, values: f"p{index + 1}-{values_hash(values)}",
    ]
    for style in styles:
        texts = made_unique([style(index, values) for index, values in enumerate(combos)])
        suffixes = [f"{t}-{seed_label}{s}" for t in texts for s in seeds] if seeds else texts
        names = [f"{experiment}-{suffix}" for suffix in suffixes]
        if len({n.casefold() for n in names}) == len(names) and all(SAFE_NAME.fullmatch(n) for n in names):
            return texts
    return None


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
    """A value in a name, telling every value from every other: as `slug`, and where `slug` loses
    something (a hub id's organisation, characters a name cannot hold, list items that hold '_'), the
    first characters of the value's own hash after it: org1/m -> m_1a2b, org2/m -> m_9f8e."""
    text = slug(value)
    if isinstance(value, list):
        whole = all("_" not in slug(item) and slug(item) == value_text(item) for item in value)
    else:
        whole = not isinstance(value, str) or text == value
    return text if whole else f"{text}_{hashlib.sha1(repr(value).encode()).hexdigest()[:4]}"


def slug(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return float_text(value)
    if value is None:
        return "none"
    if isinstance(value, list):
        return "_".join(slug(item) for item in value) or "empty"
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
    prune: PruneSpec | None = None  # the sweep's `prune:` block: its runs may stop at a rung
    size: int = 1  # the sweep's runs (points x seeds): a pruned sweep's expected cost depends on it
    parallel: int | None = None  # `parallel:`: how many of its array's tasks may run at once


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
