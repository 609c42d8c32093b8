"""Helpers for the trainer's tests (tests/test_train_*.py): small jobs over the demo data on the tiny models
(the `tiny` fixture in conftest.py), and what a run leaves read back (adapter, loss curve), which the
launching tests compare too. Everything runs offline on the CPU."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SQL = ROOT / "data" / "demo" / "sql"
PROMPT = "{schema} | {question} | SQL: "

# How far two splits of one effective batch may differ (tests/test_loss_invariance.py, test_train_split.py,
# test_preference_split.py). Logged losses and gradient norms:
# issue 20 asks for 1 % at step 1 and 5 % at the end. Split right, the three runs sum the same terms in
# another order and agree to float rounding (1e-7 in fp32 on CPU), so the bound is far tighter: a mean of
# per-batch means is only 0.6 % off in test_loss_invariance.py, because untrained tiny models lose about ln(vocab) per token
# whatever its target's length, and 1 % would let it pass.
ROUNDING = 1e-3
# Adapters: fp32 sums in another order: 1e-6 apart; a changed effective batch or example order is far more.
SAME_SUMS = 1e-4


def sql_data(split: str = "easy", eval_split: str | None = None, **extra) -> dict:
    """A DataSpec (as a dict) over the demo text-to-SQL files: schema and question in every prompt."""
    return {
        "train": str(SQL / f"{split}.jsonl"),
        "eval": str(SQL / f"{eval_split}.jsonl") if eval_split else None,
        "input_field": "question",
        "target_field": "sql",
        "prompt_template": PROMPT,
    } | extra


def model_spec(tiny: dict[str, Path], kind: str = "causal", **extra) -> dict:
    name = "tiny-t5" if kind == "seq2seq" else "tiny-llama"
    return {"name_or_path": str(tiny[name]), "kind": kind} | extra


def make_job(tiny, run_dir: Path, kind: str = "causal", *, model=None, adapter=None, data=None, **train):
    """A small TrainJob: LoRA r8 without dropout (deterministic), 3 steps, a log row per step, no eval."""
    from core.config import TrainJob

    return TrainJob(
        experiment="t",
        stage="s",
        model=model or model_spec(tiny, kind),
        adapter={"rank": 8, "alpha": 16, "dropout": 0.0, "max_trainable_percent": 30} | (adapter or {}),
        data=data or sql_data(),
        train={
            "max_steps": 3,
            "learning_rate": 3e-3,
            "batch_size": 8,
            "logging_steps": 1,
            "eval_every_epochs": None,
            "warmup_ratio": 0.0,
        }
        | train,
        run_dir=str(run_dir),
    )


@contextlib.contextmanager
def one_torch_thread():
    """torch in this process on one CPU thread, as test_cluster_faults.py times its training: the tiny
    model's matrices are too small to share, and on a loaded 2-core machine two OpenMP threads wait on each
    other at every op (a QLoRA forward pass 10x slower). Runs compared with each other run alike."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class StopAfter(threading.Event):
    """A stop flag that sets itself after `steps` checks (the trainer checks once per step end), as the job
    wrapper's flag does when SLURM's signal arrives during that step."""

    def __init__(self, steps: int):
        super().__init__()
        self.steps, self.calls = steps, 0

    def is_set(self) -> bool:
        self.calls += 1
        return self.calls > self.steps


class KillAfter(threading.Event):
    """A stop flag that kills its own process (SIGKILL: no cleanup, nothing flushed, what a kill -9 or a lost
    node leaves) the (n+1)-th time it is asked. run_eval asks before the first batch and after each one, so
    the process dies right after its n-th batch was written."""

    def __init__(self, batches: int):
        super().__init__()
        self.batches, self.calls = batches, 0

    def is_set(self) -> bool:
        self.calls += 1
        if self.calls > self.batches:
            os.kill(os.getpid(), signal.SIGKILL)
        return False


def killed_after(config: str, batches: int) -> None:
    """In a child process: the eval job of `config` (its JSON file), killed after `batches` batches."""
    from core.config import EvalJob
    from eval.job import run_eval

    run_eval(EvalJob.model_validate_json(Path(config).read_text()), KillAfter(batches))


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_ranks(job, ranks: int = 2, env: dict | None = None) -> list[tuple[subprocess.Popen, Path]]:
    """Start `job` (a TrainJob) as `ranks` processes on gloo, with the environment the SLURM wrapper exports
    (tests/ddp_worker.py) and `env` on top; each rank's process and the file it writes its result to. Its
    log goes to that file's name with .log."""
    run_dir = Path(job.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    job_path = run_dir.parent / f"{run_dir.name}.job.json"
    job_path.write_text(job.model_dump_json())
    port, started = free_port(), []
    for rank in range(ranks):
        rank_env = os.environ | {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(ranks),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",  # several ranks on a small machine
        }
        out = run_dir.parent / f"{run_dir.name}.rank{rank}.json"
        command = [sys.executable, "-m", "tests.ddp_worker", str(job_path), str(out)]
        with out.with_suffix(".log").open("w") as log:
            started.append((subprocess.Popen(command, cwd=ROOT, env=rank_env | (env or {}), stderr=log), out))
    return started


def run_ranks(job, ranks: int = 2, timeout_s: float = 180, env: dict | None = None) -> list[dict]:
    """Run `job` as `ranks` processes (start_ranks, with `env`); each rank's {"outcome", "seen"}. A hang
    fails the test at the timeout."""
    started = start_ranks(job, ranks, env)
    try:
        codes = [process.wait(timeout=timeout_s) for process, _ in started]
    finally:
        for process, _ in started:
            process.kill()
    assert codes == [0] * ranks, f"rank exit codes {codes}"
    return [json.loads(out.read_text()) for _, out in started]


# What a training run leaves, read back: its adapter, and its loss curve in metrics.jsonl and TensorBoard.


def adapter_tensors(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))


def assert_same_adapter(a: Path, b: Path, relative: float | None = None) -> None:
    """The two runs saved the same adapter: equal within 1e-6 (the same arithmetic, resumed or not), or
    with `relative`, within that share of each tensor's scale (at least 1): fp32 sums in another order."""
    first, second = adapter_tensors(a), adapter_tensors(b)
    assert first.keys() == second.keys()
    for key in first:
        bound = 1e-6 if relative is None else relative * max(1.0, float(second[key].abs().max()))
        assert (first[key] - second[key]).abs().max().item() <= bound, key


def assert_every_step_logged_once(run_dir: Path, global_step: int, every: int = 4) -> None:
    """Across all the allocations, metrics.jsonl holds each logging step exactly once: none repeated after a
    resume, none skipped, and the last step whether or not it falls on the interval (LogTheLastStep)."""
    logged = [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]
    assert logged == list(dict.fromkeys([1, *range(every, global_step + 1, every), global_step]))


def tensorboard_losses(run_dir: Path) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tb"))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars("train/loss")]


def logged_losses(run_dir: Path, offset: int = 0) -> list[tuple[int, float]]:
    return [(r["step"] + offset, r["loss"]) for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]


def assert_same_curve(actual, expected) -> None:
    assert [step for step, _ in actual] == [step for step, _ in expected]
    assert [value for _, value in actual] == pytest.approx([value for _, value in expected], rel=1e-6)
