"""The cluster profile (`configs/cluster.yaml`): what every job on this cluster shares."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from core.config import Float, Int, SlurmNames, SlurmTime
from core.durations import slurm_seconds
from core.problems import ConfigError, Problem, one_per_value
from core.redact import literal_secret
from core.yamlfile import YamlProblem, find_inherited, read_yaml


def no_literal_secret(line: str) -> str:
    name = literal_secret(line)
    if name:
        raise ValueError(
            f"sets {name} to a literal value, and setup lines are copied into every job's submission script "
            f"under logs/; export {name} in your shell or ~/.bashrc instead (sbatch passes your environment "
            "to the job), or use `hf auth login` for a Hugging Face token"
        )
    return line


def one_line(folder: str) -> str:
    # Job scripts name the log folder in their #SBATCH --output line: a newline would start a shell line.
    if any(not ch.isprintable() for ch in folder):
        raise ValueError(f"{folder!r} holds a newline or another control character; name a plain folder")
    return folder


# \Z, not $: `$` also matches before a final newline, which sbatch then refuses.
MAIL_ADDRESS = re.compile(r"^[\w.+-]+@[\w-]+(\.[\w-]+)*\Z")


def mail_address(value: str) -> str:
    # It is written into an #SBATCH line: one plain address, nothing a shell or sbatch would read further.
    if not MAIL_ADDRESS.match(value):
        raise ValueError(f"{value!r} is not one plain mail address (e.g. ada@uni.example)")
    return value


class ClusterProfile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)  # as every config section

    partition: SlurmNames | None = Field(
        None,
        description="The default SLURM partition of every job (`null`: the cluster's default); an experiment's `resources.partition` wins. Letters, digits, `_`, `-` and `.`, with `,` between several.",
    )
    account: SlurmNames | None = Field(
        None,
        description="The default SLURM account of every job; an experiment's `resources.account` wins. Letters, digits, `_`, `-` and `.`, with `,` between several.",
    )
    qos: SlurmNames | None = Field(
        None,
        description="The default SLURM QOS of every job; an experiment's `resources.qos` wins. Letters, digits, `_`, `-` and `.`, with `,` between several.",
    )
    setup: list[Annotated[str, AfterValidator(no_literal_secret)]] = Field(
        default_factory=list, description="shell lines run before each job"
    )
    hub_downloads: Literal["login", "nodes"] = Field(
        "login",
        description="where hub models and datasets are downloaded: 'login' (preflight fetches them into "
        "this machine's Hugging Face cache, which the nodes share; SLURM jobs run with HF_HUB_OFFLINE=1 and "
        "HF_DATASETS_OFFLINE=1) or 'nodes' (each job downloads at its start; preflight only warns)",
    )
    run_dir: str = Field(
        "runs",
        description="Where run folders go, relative to where `launch.py` runs. Kept as written: it is part of each stage's identity.",
    )
    log_dir: Annotated[str, AfterValidator(one_line)] = Field(
        "logs",
        description="Where job logs go, relative to where `launch.py` runs (made absolute when read); named in every job's `#SBATCH --output` line, so no newlines or control characters.",
    )
    max_gpus_per_node: Annotated[Int, Field(ge=0)] = Field(
        8,
        description="GPUs of one node (≥ 0): `resources.gpus` or `eval.resources.gpus` above it is refused before anything is queued.",
    )
    max_nodes: Annotated[Int, Field(ge=1)] | None = Field(
        None,
        description="nodes one job may span (resources.nodes); unset: the partition's count, read at launch",
    )
    max_cpus_per_node: Annotated[Int, Field(ge=1)] = Field(
        64,
        description="CPUs of one node (≥ 1): `resources.cpus` or `eval.resources.cpus` above it is refused.",
    )
    max_mem_gb_per_node: Annotated[Float, Field(gt=0)] = Field(
        512,
        description="Memory of one node in GB (> 0): `resources.mem_gb` or `eval.resources.mem_gb` above it is refused.",
    )
    local_parallel_jobs: Annotated[Int, Field(ge=1)] = Field(
        1, description="Jobs run at once with `--backend local` (≥ 1)."
    )
    mail_user: Annotated[str, AfterValidator(mail_address)] | None = Field(
        None, description="sbatch --mail-user for jobs whose resources.mail asks for mail"
    )
    gpu_hour_cost: Annotated[Float, Field(ge=0)] | None = Field(
        None, description="what one GPU-hour costs (any currency): the report adds a cost column and total"
    )
    gpu_mem_gb: Annotated[Float, Field(gt=0)] | dict[str, Annotated[Float, Field(gt=0)]] | None = Field(
        None,
        description="GPU memory per GPU in GB (10^9 bytes, as GPUs are sold: an 80 GB H100 is 80, though "
        "it holds 85.5 GB = 79.6 GiB), for preflight: one number, or by partition or constraint name "
        "(a 'default' entry for the rest)",
    )

    def gpu_mem_for(self, resources) -> float | None:
        """The GPU memory a job with `resources` gets: its constraint's entry, else its partition's, else
        'default'; None when unknown (preflight then estimates without judging)."""
        if not isinstance(self.gpu_mem_gb, dict):
            return self.gpu_mem_gb
        for name in (resources.constraint, resources.partition or self.partition, "default"):
            if name in self.gpu_mem_gb:
                return self.gpu_mem_gb[name]
        return None

    # --pack / --budget when the command line leaves them out (slurm/planning/pack.py).
    pack: Annotated[Int, Field(ge=1)] | None = Field(None, description="GPUs of one packed allocation")
    budget: SlurmTime | None = Field(
        None, description="the packed allocation's time limit (default: max_time)"
    )

    # The longest limit `resources.time: auto` may ask for: set it to the partition's MaxTime.
    max_time: SlurmTime = Field(
        "2-00:00:00",
        description="The longest limit `time: auto` asks for (also what a job without an estimate gets), `HH:MM:SS` or `D-HH:MM:SS`: set it to the partition's `MaxTime`. `budget` defaults to it.",
    )

    @property
    def max_time_s(self) -> int:
        return slurm_seconds(self.max_time)


def find_profile(config_dir: Path) -> Path | None:
    """The nearest `cluster.yaml`, from the experiments' folder upwards."""
    return find_inherited("cluster.yaml", config_dir.resolve(), Path(config_dir.resolve().anchor))


def at_the_door(profile: ClusterProfile) -> ClusterProfile:
    """`log_dir` made absolute once, against the directory launch.py runs in: a job, a pack's lanes and a
    unit's process each start in another directory (the code snapshot, the user's), where a relative
    folder names another place (the shipped `log_dir: logs` sent every unit of a pack to a missing order
    file). `run_dir` stays as written: it is part of each stage's identity (a finished stage keeps its
    hash), and every job runs in the directory it was launched from, where it names the same folder."""
    return profile.model_copy(update={"log_dir": os.path.abspath(profile.log_dir)})


def load_profile(config_dir: Path) -> tuple[ClusterProfile, Path | None]:
    path = find_profile(config_dir)
    if path is None:
        return at_the_door(ClusterProfile()), None
    try:
        yf = read_yaml(path)
        return at_the_door(ClusterProfile.model_validate(yf.data)), path
    except YamlProblem as exc:
        raise ConfigError([exc.problem]) from None
    except ValidationError as exc:
        problems = [
            Problem(
                str(path),
                ".".join(map(str, e["loc"])),
                e["msg"].removeprefix("Value error, "),
                yf.lines.get(tuple(e["loc"])),
            )
            for e in one_per_value(exc.errors())  # a union's members folded into one problem per value
        ]
        raise ConfigError(problems) from None
