"""Login-node overhead: dry run, --status and submission of N generated one-stage experiments.

    python -m bench.launcher              # 300 jobs: dry run and --status (no scheduler needed)
    python -m bench.launcher --submit     # also submit them, held, to the SLURM on PATH; then cancel them

Targets (figures, not a test): dry run of 300 jobs <= 0.5 s, --status of 300 jobs <= 1 s with one squeue and
at most one sacct; the dry run of one sweep of 600 points (--sweep-points: 20 learning rates x 10 ranks x 3
seeds, a training and an eval job each) <= 2 s of CPU, start-up included. Every figure is the best of --repeat whole commands in fresh processes, as a user runs
them; the start-up every command pays (Python and the CLI's imports) is printed apart. Submitted jobs are
held (an sbatch wrapper adds --hold) so nothing runs, and cancelled at the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SHARED = """\
# One shared fragment, inherited by every experiment: parsed once per command, not once per file.
inherits: base.yaml
model: {{name_or_path: gpt2, kind: causal}}
adapter: {{rank: 8, alpha: 16, max_trainable_percent: 30}}
data:
  train: {root}/data/demo/sql/easy.jsonl
  eval: {root}/data/demo/sql/dev.jsonl
  input_field: question
  target_field: sql
  prompt_template: "{{schema}} | {{question}} | SQL: "
train: {{max_steps: 1, batch_size: 4}}
eval: {{metrics: []}}
resources: {{gpus: 0, cpus: 1, mem_gb: 1, time: "00:15:00", signal_delay_s: 60}}
"""


def write_configs(folder: Path, jobs: int) -> None:
    shutil.copy(ROOT / "configs" / "base.yaml", folder / "base.yaml")
    runs = folder.parent / "runs"
    (folder / "cluster.yaml").write_text(f"run_dir: {runs}\nlog_dir: {folder.parent / 'logs'}\n")
    (folder / "_shared.yaml").write_text(SHARED.format(root=ROOT))
    for index in range(jobs):
        name = f"bench-{index:04d}"
        (folder / f"{name}.yaml").write_text(f"name: {name}\ninherits: _shared.yaml\n")


def write_sweep(folder: Path, points: int) -> None:
    """One sweep file of `points` points (learning rates x ranks x 3 seeds) beside the shared fragment."""
    rates = ", ".join(f"{1e-5 * 1.1**k:.3g}" for k in range(max(1, points // 30)))
    (folder / "big-sweep.yaml").write_text(
        "name: big-sweep\ninherits: _shared.yaml\nsweep:\n"
        f"  grid: {{train.learning_rate: [{rates}], adapter.rank: [{', '.join(str(2 * r + 2) for r in range(10))}]}}\n"
        "  seeds: [1, 2, 3]\n"
    )


def cpu_timed(argv: list[str], repeat: int) -> float:
    """Least CPU seconds (user + system) of `python launch.py ARGV` in a fresh process."""
    import resource

    best = float("inf")
    for _ in range(repeat):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run([sys.executable, str(ROOT / "launch.py"), *argv], capture_output=True, check=True)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        best = min(best, after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return best


def timed(argv: list[str], repeat: int) -> float:
    """Best wall time of `python launch.py ARGV` in a fresh process (what a user waits for)."""
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        done = subprocess.run(
            [sys.executable, str(ROOT / "launch.py"), *argv], capture_output=True, check=False
        )
        best = min(best, time.perf_counter() - started)
        if done.returncode != 0:
            raise SystemExit(f"launch.py {' '.join(argv)} exited {done.returncode}:\n{done.stderr.decode()}")
    return best


def start_up_s(repeat: int) -> float:
    """What every command pays before it reads a file: Python and the CLI's imports."""
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import launch"], cwd=ROOT, check=True)
        best = min(best, time.perf_counter() - started)
    return best


def torch_free(configs: Path) -> bool:
    """Does a dry run stay torch-free? (the login node must not pay for it)"""
    probe = (
        "import sys, launch; launch.main(['--all', '--dry-run', '--json', '--config-dir', sys.argv[1]]); "
        "print('torch' in sys.modules, file=sys.stderr)"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe, str(configs)], cwd=ROOT, capture_output=True, text=True
    )
    return done.stderr.strip().endswith("False")


