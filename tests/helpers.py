"""Helpers more than one test module uses (fixtures live in conftest.py; the trainer's helpers in
train_helpers.py). A test module imports from these two, never from another test module (test_layers.py)."""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml
from rich.console import Console

from core.writer_lock import hold_folder
from slurm.cluster.profile import load_profile
from slurm.planning.experiments import load_experiments
from slurm.planning.plan import build_plan
from slurm.queueing.jobs import StageJob, this_job_id
from slurm.watching.render import status_table
from tests.conftest import write_cluster_yaml

ROOT = Path(__file__).resolve().parent.parent
TINY_SQL = ROOT / "tests" / "fixtures" / "tiny-sql.yaml"
# One small experiment whose checks need no model files (a hub id, never fetched by a dry run): the lines
# the tests name are its own (model.kind on line 2, train on line 5, resources on line 7). What the tests
# launch and train is tests/fixtures/tiny-sql.yaml (tiny_sql_base, below).
TINY_EXPERIMENT = """\
name: a
model: {{name_or_path: {model}, kind: {kind}}}
adapter: {{rank: 8, alpha: 16}}
data: {{train: {data}, eval: {data}, input_field: question, target_field: sql}}
train: {{epochs: 1, learning_rate: 2.0e-4, eval_every_epochs: 1}}
eval: {{metrics: [exact_match, sql_exec], db: {db}}}
resources: {{gpus: 1, cpus: 1, mem_gb: 1, time: "00:05:00"}}
"""


def experiment_folder(
    tmp_path: Path,
    model: str = "org/some-model",
    kind: str = "causal",
    more: str = "",
    db: Path = ROOT / "data" / "demo" / "shop.db",
) -> Path:
    """configs/ under tmp_path: a cluster.yaml keeping runs there, a one-example data file, and a.yaml, the
    tiny experiment with `more` (a sweep block, say) appended, scoring SQL on `db`."""
    configs = tmp_path / "configs"
    configs.mkdir(exist_ok=True)
    write_cluster_yaml(configs, tmp_path)
    data = tmp_path / "train.jsonl"
    data.write_text('{"question": "q", "sql": "SELECT 1"}\n')
    (configs / "a.yaml").write_text(TINY_EXPERIMENT.format(model=model, kind=kind, data=data, db=db) + more)
    return configs


def dry_run(configs: Path, capsys, *overrides: str) -> tuple[int, str]:
    """`launch.py --all --dry-run` on `configs`: (exit code, what it wrote to stderr)."""
    import launch

    code = launch.main(["--all", "--config-dir", str(configs), "--dry-run", *overrides])
    return code, capsys.readouterr().err


