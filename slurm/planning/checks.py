"""What a valid experiment is checked for beyond its schema, before anything is queued (checked): its local
files (data, eval database, model folders), its resources against a node of the cluster, `time: auto`, the
model's kind and chat template, a DPO or GRPO stage's chain; and across the folder's experiments, their names and
`after:` targets (check_names). A sweep's own checks are slurm/planning/sweeps.py's.
"""

from __future__ import annotations

import functools
import json
import math
import os
from pathlib import Path

from core import chat_templates
from core.config import DataSpec, Experiment, kind_mismatch
from core.conversations import no_template_message, templated
from core.databases import NotADatabaseError, check_database
from core.examples import ExampleError, TextSize, check_file, needed_fields
from core.files import read_json
from core.names import PREFERENCE, SQL_REWARD_SCORES
from core.problems import Problem, did_you_mean
from core.split import elastic_accumulation
from core.sweep import SweepMember
from core.yamlfile import YamlFile, where
from slurm.cluster.profile import ClusterProfile
from slurm.planning.sweeps import check_prune, check_select
from slurm.planning.validation import LoadedExperiment, Stage, resolve_stages


def checked(
    experiment: Experiment,
    raw: dict,
    chain: list[YamlFile],
    member: SweepMember | None,
    profile: ClusterProfile,
) -> tuple[list[Stage], list[Problem]]:
    """A valid experiment's stages, and what the checks beyond its schema find."""
    stages, found = resolve_stages(experiment, raw, chain)
    return stages, found + (
        check_files(experiment, stages, chain)
        + check_resources(experiment, profile, chain)
        + check_elastic(experiment, stages, chain)
        + check_auto_time(experiment, stages, chain)
        + check_select(experiment, stages, member, chain)
        + check_prune(experiment, stages, member, chain)
        + check_kind(experiment, chain)
        + check_chat_template(experiment, stages, chain)
        + check_preference(experiment, stages, chain)
        + pairs_rendered_unlike_the_stage_before(experiment, stages)
        + check_grpo(experiment, stages, chain)
    )


def check_kind(experiment: Experiment, chain: list[YamlFile]) -> list[Problem]:
    """model.kind against a local model folder's config.json (a hub model's: at preflight, which has it)."""
    config_json = Path(experiment.model.name_or_path) / "config.json"
    if not config_json.is_file():
        return []
    model_config = read_json(config_json, {}, expected=dict)
    why = kind_mismatch(experiment.model.kind, model_config)
    if why is None:
        return []
    file, line = where(chain, ("model", "kind"))
    return [Problem(file, "model.kind", why, line)]


def check_chat_template(experiment: Experiment, stages: list[Stage], chain: list[YamlFile]) -> list[Problem]:
    """Conversations need a chat template: the model folder's own, or data.chat_template (a hub model's is
    known on the node, where a missing one is refused the same way)."""
    name = experiment.model.name_or_path
    lacking = [
        stage
        for stage in stages
        if templated(stage.data, experiment.model.kind) and stage.data.chat_template is None
    ]
    folder = model_folder(experiment) if lacking else None
    own = chat_templates.folder_template(folder) if folder is not None else None
    if own == "":
        file, line = where(chain, ("data", "format"))
        return [Problem(file, "data.format", no_template_message(name, lacking[0].data.format), line)]
    if own and chat_templates.is_jinja(own):
        try:  # the rules an inline template keeps, for the model's own too
            chat_templates.check(own)
        except ValueError as exc:
            file, line = where(chain, ("data", "format"))
            message = (
                f"is rendered with {name}'s own chat template, which cannot be trained on: {exc}; or set "
                "data.chat_template (chatml, llama-3, or inline Jinja) to one that can"
            )
            return [Problem(file, "data.format", message, line)]
    return conversation_pairs_without_template(experiment, stages) + unknown_markers(
        experiment, stages, chain
    )


