"""Preflight on the login node: look up each training job's preflight in the cache, compute the missing
ones (train/preflight.py, which imports torch), and turn what a job would refuse or could not fit into
problems that refuse the launch.

The cache key is everything a result depends on (the model's config.json text, the tokenizer files, the data
files, the adapter and the train keys memory depends on), read without torch: a relaunch, or 200 experiments
that differ only in learning rate or name, cost one preflight and no torch import after the first.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import sys
from contextlib import contextmanager
from dataclasses import fields, replace
from functools import lru_cache
from pathlib import Path

from pydantic import TypeAdapter, ValidationError

from core import hashing
from core.config import TrainJob, kind_mismatch
from core.files import read_json, stderr_into, warn_unreadable, write_json_atomic
from core.hashing import CACHE_KEY_CHARS, content_hash
from core.layout import cache_root
from core.names import TOKENIZER_FILES
from core.preflight import JobPreflight
from core.problems import Problem
from train import hub_cache
from train.hub_cache import (
    fetch_command,
    first_line,
    hub_unreachable,
    missing_for,
    model_file,
)

CACHE_VERSION = 8  # bump whenever what a preflight computes changes


# ---- the cache ----------------------------------------------------------------------------------------
@lru_cache(maxsize=256)
def file_fingerprint(source: str) -> str:
    return source if source.startswith("hf:") else hashing.file_fingerprint(source)


def tokenizer_identity(spec) -> str:
    """Contents of the tokenizer files this machine has (none yet: an empty identity)."""
    found = [model_file(spec.name_or_path, name, spec.revision) for name in TOKENIZER_FILES]
    return "".join(Path(p).name + file_fingerprint(p) for p in found if p)


@lru_cache(maxsize=64)
def config_text(name_or_path: str, revision: str | None) -> str:
    """config.json, read without transformers; fetched into the Hugging Face cache where this machine has
    network (HF_HUB_OFFLINE unset). Raises OSError when it cannot be had."""
    path = model_file(name_or_path, "config.json", revision)
    if path is None and not Path(name_or_path).is_dir():
        from huggingface_hub import hf_hub_download

        if unreachable := hub_unreachable():  # one quick try, not five with backoff
            raise OSError(f"{name_or_path}: {unreachable}")
        path = hf_hub_download(name_or_path, "config.json", revision=revision)
    if path is None:
        raise FileNotFoundError(f"no config.json in {name_or_path}")
    return Path(path).read_text()


def cache_key(job: TrainJob, gpu_mem_gb: float | None) -> str:
    """Model config, tokenizer, data files, adapter, and the few train keys memory depends on; not the
    learning rate, the epochs or the experiment's name."""
    parts = [
        CACHE_VERSION,
        config_text(job.model.name_or_path, job.model.revision),
        tokenizer_identity(job.model),
        job.model.added_tokens,
        file_fingerprint(job.data.train),
        job.data.model_dump(exclude={"eval", "order", "num_workers"}),
        job.adapter.model_dump(),
        job.train.model_dump(
            include={
                "batch_size",
                "grad_accum",
                "micro_batch",
                "gradient_checkpointing",
                "precision",
                "eval_every_epochs",
                "method",
                "grpo",  # its max_completion_length is checked against the references
            }
        ),
        # an in-training eval has its own peak, at the eval set's own lengths
        file_fingerprint(job.data.eval) if job.data.eval is not None else None,
        gpu_mem_gb,
    ]
    return content_hash(parts, CACHE_KEY_CHARS)


def cached_preflight(job: TrainJob, gpu_mem_gb: float | None, log: Path | None = None) -> JobPreflight:
    """From the disk cache when nothing it depends on changed; the job name is this job's. A result whose
    token lengths were skipped for want of tokenizer files is kept (their arrival changes the key); one
    skipped for an `hf:` dataset is not (its arrival does not), so the next launch has the lengths."""
    path = cache_root() / "preflight" / f"{cache_key(job, gpu_mem_gb)}.json"
    name = f"{job.experiment}/{job.stage}"
    kept = read_json(path, expected=dict)  # None when missing or unreadable (named in a warning)
    if kept is not None and kept.keys() == JOB_PREFLIGHT_FIELDS and (found := cached_result(kept, path)):
        return replace(found, job=name)
    with library_output_into(log):
        from train.preflight import preflight_job  # torch: only on a miss

        result = preflight_job(job, gpu_mem_gb)
    if result.tokens_skipped is None or not tokenizer_identity(job.model):
        keep(path, result)
    return result


def keep(path: Path, result: JobPreflight) -> None:
    """The result in the preflight cache, reached from the cache root without following a link planted
    below it (core/below.py); launches in parallel may write it, each write whole."""
    try:
        write_json_atomic(path, result.as_json(), root=cache_root())
    except OSError as exc:  # a cache: the next launch computes it again
        why = f"cannot be written ({exc.strerror}{': ' + exc.filename if exc.filename else ''})"
        warn_unreadable(path, why, "the next launch computes it again")