def wait_until(condition, what: str, timeout_s: float = 240):
    """Polls `condition` until it returns something truthy, and returns that; fails naming `what`. For a
    state another process reaches (a real job, a real launcher), never as a pause."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


# The tiny text-to-SQL experiment the launching tests share (tests/fixtures/tiny-sql.yaml), and what they
# read of the runs it leaves.


def tiny_sql_base(folder: Path) -> Path:
    """`_tiny-sql.yaml` in `folder`, for the experiments there (or in folders below) to inherit:
    tests/fixtures/tiny-sql.yaml with its paths made absolute, since launch.py reads a path against the
    folder it runs in, which differs between tests."""
    base = yaml.safe_load(TINY_SQL.read_text())
    base["model"]["name_or_path"] = str(ROOT / base["model"]["name_or_path"])
    base["data"]["train"] = str(ROOT / base["data"]["train"])
    path = folder / "_tiny-sql.yaml"
    path.write_text(yaml.safe_dump(base, sort_keys=False))
    return path


def first_examples(split: str, count: int, to: Path) -> Path:
    """The first `count` examples of the demo's SQL `split` (easy, dev, ...), in `to`: a test whose
    assertions are about what ran, not what was learned, trains and scores on a few."""
    to.parent.mkdir(parents=True, exist_ok=True)
    lines = (ROOT / "data" / "demo" / "sql" / f"{split}.jsonl").read_text().splitlines(keepends=True)
    to.write_text("".join(lines[:count]))
    return to


# The tiny SQL experiment with its model and epochs chosen: a few seconds of local training.
TINY_SQL_EXPERIMENT = """\
name: {name}
inherits: _tiny-sql.yaml
model: {{name_or_path: {model}}}
train: {{epochs: {epochs}}}
"""


def configs(tmp: Path, repo_root: Path, **experiments: dict) -> Path:
    """configs/ under tmp (runs and logs there too): one TINY_SQL_EXPERIMENT per name, its fields (`model`,
    `epochs`) as given, else the tiny causal model for one epoch."""
    folder = tmp / "configs"
    folder.mkdir(exist_ok=True)
    write_cluster_yaml(folder, tmp)
    tiny_sql_base(folder)
    for name, fields in experiments.items():
        fields = {"model": repo_root / "models" / "tiny-llama", "epochs": 1, **fields}
        (folder / f"{name}.yaml").write_text(TINY_SQL_EXPERIMENT.format(name=name, **fields))
    return folder


# The tiny SQL experiment as the fault tests run it on the dev cluster: the full demo split, checkpoints
# every `save` steps, SLURM's signal `signal_delay_s` before the time limit, requeues allowed.
FAULT_EXPERIMENT = """\
name: {name}
inherits: _tiny-sql.yaml
adapter: {{rank: 8, alpha: 16}}
data: {{train: {root}/data/demo/sql/train.jsonl, eval: {root}/data/demo/sql/dev.jsonl}}
train: {{epochs: {epochs}, learning_rate: 3.0e-3, batch_size: 8, save_every_steps: {save}, logging_steps: 4}}
eval: {eval}
resources: {{gpus: {gpus}, nodes: {nodes}, {partition}cpus: {gpus}, mem_gb: 2, time: "{time}", signal_delay_s: {signal_delay_s}, max_requeues: {requeues}}}
{extra}
"""


def fault_experiment(
    repo_root: Path,
    tmp: Path,
    name: str,
    epochs=6,
    save=8,
    time="00:20:00",
    signal_delay_s=60,
    requeues=8,
    extra="",
    evaluation="{metrics: []}",
    gpus=1,
    nodes: int | str = 1,
) -> Path:
    """configs/ under tmp with one FAULT_EXPERIMENT, `name`.yaml, added to what it holds; `extra` is YAML
    appended to it (stages, say)."""
    folder = tmp / "configs"
    folder.mkdir(exist_ok=True)
    write_cluster_yaml(folder, tmp)
    tiny_sql_base(folder)
    text = FAULT_EXPERIMENT.format(
        name=name,
        root=repo_root,
        epochs=epochs,
        save=save,
        time=time,
        signal_delay_s=signal_delay_s,
        requeues=requeues,
        extra=extra,
        eval=evaluation,
        gpus=gpus,
        nodes=nodes if isinstance(nodes, int) else f'"{nodes}"',  # `1-2`: an elastic job
        # The two-node dev cluster's partition across both (its default one is its first node alone).
        partition="partition: multi, " if nodes != 1 else "",
    )
    (folder / f"{name}.yaml").write_text(text)
    return folder


def submit(folder: Path, *extra: str) -> int:
    """`launch.py --all --backend slurm` on `folder`, in this process."""
    import launch

    return launch.main(["--all", "--config-dir", str(folder), "--backend", "slurm", *extra])


def record(tmp: Path, job: str) -> dict:
    """The newest scheduler record of `job` (EXP/STAGE) in the run root under tmp (its job.json)."""
    return json.loads((tmp / "runs" / job / "job.json").read_text())["jobs"][-1]


def slurm_id(tmp: Path, job: str) -> str:
    return record(tmp, job)["job_id"]


def progress_step(run_dir: Path) -> int:
    """The step progress.json says the stage reached; 0 before it is written (or while it is torn)."""
    try:
        return json.loads((run_dir / "progress.json").read_text())["step"]
    except (OSError, ValueError, KeyError):
        return 0


def job_pids(job_id: str) -> list[tuple[str, str, str, str, str]]:
    """`scontrol listpids` rows (PID, JOBID, STEPID, LOCALID, GLOBALID) of a running job on each of its
    nodes. scontrol finds a job's processes through the spool folder of the node it is told, else of the
    host it runs on, which in the two-node layout (each slurmd under its own host name) is no node's."""
    nodes = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%N"], capture_output=True, text=True)
    names = subprocess.run(
        ["scontrol", "show", "hostnames", nodes.stdout.strip()], capture_output=True, text=True
    ).stdout.split()
    rows = []
    for node in names:
        done = subprocess.run(["scontrol", "listpids", job_id, node], capture_output=True, text=True)
        rows += [tuple(line.split()) for line in done.stdout.splitlines()[1:] if len(line.split()) == 5]
    return rows