def model_folder(experiment: Experiment) -> Path | None:
    """Where this machine can read the model's own files: its local folder, or a hub model's snapshot in the
    Hugging Face cache once the whole model is there (weights and tokenizer: what preflight fetches, chat
    template files included), so a hub model without a template is refused by the dry run too, not first
    by preflight (what issue 41 left). None: not here (the node, or preflight, judges)."""
    name, revision = experiment.model.name_or_path, experiment.model.revision
    if _looks_local(name):
        return Path(name)
    from train import hub_cache  # torch-free; huggingface_hub only for a hub model

    if not hub_cache.has_model(name, revision):
        return None
    found = hub_cache.model_file(name, "config.json", revision)
    return Path(found).parent if found else None


def conversation_pairs_without_template(experiment: Experiment, stages: list[Stage]) -> list[Problem]:
    """Preference pairs whose prompt is a conversation are rendered with the model's chat template when
    data.chat_template names none: a local model folder without one is refused here, at the first such pair
    (it was refused only on the node, after the queue). A hub model's template is known to preflight."""
    name = experiment.model.name_or_path
    problems = []
    for stage in stages:
        if stage.data.format != PREFERENCE or stage.data.chat_template is not None:
            continue
        for source in (stage.data.train, stage.data.eval):
            if not source or source.startswith("hf:") or not Path(source).is_file():
                continue
            size = read_examples(Path(source), stage.data)
            line = size.conversation_line if isinstance(size, TextSize) else None
            if line is not None and chat_templates.folder_has_template(Path(name)) is False:
                message = (
                    f"this pair's prompt is a conversation, rendered with the model's chat template, and {name} "
                    "has none (a base model): set data.chat_template (chatml, llama-3, or inline Jinja; its "
                    "markers need model.added_tokens if the vocabulary lacks them), or write the prompts as text"
                )
                problems.append(Problem(f"{source}:{line}", "prompt", message))
                break
    return problems


def unknown_markers(experiment: Experiment, stages: list[Stage], chain: list[YamlFile]) -> list[Problem]:
    """A data.chat_template's markers that a local model folder's vocabulary lacks and model.added_tokens
    does not add (a hub model's vocabulary is known to preflight, which refuses the same)."""
    vocabulary = chat_templates.folder_vocabulary(Path(experiment.model.name_or_path))
    if vocabulary is None:
        return []
    for stage in stages:
        if stage.data.chat_template is None or not templated(stage.data, experiment.model.kind):
            continue
        missing, split = chat_templates.missing_markers(
            stage.data.chat_template, vocabulary, experiment.model.added_tokens, None
        )
        file, line = where(chain, ("data", "chat_template"))
        if missing:
            message = (
                f"its markers {missing} are not tokens of {experiment.model.name_or_path}'s vocabulary: add "
                f"them with model.added_tokens: {missing} (else each is learnt as several pieces and "
                "generation has no end-of-turn token to stop at)"
            )
            return [Problem(file, "data.chat_template", message, line)]
        if split:
            message = (
                f"its markers {split} are not tokens of {experiment.model.name_or_path}'s vocabulary: each is "
                f"written as text, several pieces (right for a template made so; else add them with "
                f"model.added_tokens: {split})"
            )
            return [Problem(file, "data.chat_template", message, line, warning=True)]
    return []


def check_preference(experiment: Experiment, stages: list[Stage], chain: list[YamlFile]) -> list[Problem]:
    """A DPO stage's chain, before anything is queued: preference pairs for it and only for it, a model
    kind TRL's DPOTrainer trains here, and a `reference: previous` that has a previous stage."""
    problems = []
    for index, stage in enumerate(stages):
        dpo, pairs = stage.train.method == "dpo", stage.data.format == PREFERENCE
        why = None
        if dpo and not pairs:
            key = ("train", "method")
            why = (
                f"is dpo in stage {stage.name!r}, whose data is format: {stage.data.format}; DPO trains on "
                "preference pairs: set data.format: preference ({prompt, chosen, rejected} per line)"
            )
        elif pairs and not dpo:
            key = ("data", "format")
            why = (
                f"is preference in stage {stage.name!r}, an SFT stage (train.method: sft): pairs train only a "
                "DPO stage: set train.method: dpo in that stage, or give it SFT data"
            )
        elif dpo and experiment.model.kind != "causal":
            key = ("train", "method")
            why = (
                f"is dpo, but model.kind is {experiment.model.kind}: TRL's DPOTrainer trains causal models only "
                "here (it has no seq2seq path; image-text pairs are not supported yet): use a causal model"
            )
        elif dpo and index == 0 and stage.train.preference.reference == "previous":
            key = ("train", "dpo", "reference")
            why = (
                f"is previous, but stage {stage.name!r} is the first: there is no previous adapter to "
                "compare against; use reference: base (the default for a first stage), or put an SFT stage "
                "before it"
            )
        if why:
            written = getattr(experiment.stages[index], key[0])
            place = ("stages", index, *key) if key[1] in written else key
            file, line = where(chain, place)
            problems.append(Problem(file, ".".join(map(str, place)), why, line))
    return problems


