"""Shared fixtures: a real one-node SLURM cluster (started once per session) and the tiny offline models."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

# Before any test module imports rouge_score (and with it absl): submitit's first import runs
# logging.config.dictConfig, which closes every existing handler, and absl's handler closes its stream,
# which during collection is pytest's capture file; a later test then fails on "I/O operation on closed
# file" (seen when test_bertscore.py was collected right after test_vl.py).
import submitit  # noqa: F401  (imported for that side effect, first)

# No test may reach the hub: everything it loads is built here.
for _var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ[_var] = "1"
os.environ.setdefault("LAUNCH_POLL_S", "1")

ROOT = Path(__file__).resolve().parent.parent
CLUSTER_STATE = Path(os.environ.get("SLURM_DEV_STATE", "/tmp/slurm-lora-dev"))


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return ROOT


@pytest.fixture(scope="session")
def slurm_cluster() -> Path:
    """A real slurmctld + slurmd (+ slurmdbd) with 4 fake GPUs; started by the project's own script.

    Left running at the end (CI stops it; a developer's next run reuses it in well under a second).
    """
    up = ROOT / "slurm" / "dev-cluster" / "up.sh"
    done = subprocess.run(["bash", str(up), str(CLUSTER_STATE)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.fail(f"the dev SLURM cluster did not start:\n{done.stdout}\n{done.stderr}")
    for line in (CLUSTER_STATE / "env.sh").read_text().splitlines():
        key, _, value = line.removeprefix("export ").partition("=")
        os.environ[key] = os.path.expandvars(value)
    assert shutil.which("sbatch"), "sbatch is not on PATH after starting the dev cluster"
    return CLUSTER_STATE


# The two-node layout (slurm/dev-cluster/up.sh SLURM_DEV_NODES=2) is a cluster of its own, beside the
# one-node one every other cluster test uses: its ports 100 above, its state in a folder beside it.
TWO_NODE_STATE = Path(os.environ.get("SLURM_DEV_STATE_2N", f"{CLUSTER_STATE}-2n"))
TWO_NODE_PORT_BASE = os.environ.get(
    "SLURM_PORT_BASE_2N", str(int(os.environ.get("SLURM_PORT_BASE", "6817")) + 100)
)


@pytest.fixture(scope="session")
def two_node_state() -> Path:
    """A real slurmctld (+ slurmdbd) and two slurmd, n1 and n2, with 4 fake GPUs each: partition `multi`
    spans both. Started once, left running as slurm_cluster is."""
    up = ROOT / "slurm" / "dev-cluster" / "up.sh"
    env = {**os.environ, "SLURM_DEV_NODES": "2", "SLURM_PORT_BASE": TWO_NODE_PORT_BASE}
    done = subprocess.run(["bash", str(up), str(TWO_NODE_STATE)], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        pytest.fail(f"the two-node dev SLURM cluster did not start:\n{done.stdout}\n{done.stderr}")
    return TWO_NODE_STATE


@pytest.fixture
def two_node_cluster(two_node_state, monkeypatch, request, tmp_path) -> Path:
    """The two-node cluster for this test: its SLURM_CONF in the environment of every client call and
    job (for this test only), and the jobs it left cancelled at its end, explained when it failed."""
    monkeypatch.setenv("SLURM_CONF", str(two_node_state / "etc" / "slurm.conf"))
    yield two_node_state
    report = getattr(request.node, "report_call", None)
    if report is not None and report.failed:
        print(explain_jobs(tmp_path))
    if ids := squeue_ids(under=tmp_path):
        subprocess.run(["scancel", *sorted(ids)], check=False)
    # A test that drained n2 (an elastic job sent back to fewer nodes) gives it back, failed or not;
    # SLURM refuses this for a node that is not drained, harmlessly.
    subprocess.run(["scontrol", "update", "NodeName=n2", "State=RESUME"], capture_output=True, check=False)


@pytest.fixture(scope="session")
def tiny() -> dict[str, Path]:
    """{"tiny-t5": folder, "tiny-llama": folder}: the demo's tiny models, each with its tokenizer, in the
    repo's models/ folder (the demo configs point there; built once, kept while its stamp matches)."""
    from demo.tiny import build_tiny_models

    (ROOT / "models").mkdir(exist_ok=True)
    # pytest-xdist's workers each ask for them at once: one builds, the others then find them up to date.
    with open(ROOT / "models" / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return build_tiny_models(ROOT / "models")


@pytest.fixture(autouse=True, scope="session")
def token_cache(tmp_path_factory) -> Path:
    """A tokenization cache of the session's own, so no test reads another run's cached ids."""
    folder = tmp_path_factory.mktemp("lora-cache")
    previous = os.environ.get("LORA_CACHE_DIR")
    os.environ["LORA_CACHE_DIR"] = str(folder)
    yield folder
    if previous is None:
        os.environ.pop("LORA_CACHE_DIR", None)
    else:
        os.environ["LORA_CACHE_DIR"] = previous


@pytest.fixture(autouse=True, scope="session")
def repository_left_alone():
    """No test writes into the repository's own runs/ or logs/: they hold what `make demo` and a user ran,
    which the suite must neither change nor read (each test keeps its runs and logs under its tmp_path);
    nor a wandb/ folder of W&B's own logs (a --sync test once left one, and it was committed)."""

    def listing() -> set[Path]:
        return {path for folder in ("runs", "logs", "wandb") for path in (ROOT / folder).rglob("*")}

    before = listing()
    yield
    written = sorted(str(path.relative_to(ROOT)) for path in listing() - before)
    assert not written, f"tests wrote into the repository: {written[:10]}"


# The whole suite's budget on CI's quiet 2-core machine (docs/testing.md: what each feature may add to it and
# how a change measures its share). Printed against the wall time at the end of every run of `make test`.
SUITE_BUDGET_MIN = 33
_STARTED = time.monotonic()


@pytest.hookimpl(trylast=True)  # after the 30 slowest tests, just above pytest's closing line
def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if hasattr(config, "workerinput"):  # an xdist worker: the controller prints the run's line
        return
    wall = time.monotonic() - _STARTED
    terminalreporter.write_line(
        f"wall time {int(wall // 60)}:{int(wall % 60):02d}; the whole suite's budget on CI: {SUITE_BUDGET_MIN}:00"
    )


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups (--dist loadgroup)
def pytest_collection_modifyitems(config, items):
    """`cluster` marks every test that needs the dev SLURM cluster: `make test-fast` leaves them out.

    Under pytest-xdist (`make test`: two workers) every cluster test is in one group, so one worker runs
    them in order, one at a time, as they were written to run (a test counts the node's free GPUs, waits on
    SLURM's whole-minute limits, times its own job), while the other worker runs the rest beside it."""
    for item in items:
        if {"slurm_cluster", "two_node_cluster"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.cluster)
            item.add_marker(pytest.mark.xdist_group("cluster"))


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    report = yield
    setattr(item, f"report_{report.when}", report)
    return report


@pytest.fixture(autouse=True)
def cluster_jobs_of_the_test(request, tmp_path):
    """After a test on the dev cluster: when it failed, print what SLURM and the job logs say (a CI failure
    that only says "timed out" cannot be diagnosed); then cancel the jobs it left, so one failure does
    not hold the node's GPUs and starve the tests after it."""
    yield
    if "slurm_cluster" not in request.fixturenames:
        return
    ids = squeue_ids(under=tmp_path)
    report = getattr(request.node, "report_call", None)
    if report is not None and report.failed:
        print(explain_jobs(tmp_path))
    if ids:
        subprocess.run(["scancel", *sorted(ids)], check=False)


def explain_jobs(tmp: Path, lines: int = 25) -> str:
    """sacct's view of the jobs a test submitted and the last lines of each of their logs."""
    logs = sorted((tmp / "logs").rglob("*_log.*")) if (tmp / "logs").is_dir() else []
    ids = sorted({log.name.split("_")[0] for log in logs})
    parts = []
    if ids:
        done = subprocess.run(
            [
                "sacct",
                "-X",
                "-n",
                "-P",
                "-o",
                "JobID,JobName,State,ExitCode,Elapsed,Reason",
                "-j",
                ",".join(ids),
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        parts.append(f"sacct:\n{done.stdout}{done.stderr}")
    for log in logs:
        tail = log.read_text(errors="replace").splitlines()[-lines:]
        parts.append(f"--- {log.relative_to(tmp)} (last {len(tail)} lines)\n" + "\n".join(tail))
    return "\n".join(parts) or f"no job logs under {tmp / 'logs'}"


def squeue_ids(under: Path | None = None) -> set[str]:
    """Ids in the queue; with `under`, only jobs whose submission script lies below it (submitit writes
    it into the job's log folder), so jobs other tests left finishing cannot change a test's count."""
    # -r: one id per array task, pending ones too (`123_4`, not `123_[0-11]`)
    done = subprocess.run(["squeue", "-h", "-r", "-o", "%i|%o"], capture_output=True, text=True, check=True)
    rows = (line.split("|", 1) for line in done.stdout.splitlines() if "|" in line)
    return {job_id for job_id, command in rows if under is None or command.startswith(f"{under}/")}


def write_cluster_yaml(folder: Path, tmp: Path, **extra) -> None:
    """A cluster profile for a test: runs and logs under tmp, limits of the dev cluster's node."""
    lines = [
        f"run_dir: {tmp / 'runs'}",
        f"log_dir: {tmp / 'logs'}",
        "max_gpus_per_node: 4",
        "max_cpus_per_node: 8",
        "max_mem_gb_per_node: 15",
        *(f"{k}: {v}" for k, v in extra.items()),
    ]
    (folder / "cluster.yaml").write_text("\n".join(lines) + "\n")
