"""What this machine's Hugging Face caches hold, and the command that fetches what they lack.

Torch-free: the launcher asks it on the login node before queueing. Compute nodes often have no network;
with cluster.yaml's `hub_downloads: login` (the default) preflight fetches what the jobs need here (`fetch`),
into the cache the nodes share, and SLURM jobs run offline. What cannot be fetched is named with the exact
`hf download` command for it (`missing_for`); a job that still lacks a file fails at its start with it.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from functools import cache
from pathlib import Path

from core.config import TrainJob
from core.names import TOKENIZER_FILES

WEIGHT_FILES = (  # one of these is enough: an index names its shards
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def model_file(name_or_path: str, filename: str, revision: str | None) -> str | None:
    """A model file in its local folder, or in the Hugging Face cache (a snapshot path names its commit);
    None when neither has it."""
    from huggingface_hub import try_to_load_from_cache

    folder = Path(name_or_path)
    if folder.is_dir():
        return str(folder / filename) if (folder / filename).is_file() else None
    found = try_to_load_from_cache(name_or_path, filename, revision=revision)
    return found if isinstance(found, str) else None


def has_any(name_or_path: str, filenames: tuple[str, ...], revision: str | None) -> bool:
    return any(model_file(name_or_path, name, revision) for name in filenames)


def dataset_name(source: str | None) -> str | None:
    """`hf:NAME[:CONFIG]:SPLIT` → NAME; None for a local file."""
    return source[3:].split(":")[0] if source and source.startswith("hf:") else None


def dataset_cached(name: str) -> bool:
    """The hub cache holds a snapshot of the dataset repo (`hf download`), or `datasets` prepared it
    (an earlier load_dataset): either lets load_dataset run with HF_DATASETS_OFFLINE=1."""
    import datasets.config
    from huggingface_hub import constants

    snapshots = Path(constants.HF_HUB_CACHE) / f"datasets--{name.replace('/', '--')}" / "snapshots"
    prepared = Path(datasets.config.HF_DATASETS_CACHE) / name.replace("/", "___")
    return any(snapshots.glob("*/*")) or prepared.is_dir()


def fetch_command(repo: str, revision: str | None = None, repo_type: str = "model") -> str:
    kind = f" --repo-type {repo_type}" if repo_type != "model" else ""
    return f"hf download {repo}{kind}" + (f" --revision {revision}" if revision else "")


def missing_for(job: TrainJob) -> list[str]:
    """The `hf download` commands for what `job` needs and this machine's caches lack: its model (weights,
    tokenizer) unless it is a local folder, and each `hf:` dataset it trains or evaluates on."""
    model = job.model
    commands = []
    if not has_model(model.name_or_path, model.revision):
        commands.append(fetch_command(model.name_or_path, model.revision))
    for name in dict.fromkeys(dataset_name(s) for s in (job.data.train, job.data.eval)):
        if name and not dataset_cached(name):
            commands.append(fetch_command(name, repo_type="dataset"))
    return commands


# A model repo's files a job loads: config, tokenizer, chat template, weights (safetensors, or .bin where a
# repo has no safetensors); not its other formats (onnx/, gguf, original/ checkpoints).
MODEL_PATTERNS = ("*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja")
OTHER_FORMATS = ("onnx/*", "openvino/*", "original/*", "*.gguf")


def has_model(name_or_path: str, revision: str | None) -> bool:
    return Path(name_or_path).is_dir() or (
        has_any(name_or_path, WEIGHT_FILES, revision) and has_any(name_or_path, TOKENIZER_FILES, revision)
    )


def fetch_model(name: str, revision: str | None) -> None:
    """Download a hub model (config, tokenizer, weights at `revision`) into this machine's cache; raises
    what huggingface_hub raises without network (at once under HF_HUB_OFFLINE=1)."""
    from huggingface_hub import HfApi, snapshot_download

    files = HfApi().list_repo_files(name, revision=revision)
    patterns = [*MODEL_PATTERNS, *([] if any(f.endswith(".safetensors") for f in files) else ["*.bin"])]
    snapshot_download(name, revision=revision, allow_patterns=patterns, ignore_patterns=list(OTHER_FORMATS))


def fetch(job: TrainJob) -> dict[str, str]:
    """Fetch what `job` needs and this machine lacks (its hub model; each `hf:` dataset, prepared as the
    job's own load_hf prepares it, which HF_DATASETS_OFFLINE then reads). Returns what still lacks, as
    missing_for's `hf download` commands, each with the reason it could not be had."""
    model, reasons = job.model, {}
    if not has_model(model.name_or_path, model.revision) and (
        failure := tried_model(model.name_or_path, model.revision)
    ):
        reasons[fetch_command(model.name_or_path, model.revision)] = failure
    for source in dict.fromkeys(s for s in (job.data.train, job.data.eval) if dataset_name(s)):
        if not dataset_cached(dataset_name(source)) and (failure := tried_dataset(source)):
            reasons[fetch_command(dataset_name(source), repo_type="dataset")] = failure
    return {c: reasons.get(c, "still not in the cache after fetching") for c in missing_for(job)}


def fetch_scorer(name_or_path: str) -> dict[str, str]:
    """The same for an eval job's scoring model (eval.bertscore_model)."""
    if has_model(name_or_path, None):
        return {}
    failure = tried_model(name_or_path, None)
    if has_model(name_or_path, None):
        return {}
    return {fetch_command(name_or_path): failure or "still not in the cache after fetching"}


# Once per repo and launch: the experiments of a plan often share a model and a dataset, and without
# network each try would wait on it again.
@cache
def hub_unreachable() -> str | None:
    """Why the hub cannot be reached, from one quick request per process; None when it answers (or when
    offline mode is set: every hub call then fails at once by itself). Unreachable, the process goes
    offline (HF_HUB_OFFLINE) for the libraries' later calls too: else huggingface_hub retries each request
    five times with backoff, and a preflight without network spent minutes in `Retrying in 8s` lines (for
    each repo, then again for each tokenizer it loads) before its error."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    if constants.HF_HUB_OFFLINE:
        return None
    try:
        get_session().head(constants.ENDPOINT, timeout=10)
    except Exception as exc:  # noqa: BLE001  DNS, refused, timed out, TLS: each means no hub from here
        go_offline()
        return f"cannot reach {constants.ENDPOINT}: {first_line(exc)[:80]}"
    return None


def go_offline() -> None:
    """Offline for this process's libraries: huggingface_hub (what transformers asks, and what datasets
    copies when imported later) and datasets, if imported already (its copy). Not the environment: sbatch
    hands that to the jobs, which may have the network this login node lacks (hub_downloads: nodes)."""
    from huggingface_hub import constants

    constants.HF_HUB_OFFLINE = True
    if datasets_config := sys.modules.get("datasets.config"):
        datasets_config.HF_HUB_OFFLINE = datasets_config.HF_DATASETS_OFFLINE = True


@cache
def tried_model(name: str, revision: str | None) -> str | None:
    """fetch_model; why it failed, or None."""
    if unreachable := hub_unreachable():
        return unreachable
    try:
        fetch_model(name, revision)
    except Exception as exc:  # noqa: BLE001  no network, no such repo, a gated one: said to the user
        return why_not(exc)
    return None


@cache
def tried_dataset(source: str) -> str | None:
    """The job's own load_hf, which prepares the dataset in the cache; why it failed, or None."""
    from train.data import load_hf

    if unreachable := hub_unreachable():
        return unreachable
    try:
        load_hf(source)
    except Exception as exc:  # noqa: BLE001
        return why_not(exc)
    return None