def counting_path(folder: Path) -> Path:
    """Wrappers first on PATH that count squeue/sacct calls and hand them to the real commands."""
    log = folder / "calls.log"
    (folder / "bin").mkdir()
    for command in ("squeue", "sacct"):
        real = shutil.which(command)
        if real:
            script = folder / "bin" / command
            script.write_text(f'#!/bin/sh\necho {command} >> "{log}"\nexec "{real}" "$@"\n')
            script.chmod(0o755)
    os.environ["PATH"] = f"{folder / 'bin'}{os.pathsep}{os.environ['PATH']}"
    return log


def calls(log: Path, repeat: int) -> str:
    words = log.read_text().split() if log.is_file() else []
    log.unlink(missing_ok=True)
    return f"{words.count('squeue') / repeat:g} squeue, {words.count('sacct') / repeat:g} sacct per call"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--jobs", type=int, default=300)
    parser.add_argument("--sweep-points", type=int, default=600)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--submit", action="store_true", help="submit (held) to the SLURM on PATH, then cancel"
    )
    args = parser.parse_args(argv)

    base = start_up_s(args.repeat)
    print(
        f"start-up (python + import launch): {base:.2f} s; figures below are whole commands, start-up included"
    )
    with tempfile.TemporaryDirectory() as tmp:
        configs = Path(tmp) / "configs"
        configs.mkdir()
        write_configs(configs, args.jobs)
        log = counting_path(Path(tmp))
        common = ["--config-dir", str(configs)]
        dry = timed(["--all", "--dry-run", *common], args.repeat)
        print(
            f"dry run of {args.jobs} jobs: {dry:.3f} s, {dry - base:.3f} s after start-up (target <= 0.5 s)"
        )
        print(f"dry run imports torch: {not torch_free(configs)}")
        status = timed(["--status", *common], args.repeat)
        print(f"--status of {args.jobs} never-submitted jobs: {status:.3f} s ({calls(log, args.repeat)})")
        if args.submit:
            submit_and_watch(common, args.jobs, args.repeat, log)
    with tempfile.TemporaryDirectory() as tmp:
        configs = Path(tmp) / "configs"
        configs.mkdir()
        write_configs(configs, 0)
        write_sweep(configs, args.sweep_points)
        cpu = cpu_timed(["--all", "--dry-run", "--config-dir", str(configs)], args.repeat)
        print(f"dry run of a {args.sweep_points}-point sweep: {cpu:.2f} s of CPU (target <= 2 s)")
    return 0


def submit_and_watch(common: list[str], jobs: int, repeat: int, log: Path) -> None:
    if not shutil.which("sbatch"):
        raise SystemExit("--submit needs a SLURM on PATH (make cluster; . /tmp/slurm-lora-dev/env.sh)")
    plain_path = os.environ["PATH"]
    holding = log.parent / "hold"
    holding.mkdir()
    (holding / "sbatch").write_text(f'#!/bin/sh\nexec "{shutil.which("sbatch")}" --hold "$@"\n')
    (holding / "sbatch").chmod(0o755)
    os.environ["PATH"] = f"{holding}{os.pathsep}{plain_path}"  # queued held: nothing runs
    try:
        submit = timed(["--all", "--backend", "slurm", *common], 1)
        os.environ["PATH"] = plain_path
        print(f"submit {jobs} jobs (held): {submit:.2f} s ({1000 * submit / jobs:.1f} ms a job)")
        calls(log, 1)
        status = timed(["--status", *common], repeat)
        print(f"--status of {jobs} queued jobs: {status:.3f} s ({calls(log, repeat)}; target <= 1 s)")
    finally:
        os.environ["PATH"] = plain_path
        timed(["--all", "--cancel", *common], 1)
        calls(log, 1)  # the cancel's own status query is not part of what is measured next
    status = timed(["--status", *common], repeat)
    print(f"--status of {jobs} ended jobs: {status:.3f} s ({calls(log, repeat)})")


if __name__ == "__main__":
    sys.exit(main())