RAW = "raw prompts (as `fields` are rendered)"


def rendering(data: DataSpec, kind: str, text_prompt: bool = False) -> str:
    """How a stage's prompts reach the model: raw, or through which chat template. A preference pair's
    text prompt is raw unless data.chat_template names one; its turns go through the template (the
    model's own when none is named), as conversations do (core/conversations.py templated)."""
    if not (templated(data, kind) or (data.format == PREFERENCE and not text_prompt)):
        return RAW
    return f"chat template {data.chat_template!r}" if data.chat_template else "the model's own chat template"


def pairs_rendered_unlike_the_stage_before(experiment: Experiment, stages: list[Stage]) -> list[Problem]:
    """A warning where a DPO stage's pairs reach the model otherwise than the stage that taught it its
    format (the last one before it of other data) did: text prompts rendered raw after chats through a
    template, turns through a template after raw prompts, or another template than that stage's. Each
    tunes the preference on prompts the model was not trained to read (before: silently, seen only in the
    scores). `hf:` pairs are not read on the login node, so not checked."""
    kind, problems = experiment.model.kind, []
    for index, stage in enumerate(stages):
        if stage.data.format != PREFERENCE or not Path(stage.data.train).is_file():
            continue
        taught = next((s for s in reversed(stages[:index]) if s.data.format != PREFERENCE), None)
        size = read_examples(Path(stage.data.train), stage.data)
        if taught is None or not isinstance(size, TextSize):
            continue
        learned = rendering(taught.data, kind)
        for line, text_prompt in ((size.text_line, True), (size.conversation_line, False)):
            renders = rendering(stage.data, kind, text_prompt)
            if line is None or renders == learned:
                continue
            if learned == RAW:
                fix = "write the prompts as text, as that stage's were, and leave data.chat_template unset"
            elif taught.data.chat_template:
                fix = (
                    f"set data.chat_template: {taught.data.chat_template} in this stage, as that stage has it"
                )
            else:
                fix = "write the prompts as turns ([{role: user, content: ...}]) and leave data.chat_template unset"
            message = (
                f"stage {stage.name!r}: this pair's prompt reaches the model as {renders}, but stage "
                f"{taught.name!r} trained it on {learned}: DPO would tune the model on prompts it was not "
                f"trained to read; {fix}"
            )
            problems.append(Problem(f"{stage.data.train}:{line}", "prompt", message, warning=True))
            break
    return problems