def why_not(exc: Exception) -> str:
    if "offline" in f"{type(exc).__name__} {exc}".lower():
        return "this machine is offline: HF_HUB_OFFLINE or HF_DATASETS_OFFLINE is set"
    return first_line(exc)[:120]


class NotInCache(OSError):
    """A hub repo this process needs is neither in its cache nor downloadable (a node without network,
    HF_HUB_OFFLINE=1): says which repo and the command that fetches it, instead of the loader's traceback."""


@contextmanager
def fetch_hint(name_or_path: str, revision: str | None):
    """Around loading a model or tokenizer by hub id: a missing repo fails with its `hf download` command."""
    try:
        yield
    except OSError as exc:
        if Path(name_or_path).is_dir() or isinstance(exc, NotInCache):
            raise
        raise NotInCache(
            f"{name_or_path} is not in this machine's Hugging Face cache and could not be downloaded "
            f"({first_line(exc)}); fetch it where there is network, into the cache the nodes share: "
            f"{fetch_command(name_or_path, revision)}"
        ) from exc


def require_tokenizer_files(name_or_path: str, revision: str | None) -> None:
    """After loading a tokenizer: transformers builds a near-empty one (Qwen2's: 1 token) from a config
    alone instead of failing, and a job would train on it silently wrong."""
    if has_any(name_or_path, TOKENIZER_FILES, revision):
        return
    if Path(name_or_path).is_dir():
        raise FileNotFoundError(
            f"{name_or_path} has no tokenizer files (one of {', '.join(TOKENIZER_FILES)})"
        )
    raise NotInCache(
        f"{name_or_path} is not in this machine's Hugging Face cache (its tokenizer files are missing); "
        f"fetch it where there is network, into the cache the nodes share: {fetch_command(name_or_path, revision)}"
    )


def first_line(exc: Exception) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
