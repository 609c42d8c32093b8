"""What a sweep costs the scheduler: the demo's tiny SQL model swept over 12 points (4 learning rates x 3
seeds, each a training and an eval, and one base row), launched with `--wait` on the dev cluster, by this
code (job arrays + one shared eval) and by an earlier commit (a job per training and per eval).

    python -m bench.sweep_cost                          # this tree against d540aee (before arrays)
    python -m bench.sweep_cost --baseline REV --points 12

Needs the dev cluster (`make cluster`; SLURM_CONF set as its up.sh says) and the tiny models (`make
models/.built`). Prints per code: sbatch calls (an sbatch wrapper on PATH counts them), jobs SLURM
accounted, eval processes started (an eval job, or a shared eval, each starts one), the launch's wall time
to the last job's end, the CPU time of every job (sacct TotalCPU) and of the launcher (its --wait polls
included). Each side runs in a fresh folder with
a cold run root; the baseline is a git worktree of REV, run with this venv.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SWEEP = """\
name: cost
model: {{name_or_path: {root}/models/tiny-llama, kind: causal}}
adapter: {{rank: 4, alpha: 8, dropout: 0.0, max_trainable_percent: 30}}
data:
  train: {train}
  eval: {dev}
  input_field: question
  target_field: sql
  prompt_template: "{{schema}} | {{question}} | SQL: "
train: {{epochs: 1, batch_size: 16, learning_rate: 1.0e-3, eval_every_epochs: null, logging_steps: 1}}
eval: {{metrics: [exact_match], baseline: true, max_new_tokens: 16}}
resources: {{gpus: 0, cpus: 1, mem_gb: 1, time: "00:15:00"}}
sweep:
  grid: {{train.learning_rate: [{rates}]}}
  seeds: [1, 2, 3]
"""

SBATCH_COUNTER = """\
#!/bin/sh
echo "$@" >> {calls}
exec {sbatch} "$@"
"""


def first_lines(split: str, count: int, to: Path) -> Path:
    lines = (ROOT / "data" / "demo" / "sql" / f"{split}.jsonl").read_text().splitlines(keepends=True)
    to.write_text("".join(lines[:count]))
    return to


def measure(code: Path, folder: Path, points: int) -> dict:
    """Launch the sweep with `code`'s launch.py in `folder` and wait for it; what it cost."""
    configs, bin_dir = folder / "configs", folder / "bin"
    configs.mkdir(parents=True)
    bin_dir.mkdir()
    (configs / "cluster.yaml").write_text(f"run_dir: {folder / 'runs'}\nlog_dir: {folder / 'logs'}\n")
    rates = ", ".join(f"{1e-3 * (k + 1):.1e}" for k in range(max(1, points // 3)))
    train, dev = first_lines("easy", 32, folder / "train.jsonl"), first_lines("dev", 8, folder / "dev.jsonl")
    (configs / "cost.yaml").write_text(SWEEP.format(root=ROOT, train=train, dev=dev, rates=rates))
    calls = folder / "sbatch-calls.txt"
    wrapper = bin_dir / "sbatch"
    wrapper.write_text(SBATCH_COUNTER.format(calls=calls, sbatch=shutil.which("sbatch")))
    wrapper.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": str(code)}
    argv = [sys.executable, str(code / "launch.py"), "--all", "--config-dir", str(configs)]
    argv += ["--backend", "slurm", "--no-preflight", "--wait"]
    started, before = time.monotonic(), resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(argv, cwd=folder, env=env, capture_output=True, text=True)
    wall, after = time.monotonic() - started, resource.getrusage(resource.RUSAGE_CHILDREN)
    launcher_cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    if done.returncode != 0:
        raise SystemExit(
            f"{code}: the launch failed ({done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
        )
    ids = recorded_ids(folder / "runs")
    evals = {job_id for job, job_id in ids.items() if job.endswith("/eval")}
    accounted = total_cpu({job_id.split("_")[0] for job_id in ids.values()})
    return {
        "code": str(code),
        "sbatch calls": len(calls.read_text().splitlines()),
        "jobs accounted": len(accounted),
        "eval processes": len(evals),
        "wall s": round(wall, 1),
        "job CPU s": round(sum(accounted.values()), 1),
        "launcher CPU s": round(launcher_cpu, 1),
    }


def recorded_ids(runs: Path) -> dict[str, str]:
    """EXP/STAGE → the SLURM job id its job.json records last."""
    return {
        f"{path.parent.parent.name}/{path.parent.name}": json.loads(path.read_text())["jobs"][-1]["job_id"]
        for path in runs.glob("*/*/job.json")
    }


def total_cpu(job_ids: set[str]) -> dict[str, float]:
    """Each job's (each array task's) CPU time in seconds: sacct's TotalCPU of its allocation line, the
    sum of its steps' (with -X sacct prints 0 there, so the step lines are read and left out)."""
    text = subprocess.run(
        ["sacct", "-n", "-P", "-j", ",".join(sorted(job_ids)), "-o", "JobID,TotalCPU"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rows = (line.split("|") for line in text.splitlines() if "|" in line)
    return {job: seconds(cpu) for job, cpu in rows if "." not in job}


def seconds(text: str) -> float:
    """sacct's [D-]HH:MM:SS(.mmm) or MM:SS.mmm."""
    days, _, rest = text.rpartition("-")
    parts = [float(p) for p in rest.split(":")]
    while len(parts) < 3:
        parts.insert(0, 0.0)
    return (float(days or 0) * 24 + parts[0]) * 3600 + parts[1] * 60 + parts[2]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default="d540aee", help="the commit to compare with (a job each)")
    parser.add_argument("--points", type=int, default=12)
    args = parser.parse_args(argv)
    if not shutil.which("sbatch") or not os.environ.get("SLURM_CONF"):
        raise SystemExit("needs the dev cluster: make cluster, then export SLURM_CONF as up.sh says")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    with tempfile.TemporaryDirectory(prefix="sweep-cost-") as tmp:
        old = Path(tmp) / "baseline-code"
        subprocess.run(
            ["git", "worktree", "add", "-q", "--detach", str(old), args.baseline], cwd=ROOT, check=True
        )
        try:
            rows = [
                (f"{args.baseline} (a job each)", measure(old, Path(tmp) / "old", args.points)),
                (
                    f"{head.stdout.strip()} (arrays + shared eval)",
                    measure(ROOT, Path(tmp) / "new", args.points),
                ),
            ]
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=ROOT, check=False)
    print(f"A {args.points}-point sweep of the demo's tiny SQL model on the dev cluster (+1 base row):")
    keys = ["sbatch calls", "jobs accounted", "eval processes", "wall s", "job CPU s", "launcher CPU s"]
    print(f"{'code':<34}" + "".join(f"{k:>16}" for k in keys))
    for name, row in rows:
        print(f"{name:<34}" + "".join(f"{row[k]:>16}" for k in keys))
    return 0


if __name__ == "__main__":
    sys.exit(main())