def check_grpo(experiment: Experiment, stages: list[Stage], chain: list[YamlFile]) -> list[Problem]:
    """A GRPO stage's chain, before anything is queued: what its place in the chain refuses or warns of
    (grpo_stage_problem), a database for each SQL reward, and then its rewards run on its training data."""
    problems = []
    for index, stage in enumerate(stages):
        if stage.train.method != "grpo":
            continue
        grpo = stage.train.reward_objective
        found = grpo_stage_problem(experiment, index, stage)
        if found:
            key, why, warning = found
            problems.append(stage_problem(experiment, index, key, why, chain, warning))
        refused = bool(found) and not found[2]
        for number, reward in enumerate(grpo.rewards):
            if (
                reward.score in SQL_REWARD_SCORES and not reward.db
            ):  # the plan wrote eval.db where there is one
                place = ("train", "grpo", "rewards", number, "score")
                why = f"{reward.score} runs each completion on a database: set db in this entry, or eval.db"
                problems.append(stage_problem(experiment, index, place, why, chain))
                refused = True
        if refused or not grpo.rewards or not Path(stage.data.train).is_file():
            continue  # the rewards are run on the data once the stage could run at all
        for number, what in checked_rewards(stage, str(chain[0].path.parent)):
            place = ("train", "grpo", "rewards")
            if number >= 0:
                place += (number, "score" if grpo.rewards[number].score else "function")
            problems.append(
                stage_problem(experiment, index, place, f"in stage {stage.name!r}: {what}", chain)
            )
    return problems


def grpo_stage_problem(experiment: Experiment, index: int, stage: Stage) -> tuple[tuple, str, bool] | None:
    """(key, why, warning) for the first thing a GRPO stage's place refuses: no rewards, preference pairs
    for data (its prompts are generated from and its targets are the rewards' references), a model that is
    not causal, in-training early stopping (a GRPO step has no eval loss), a `reference: previous` without
    a previous stage; or warns of: a first stage (a model that never earns a reward learns nothing) unless
    `from_base`. None when nothing does."""
    grpo = stage.train.reward_objective
    if not grpo.rewards:
        return (
            ("train", "method"),
            f"is grpo in stage {stage.name!r}, which has no rewards to learn from: add train.grpo: {{rewards: "
            "[{score: sql_exec_accuracy}, {score: sql_executes, weight: 0.1}]}} (eval scores, or "
            "{function: module:name})",
            False,
        )
    if stage.data.format == PREFERENCE:
        return (
            ("train", "method"),
            f"is grpo in stage {stage.name!r}, whose data is format: preference; GRPO generates from the "
            "prompts of SFT data (fields or a conversation) and rewards against their targets",
            False,
        )
    if experiment.model.kind != "causal":
        return (
            ("train", "method"),
            f"is grpo, but model.kind is {experiment.model.kind}: TRL's GRPOTrainer trains causal models "
            "only here (no seq2seq path; image-text is not supported yet): use a causal model",
            False,
        )
    if stage.train.early_stopping:
        why = f"is for SFT and DPO stages: GRPO stage {stage.name!r} has no in-training eval loss to stop on"
        return ("train", "early_stopping"), why, False
    if index == 0 and grpo.reference == "previous":
        return (
            ("train", "grpo", "reference"),
            f"is previous, but stage {stage.name!r} is the first: there is no previous adapter; use "
            "reference: base, or put an SFT stage before it",
            False,
        )
    if index == 0 and not grpo.from_base:
        return (
            ("train", "method"),
            f"is grpo in the first stage {stage.name!r}: a base model that never earns a reward has no "
            "reward variance and learns nothing (the stage stops early then); put an SFT stage before "
            "it, or set train.grpo.from_base: true if the base model already earns rewards",
            True,
        )
    return None


def checked_rewards(stage: Stage, functions_from: str) -> list[tuple[int, str]]:
    """eval/reward_check.py's problems with a GRPO stage's rewards on its training data, once per command for
    the same rewards, data and database contents (a sweep's points share them: weights do not count)."""
    rewards = [reward.model_dump(exclude={"weight"}) for reward in stage.train.reward_objective.rewards]
    files = [stage.data.train, *(r["db"] for r in rewards if r.get("db"))]
    stamp = [(f, os.stat(f).st_mtime_ns, os.stat(f).st_size) for f in files if os.path.isfile(f)]
    request = {
        "train": stage.data.train,
        "data": stage.data.model_dump(),
        "rewards": rewards,
        "functions_from": functions_from,
    }
    return reward_check_cached(json.dumps({"request": request, "stamp": stamp}, sort_keys=True))


@functools.cache
def reward_check_cached(key: str) -> list[tuple[int, str]]:
    from eval.reward_check import reward_problems  # a child process: nothing of it is imported here

    return reward_problems(json.loads(key)["request"])