def cached_result(kept: dict, path: Path) -> JobPreflight | None:
    """The cached result if it is one (a hand edit or another version's file is not: a count of zero
    parameters, a string where a number belongs), else None, the file named in a warning."""
    try:
        found = TypeAdapter(JobPreflight).validate_python(kept)
    except ValidationError as exc:
        first = exc.errors()[0]
        why = f"{'.'.join(map(str, first['loc']))}: {first['msg']}"
        warn_unreadable(path, f"not a preflight result ({why})", "computed again")
        return None
    if found.total_params <= 0 or found.trainable_params < 0:
        warn_unreadable(path, f"counts {found.total_params} parameters", "computed again")
        return None
    return found


JOB_PREFLIGHT_FIELDS = {f.name for f in fields(JobPreflight)}


def preflight_log() -> Path:
    """LORA_CACHE_DIR/preflight/preflight.log, beside the results it was printed while computing."""
    return cache_root() / "preflight" / "preflight.log"


@contextmanager
def library_output_into(log: Path | None):
    """What torch, transformers, datasets and bitsandbytes print while preflight computes (import notices,
    deprecation warnings, progress bars) goes to `log`, not among the launcher's own lines; preflight's
    findings are returned as data and shown after. No log: left as it is."""
    if log is None:
        yield
        return

    with stderr_into(log, cache_root()), contextlib.redirect_stdout(sys.stderr):
        yield


# ---- a whole plan ---------------------------------------------------------------------------------------
def preflight_plan(
    plan, files: dict[str, str], gpu_mem_for, fetch: bool = False
) -> tuple[list[JobPreflight], list[Problem]]:
    """Every training job of `plan` (eval jobs train nothing), and the problems that refuse the launch.
    `files`: experiment name → its YAML file; `gpu_mem_for(resources)`: the GPU memory of a job's
    partition or constraint, or None. `fetch` (hub_downloads: login): download what the jobs need first,
    and refuse what could not be had, since the jobs will run offline."""
    results, problems = [], []
    if any(not Path(j.spec.model.name_or_path).is_dir() for j in plan.jobs if j.kind == "train"):
        hub_unreachable()  # one quick request: without a hub, what follows runs offline, without retries
    for planned in plan.jobs:
        where = files.get(planned.experiment, planned.experiment)
        if planned.kind == "export":  # loads what the training loads, after it
            continue
        if planned.kind != "train":
            scorer = planned.spec.eval.bertscore_model
            # A base-model eval scores with its experiments' eval settings: their eval says it once.
            if fetch and scorer and "bertscore" in planned.spec.eval.metrics and planned.spec.adapter_dir:
                problems += unfetched(
                    planned.id, where, "eval.bertscore_model", hub_cache.fetch_scorer(scorer)
                )
            continue
        missing = hub_cache.fetch(planned.spec) if fetch else None
        lacking = unfetched(
            planned.id, where, "model.name_or_path", missing or {}, planned.spec.model.name_or_path
        )
        problems += lacking
        if mismatch := kind_problem(planned.spec, where):  # a hub model's config.json is here now
            problems.append(mismatch)
            continue
        try:
            result = cached_preflight(planned.spec, gpu_mem_for(planned.resources), preflight_log())
        except OSError as exc:
            if in_cache := cache_problem(exc):
                problems.append(in_cache)
            elif not lacking:  # else said already, with its fetch command
                problems.append(Problem(where, "model.name_or_path", unavailable(planned.spec, exc)))
            continue
        except ValueError as exc:  # what the job would fail on at its start, e.g. target modules not found
            problems.append(
                Problem(where, "", f"{planned.id}: the job would fail at its start: {first_line(exc)}")
            )
            continue
        # Not cached: files arrive without changing the key.
        result.fetch = list(missing) if missing is not None else missing_for(planned.spec)
        results.append(result)
        problems += refusals(result, where)
    return results, problems


def kind_problem(job: TrainJob, where: str) -> Problem | None:
    try:
        model_config = json.loads(config_text(job.model.name_or_path, job.model.revision))
    except (OSError, ValueError):  # not here: said by the preflight that follows
        return None
    why = kind_mismatch(job.model.kind, model_config) if isinstance(model_config, dict) else None
    return Problem(where, "model.kind", why) if why else None


def unfetched(job_id: str, where: str, key: str, missing: dict[str, str], name: str = "") -> list[Problem]:
    if not missing:
        return []
    lines = "; ".join(f"{command} ({reason})" for command, reason in missing.items())
    # The model's own download among what is missing (not only a dataset's), and a folder of it here.
    asked = name and not Path(name).is_dir() and any(name in command.split() for command in missing)
    here = local_copy_hint(name, key) if asked else ""
    return [
        Problem(
            where,
            key,
            f"{job_id} runs offline (cluster.yaml hub_downloads: login) and this machine could not fetch "
            f"what it needs: {lines}; run that where there is network, into the Hugging Face cache the nodes "
            f"share (HF_HOME), or set hub_downloads: nodes if the nodes have network{here}",
        )
    ]