def alive(pid: str) -> bool:
    """The process exists and has not ended: a zombie (ended, not yet collected by its parent) is not."""
    try:
        stat = Path(f"/proc/{int(pid)}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


# On the dev cluster: sbatch queues the job held (it never runs), so the queue is what the test counts.
def holding_sbatch(folder: Path, kill_launcher: bool = False) -> dict[str, str]:
    """PATH with an sbatch that queues the job held: it waits in the real queue until `scontrol release`.
    With `kill_launcher` it then SIGKILLs its caller (the launcher, which submitit's sbatch call is a child
    of) before it can read the job id: the one moment a job is queued and not yet recorded, caused for real."""
    folder.mkdir(exist_ok=True)
    script = folder / "sbatch"
    after = 'kill -9 "$PPID"\n' if kill_launcher else ""
    script.write_text(f'#!/bin/sh\n"{shutil.which("sbatch")}" --hold "$@" || exit 1\n{after}')
    script.chmod(0o755)
    return {"PATH": f"{folder}{os.pathsep}{os.environ['PATH']}"}


def start_launcher(folder: Path, log: Path, *extra: str, **popen) -> subprocess.Popen:
    """`launch.py --all` on `folder` as its own process, its output (unbuffered) in `log`."""
    argv = [sys.executable, "launch.py", "--all", "--config-dir", str(folder), "--no-preflight", *extra]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **popen.pop("env", {})}
    with open(log, "w") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, **popen)


# The shipped demo (configs/demo).
DEMO_JOBS = {
    "sql-t5-lora/train",
    "sql-t5-lora/eval",
    "sql-llama-qlora-curriculum/easy",
    "sql-llama-qlora-curriculum/harder",
    "sql-llama-qlora-curriculum/eval",
    "chain-first/train",
    "chain-first/eval",
    "chain-second/train",
    "chain-second/eval",
    "shapes-vl-qlora-curriculum/colours",
    "shapes-vl-qlora-curriculum/shapes",
    "shapes-vl-qlora-curriculum/eval",
    "sql-llama-chat/train",
    "sql-llama-chat/eval",
    "sql-llama-sft-dpo/sft",
    "sql-llama-sft-dpo/dpo",
    "sql-llama-sft-dpo/eval",
    "sql-llama-sft-grpo/sft",
    "sql-llama-sft-grpo/eval-sft",
    "sql-llama-sft-grpo/grpo",
    "sql-llama-sft-grpo/eval",
}


def demo_configs(repo_root: Path, tmp: Path) -> Path:
    """configs/demo + base.yaml copied under tmp, with runs and logs under tmp too."""
    configs = tmp / "configs"
    shutil.copytree(repo_root / "configs" / "demo", configs / "demo")
    shutil.copy(repo_root / "configs" / "base.yaml", configs / "base.yaml")
    shutil.copy(repo_root / "configs" / "baselines.yaml", configs / "baselines.yaml")
    write_cluster_yaml(configs, tmp)
    return configs / "demo"


# Plans of small experiment folders, built as the launcher builds them, without submitting anything.
SHIPPED_EXPERIMENTS = ROOT / "configs" / "experiments"
CHAIN = """\
name: chain
model: {{name_or_path: org/some-model, kind: causal}}
data: {{train: {data}, eval: {data}}}
eval: {{metrics: [exact_match]}}
stages:
  - name: one
    train: {{learning_rate: {first_rate}}}
  - name: two
"""
OTHER = """\
name: other
model: {{name_or_path: org/some-model, kind: causal}}
data: {{train: {data}, eval: {data}}}
eval: {{metrics: [exact_match]}}
"""


def plan_for(
    overrides: list[str] | None = None, names: list[str] | None = None, folder: Path = SHIPPED_EXPERIMENTS
):
    from slurm.cluster.profile import load_profile
    from slurm.planning.experiments import load_experiments, parse_overrides
    from slurm.planning.plan import build_plan

    profile, _ = load_profile(folder)
    return build_plan(load_experiments(folder, profile, parse_overrides(overrides or []), names), profile)


def write_experiments(folder: Path, first_rate: str = "2.0e-4", cluster: str = "", **files: str) -> Path:
    """`folder` with a one-example data file, chain.yaml (two stages), other.yaml and `files` (name → YAML
    text, DATA standing for the data file's path)."""
    folder.mkdir(exist_ok=True)
    data = folder / "train.jsonl"
    data.write_text('{"input": "q", "target": "a"}\n')
    (folder / "cluster.yaml").write_text(f"run_dir: runs\nlog_dir: {folder / 'logs'}\n{cluster}")
    (folder / "chain.yaml").write_text(CHAIN.format(data=data, first_rate=first_rate))
    (folder / "other.yaml").write_text(OTHER.format(data=data))
    for name, text in files.items():
        (folder / f"{name}.yaml").write_text(text.replace("DATA", str(data)))
    return folder