def stage_problem(
    experiment: Experiment, index: int, key: tuple, why: str, chain: list[YamlFile], warning: bool = False
) -> Problem:
    """A problem at the stage's own key when the stage writes it, else at the experiment's."""
    written = getattr(experiment.stages[index], key[0])
    place = ("stages", index, *key) if key[1] in written else key
    file, line = where(chain, place)
    return Problem(file, ".".join(map(str, place)), why, line, warning=warning)


def check_files(experiment: Experiment, stages: list[Stage], chain: list[YamlFile]) -> list[Problem]:
    """Local data files, eval databases and model folders must exist; hub names are checked on the node."""
    wanted: list[tuple[tuple, str, DataSpec | None]] = []
    for index, stage in enumerate(stages):
        for key in ("train", "eval"):
            written_in_stage = key in experiment.stages[index].data
            place = ("stages", index, "data", key) if written_in_stage else ("data", key)
            wanted.append((place, getattr(stage.data, key), stage.data))
    wanted.append((("eval", "db"), experiment.eval.db, None))
    problems, seen = [], set()
    for key, value, spec in wanted:
        if value and not value.startswith("hf:") and value not in seen:
            seen.add(value)
            file, line = where(chain, key)
            if not Path(value).is_file():
                why = (
                    "not a regular file (a FIFO, a socket, a device or a folder)"
                    if Path(value).exists()
                    else "file not found"
                )
                problems.append(Problem(file, ".".join(map(str, key)), f"{why}: {value}", line))
            elif spec is not None:
                problems += check_examples(Path(value), spec, ".".join(map(str, key)))
            elif key == ("eval", "db"):
                problems += unusable_db(value, file, line)
    problems += missing_model_folder(("model", "name_or_path"), experiment.model.name_or_path, chain)
    if "bertscore" in experiment.eval.metrics:
        problems += missing_model_folder(("eval", "bertscore_model"), experiment.eval.bertscore_model, chain)
    return problems


def unusable_db(path: str, file: str, line: int | None) -> list[Problem]:
    """eval.db must be SQLite with tables: on an empty file every gold query fails and nothing is scored."""
    try:
        check_database(path)
    except (NotADatabaseError, OSError) as exc:
        return [Problem(file, "eval.db", str(exc), line)]
    return []


def missing_model_folder(key: tuple, name: str, chain: list[YamlFile]) -> list[Problem]:
    """A name that looks like a local path must be a folder; hub ids are checked on the node."""
    if not _looks_local(name) or Path(name).is_dir():
        return []
    file, line = where(chain, key)
    hint = " (the demo's tiny models are built by `python -m demo.tiny models`)" if "tiny" in name else ""
    return [Problem(file, ".".join(key), f"local model folder not found: {name}{hint}", line)]


_read: dict[tuple, TextSize | ExampleError | OSError | UnicodeDecodeError] = {}


def read_examples(path: Path, spec: DataSpec) -> TextSize | ExampleError | OSError | UnicodeDecodeError:
    """A data file's size, or its first problem. Each file is read once per command, however many
    experiments share it and whether validation or the estimates ask first."""
    try:
        stat = path.stat()
        fields = (spec.format, spec.prompt_template, *needed_fields(spec))  # the template's text counts too
        version = (str(path.resolve()), stat.st_mtime_ns, stat.st_size, fields)
        if version not in _read:
            _read[version] = _read_once(path, spec)
        return _read[version]
    except OSError as exc:
        return exc


def check_examples(path: Path, spec: DataSpec, key: str) -> list[Problem]:
    """Malformed lines, missing fields and empty files are found now, not hours later on a node."""
    found = read_examples(path, spec)
    if isinstance(found, ExampleError):
        return [Problem(e.path, "", f"{e.message} (used as {key})", e.line) for e in found.errors]
    if not isinstance(found, TextSize):
        return [Problem(str(path), "", f"cannot be read ({found})")]
    return []