# Where local model folders are made (`python -m demo.tiny models`, `python -m bench.real_model --convert`).
MODEL_FOLDERS = (Path("models"), Path(__file__).resolve().parents[2] / "models")


def local_copy_hint(hub_id: str, key: str) -> str:
    """`; a local copy is here: write KEY: ./models/NAME` where local_copy finds one, else ""."""
    copy = local_copy(hub_id)
    return f"; a local copy is here: write {key}: {copy}" if copy else ""


def local_copy(hub_id: str) -> str | None:
    """A local model folder a hub id's repo was saved or converted into (`models/smollm2-135m-instruct` for
    `HuggingFaceTB/SmolLM2-135M-Instruct`), written as the config would name it; None when there is none.
    Before: offline, the refusal named only the download, not the folder a user had just made."""
    repo = hub_id.rsplit("/", 1)[-1].lower()
    for folder in MODEL_FOLDERS:
        if not repo or not folder.is_dir():
            continue
        for found in folder.iterdir():
            if found.name.lower() == repo and (found / "config.json").is_file():
                relative = os.path.relpath(found)
                return str(found.resolve()) if relative.startswith("..") else f"./{relative}"
    return None


def cache_problem(exc: OSError) -> Problem | None:
    """An OSError on a file of the preflight's own cache (LORA_CACHE_DIR: its log, a result), named as that
    file's problem (a link, which is never written through; or another error), not as the model's; None
    for any other file. Before: a link at preflight.log read "the config of MODEL is neither a local folder
    nor in the Hugging Face cache"."""
    name = exc.filename and Path(os.path.abspath(exc.filename))
    root = Path(os.path.abspath(cache_root()))
    if not name or not name.is_relative_to(root):
        return None
    what = "is a symbolic link" if os.path.islink(name) or exc.errno == errno.ELOOP else exc.strerror
    return Problem(
        str(name),
        "",
        f"{what}: the preflight's cache (LORA_CACHE_DIR, {root}) is never written through a link; remove it, "
        "or set LORA_CACHE_DIR to a folder of your own",
    )


def unavailable(job: TrainJob, exc: Exception) -> str:
    name = job.model.name_or_path
    return (
        f"the config of {name!r} is neither a local folder nor in the Hugging Face cache ({first_line(exc)}); "
        f"fetch it on a machine with network: {fetch_command(name, job.model.revision)}"
        + local_copy_hint(name, "model.name_or_path")
    )


def refusals(result: JobPreflight, where: str) -> list[Problem]:
    found = []
    if result.data_refused:
        found.append(
            Problem(where, "data", f"{result.job}: the job would fail at its start: {result.data_refused}")
        )
    if result.too_trainable:
        modules = ", ".join(f"{n} ({c:,})" for n, c in result.trainable_by_module.items())
        found.append(
            Problem(
                where,
                "adapter.max_trainable_percent",
                f"{result.job}: {result.trainable_percent:.1f}% of the model would be trainable "
                f"({result.trainable_params:,} of {result.total_params:,} parameters; by module: {modules}), "
                f"over the limit {result.max_trainable_percent:g}%: lower adapter.rank, target fewer modules, "
                "or raise the limit (the job would refuse it at its start)",
            )
        )
    if result.fits is False:
        found.append(Problem(where, "train.batch_size", does_not_fit(result)))
    return found


def does_not_fit(result: JobPreflight) -> str:
    ways = list(result.alternatives)
    if (result.split or {}).get("how") == "asked":  # auto would have split the effective batch to fit
        ways.insert(0, "train.micro_batch: auto splits the effective batch into micro-batches that fit")
    others = "; ".join(ways) or "no other setting fits: use a larger GPU"
    largest = (
        f"the largest batch that fits is train.batch_size: {result.largest_batch}"
        if result.largest_batch
        else "not even train.batch_size: 1 fits"
    )
    return (
        f"{result.job}: {peak_step(result.memory)} needs about {result.memory_gb:.1f} GB per GPU, over the "
        f"{result.gpu_mem_gb:g} GB of this partition (cluster.yaml gpu_mem_gb; GB = 10^9 bytes, as GPUs are "
        f"sold: an 80 GB H100 is 80); {largest}. Or: {others}"
    )


def peak_step(memory: dict) -> str:
    """Which step peaks: the training step, the in-training eval at its larger batch, or a GRPO stage's
    generation of a step's completions at once."""
    steps = {"train": memory.get("train_gb", 0), "eval": memory.get("eval_gb") or 0}
    steps["generation"] = memory.get("generation_gb") or 0
    peak = max(steps, key=steps.get)
    if peak == "generation":
        return (
            f"its generation ({memory['generation_sequences']} completions at once, each step's: lower "
            "train.batch_size x grad_accum or train.grpo.num_generations)"
        )
    if peak == "eval":
        return f"its in-training eval (batch {memory['eval_batch_size']}, twice the training batch)"
    return "a training step"