def sized(name: str, resources: str, eval_section: str = "{metrics: [exact_match]}") -> str:
    """An experiment for write_experiments with the given resources (and eval) sections."""
    model = "{name_or_path: org/some-model, kind: causal}"
    return (
        f"name: {name}\nmodel: {model}\ndata: {{train: DATA, eval: DATA}}\n"
        f"eval: {eval_section}\nresources: {resources}\n"
    )


HUB_FIXTURES = ROOT / "tests" / "fixtures" / "hub"


def hub_cache(folder: Path) -> Path:
    """A Hugging Face cache holding only the fixtures' config.json files, as a login node that fetched
    the configs (and nothing else) would have."""
    snapshot = "0" * 40
    for config in HUB_FIXTURES.glob("*/*/config.json"):
        repo = config.parent.relative_to(HUB_FIXTURES)
        model = folder / f"models--{str(repo).replace('/', '--')}"
        (model / "refs").mkdir(parents=True)
        (model / "refs" / "main").write_text(snapshot)
        (model / "snapshots" / snapshot).mkdir(parents=True)
        shutil.copy(config, model / "snapshots" / snapshot / "config.json")
    return folder


# Jobs that hold their run folder as a trainer does and then wait to be killed: the one-writer tests need
# real processes under a real submitit controller, not training (core/writer_lock.py, slurm/queueing/jobs.py).
class BlockingStage(StageJob):
    """A StageJob (the same __call__: tied to its controller, the folder held) whose work never ends."""

    def run(self, spec: dict, config_hash: str) -> str:
        threading.Event().wait()
        return ""


class PreviousCodeStage:
    """A job as the code before die_with_controller ran it (or as it runs where Linux's parent-death signal
    is missing): it holds its folder, but nothing ends it when its controller is killed."""

    def __call__(self, spec: dict, config_hash: str, workdir: str) -> str:
        with hold_folder(Path(spec["run_dir"]), this_job_id()):
            threading.Event().wait()
        return ""


def start_local_job(folder: Path, stage, run_dir: Path):
    """`stage` as a real local job (submitit's LocalExecutor, the local backend's) logging in `folder`."""
    import submitit

    from slurm.queueing.backends import working_directory

    run_dir.mkdir(parents=True, exist_ok=True)
    executor = submitit.LocalExecutor(folder=folder, python=sys.executable)
    executor.update_parameters(timeout_min=10)
    with working_directory(ROOT):  # the task imports tests.helpers from here
        return executor.submit(stage, {"run_dir": str(run_dir)}, "hash", str(run_dir.parent))


STATUS_EXPERIMENT = """\
name: {name}
model: {{name_or_path: org/model, kind: causal}}
data: {{train: {data}, input_field: q, target_field: a}}
eval: {{metrics: []}}
resources: {{mem_gb: 4, cpus: 1}}
"""


def first_stages(tmp_path: Path, names: list[str]) -> list:
    """The train job of each experiment (one CPU stage each, STATUS_EXPERIMENT), in the order of `names`:
    rows for --status's table, the scheduler's answer given by the test."""
    configs = tmp_path / "configs"
    configs.mkdir()
    write_cluster_yaml(configs, tmp_path)
    data = tmp_path / "d.jsonl"
    data.write_text('{"q": "x", "a": "y"}\n')
    for name in names:
        (configs / f"{name}.yaml").write_text(STATUS_EXPERIMENT.format(name=name, data=data))
    profile, _ = load_profile(configs)
    jobs = {job.experiment: job for job in build_plan(load_experiments(configs, profile), profile).jobs}
    return [jobs[name] for name in names]


def rendered_status(rows) -> str:
    """--status's table of `rows`, as text 200 columns wide."""
    console = Console(width=200, record=True, markup=False)  # as the commands' (render.py console)
    console.print(status_table(rows))
    return console.export_text()


def bounded_child(args: list[str], limit: int = 1 << 30) -> subprocess.CompletedProcess:
    """`python ARGS` in the repository under RLIMIT_AS `limit`: a reader without a bound dies there."""

    def bound() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        preexec_fn=bound,
        timeout=300,
        check=False,
    )