def _read_once(path: Path, spec: DataSpec) -> TextSize | ExampleError | OSError | UnicodeDecodeError:
    try:
        return check_file(path, spec)
    except (ExampleError, OSError, UnicodeDecodeError) as exc:
        return exc


def _looks_local(name: str) -> bool:
    return name.startswith(("/", "./", "../", "~")) or name.count("/") > 1 or Path(name).is_dir()


def check_resources(experiment: Experiment, profile: ClusterProfile, chain: list[YamlFile]) -> list[Problem]:
    # The eval job's own values only: what it leaves out is the training job's, checked once.
    return (
        over_node_limits(("resources",), experiment.resources, profile, chain)
        + over_node_limits(("eval", "resources"), experiment.eval.resources, profile, chain)
        + beyond_one_node(("resources",), experiment.resources, profile, chain)
        + beyond_one_node(("eval", "resources"), experiment.eval.resources, profile, chain)
        + eval_on_one_gpu(experiment, chain)
    )


def check_elastic(experiment: Experiment, stages: list[Stage], chain: list[YamlFile]) -> list[Problem]:
    """`nodes: min-max`: the global batch is the one at max nodes, kept at every size the job may get, so
    each rank's accumulation steps at every node count of the range must be whole (core/split.py
    elastic_accumulation); else the experiment is refused, naming the sizes that do not divide."""
    res = experiment.resources
    if not res.elastic:
        return []
    problems = []
    for stage in stages:
        accum = stage.train.grad_accum
        uneven = [
            n for n in range(res.min_nodes, res.nodes) if elastic_accumulation(accum, res.nodes, n) is None
        ]
        if not uneven:
            continue
        # grad_accum x max / n is whole for every n of the range exactly when grad_accum is a multiple of this
        fits = math.lcm(*(n // math.gcd(n, res.nodes) for n in range(res.min_nodes, res.nodes + 1)))
        file, line = where(chain, ("resources", "nodes"))
        sizes = " or ".join(f"{n}" for n in uneven)
        message = (
            f"nodes {res.node_count} keeps the global batch of {res.nodes} nodes (grad_accum {accum} there"
            f"{'' if len(stages) == 1 else f', stage {stage.name}'}), but on {sizes} node(s) each rank would "
            f"accumulate {accum} x {res.nodes} / {uneven[0]} = {accum * res.nodes / uneven[0]:g} steps; "
            f"make train.grad_accum a multiple of {fits} (every size then divides), or narrow the range"
        )
        problems.append(Problem(file, "resources.nodes", message, line))
    return problems


def check_auto_time(experiment: Experiment, stages: list[Stage], chain: list[YamlFile]) -> list[Problem]:
    """`time: auto` is the job's estimate plus a margin, and an estimate counts a local data file: an
    `hf:` dataset is only fetched on the node."""
    sources = {
        ("resources", "time"): [s.data.train for s in stages],
        ("eval", "resources", "time"): [
            s.data.eval if experiment.eval.split == "eval" else s.data.train for s in stages
        ],
    }
    problems = []
    for key, used in sources.items():
        section = experiment.resources if key[0] == "resources" else experiment.eval.resources
        remote = sorted({source for source in used if source and source.startswith("hf:")})
        if section.time == "auto" and remote:
            file, line = where(chain, key)
            message = (
                f"auto needs a local data file to estimate from, but {remote[0]} is fetched on the node; "
                "write a time (HH:MM:SS)"
            )
            problems.append(Problem(file, ".".join(key), message, line))
    return problems


def beyond_one_node(section: tuple, res, profile: ClusterProfile, chain: list[YamlFile]) -> list[Problem]:
    """A training job may span nodes (one task per GPU on each, one DDP run), up to cluster.yaml's
    max_nodes when it says; an eval job is one process on one GPU, so several nodes would sit idle."""
    if res.nodes <= 1:
        return []
    file, line = where(chain, (*section, "nodes"))
    if section != ("resources",):
        message = (
            f"asks for {res.nodes} nodes but an eval job runs one process on one GPU of one node; "
            "leave eval.resources.nodes out"
        )
    elif profile.max_nodes is not None and res.nodes > profile.max_nodes:
        message = (
            f"asks for {res.nodes} nodes but this cluster has {profile.max_nodes} (configs/cluster.yaml "
            f"max_nodes); ask {profile.max_nodes} or fewer, or more GPUs per node (resources.gpus, up to "
            f"{profile.max_gpus_per_node})"
        )
    else:
        return []
    return [Problem(file, ".".join((*section, "nodes")), message, line)]


def eval_on_one_gpu(experiment: Experiment, chain: list[YamlFile]) -> list[Problem]:
    """Generation and scoring run as one process: more GPUs would sit idle in the queue and on the node."""
    gpus = experiment.eval.resources.gpus
    if gpus is None or gpus <= 1:
        return []
    file, line = where(chain, ("eval", "resources", "gpus"))
    message = f"asks for {gpus} GPUs but an eval job runs one process on one GPU; use 0 or 1"
    return [Problem(file, "eval.resources.gpus", message, line)]


def over_node_limits(section: tuple, res, profile: ClusterProfile, chain: list[YamlFile]) -> list[Problem]:
    problems = []
    limits = [
        ("gpus", res.gpus, profile.max_gpus_per_node, "GPUs"),
        ("cpus", res.cpus, profile.max_cpus_per_node, "CPUs"),
        ("mem_gb", res.mem_gb, profile.max_mem_gb_per_node, "GB of memory"),
    ]
    for key, asked, limit, unit in limits:
        if asked is not None and asked > limit:
            file, line = where(chain, (*section, key))
            message = (
                f"asks for {asked:g} {unit} but a node of this cluster has {limit:g} (configs/cluster.yaml)"
            )
            problems.append(Problem(file, ".".join((*section, key)), message, line))
    return problems


def check_names(
    loaded: list[LoadedExperiment], selected: list[str] | None, written: set[str] = frozenset()
) -> list[Problem]:
    """Duplicate names, unknown `after:` targets, cycles, unknown --exp names (`written`: every name a
    file gives; one that did not load has its own problem, and is no unknown name)."""
    problems: list[Problem] = []
    by_name: dict[str, LoadedExperiment] = {}
    for item in loaded:
        if item.name in by_name:
            other = by_name[item.name].file
            problems.append(Problem(str(item.file), "name", f"'{item.name}' is also the name in {other}"))
        by_name[item.name] = item
    sweeps: dict[str, Path] = {}
    for item in loaded:
        if item.sweep is not None and sweeps.setdefault(item.sweep.sweep, item.file) != item.file:
            first = sweeps[item.sweep.sweep]
            message = (
                f"the sweep '{item.sweep.sweep}' is also defined in {first}: its points, --exp "
                f"{item.sweep.sweep} and the report's table would mix both; rename one"
            )
            problems.append(Problem(str(item.file), "name", message))
    for name in sweeps.keys() & by_name.keys():  # --exp and after: would mean both
        message = f"'{name}' is also a sweep's name (in {sweeps[name]}): --exp {name} would mean both"
        problems.append(Problem(str(by_name[name].file), "name", message))
    for item in loaded:
        for target in item.experiment.after:
            if target not in by_name:
                message = f"unknown experiment '{target}'" + did_you_mean(target, by_name)
                problems.append(Problem(str(item.file), "after", message))
    cycle = find_cycle({n: [t for t in e.experiment.after if t in by_name] for n, e in by_name.items()})
    if cycle:
        problems.append(
            Problem(
                str(by_name[cycle[0]].file), "after", "experiments wait on each other: " + " -> ".join(cycle)
            )
        )
    for name in selected or []:
        if name not in by_name and name not in written:
            problems.append(
                Problem(
                    "command line", "--exp", f"no experiment named '{name}'" + did_you_mean(name, by_name)
                )
            )
    return problems


def find_cycle(graph: dict[str, list[str]]) -> list[str] | None:
    """A dependency loop as a path that returns to its start, or None."""
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in graph.get(node, []):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt, [*path, nxt])):
                return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start, [start])):
            return found
    return None
