"""What a job's start costs, in CPU seconds (user + sys): figures, not a test (issue 47's targets).

    python -m bench.job_start                    # 3 runs of each figure; medians
    python -m bench.job_start --against DIR      # interleaved with the checkout at DIR (e.g. a worktree of an
                                                 # earlier commit, sharing this venv), paired run by run
    python -m bench.job_start --imports          # what each library adds to a job's imports

Figures, each in fresh processes, as a job or a user pays them:
- imports: what a LoRA training job imports before it does anything (slurm.queueing.jobs, train.stage),
  with what the checkout hides from such a job (train/libraries.py, where it exists);
- first step: the CPU a tiny LoRA training job spent before its first step (summary.json `startup_cpu_s`,
  logged at that step; "n/a" for a checkout that does not record it). Target <= 5 s;
- launch: `launch.py --exp sql-t5-lora --config-dir configs/demo --backend local --wait` on 32 training rows,
  1 epoch, 4 eval prompts: the launcher and every process under it (its jobs, their submitit controllers),
  with a cold cache (the first launch: preflight and tokenization) and a warm one (a relaunch). Target <= 13 s.
Measure on a quiet machine (docs/testing.md: load < 0.5 at the start). The demo's tiny models must be built
(`python -m demo.tiny models`) in each checkout.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HIDE = """\
from train.libraries import hide, unused_libraries
hide(unused_libraries({"adapter": {"method": "lora"}}))
"""


# What each library adds to a job's imports, in the order a job meets them (each step's CPU seconds over the
# steps before it, in one fresh process), bitsandbytes hidden as a LoRA job hides it; with hide=False, what
# `import peft` costs where it is not hidden (a QLoRA job, or this project before issue 47).
STEPS = {
    "torch": "import torch",
    "transformers.modeling_utils": "import transformers.modeling_utils",
    "peft": "import peft",
    "datasets (training jobs only)": "import datasets",
    "transformers.trainer (training jobs only)": "import transformers.trainer",
    "eval metrics (rouge-score, sacrebleu)": "import eval.metrics",
    "trl (DPO only)": "import trl",
    "Qwen-VL processors (image-text only)": "import train.vl_processor",
}
BREAKDOWN = """import json, resource
def cpu():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime
{hide}
figures, last = {{}}, cpu()
for name, code in {steps!r}.items():
    exec(code)
    figures[name], last = cpu() - last, cpu()
print(json.dumps(figures))
"""


def import_breakdown(checkout: Path, hide: bool = True) -> dict[str, float]:
    code = BREAKDOWN.format(hide=HIDE if hide else "", steps=STEPS)
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=checkout, capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.splitlines()[-1])


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def cpu_of(argv: list[str], cwd: Path, env: dict | None = None) -> float:
    """CPU seconds of a command and of every process under it that was waited for (a job's controller
    waits for its task, the launcher for its controllers)."""
    before = children_cpu_s()
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed in {cwd}:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return children_cpu_s() - before


def import_cpu_s(checkout: Path) -> float:
    # Asked of the checkout's files, not by import: this venv's editable install would find train/libraries.py
    # of this checkout for another that has none.
    hides = (checkout / "train" / "libraries.py").is_file()
    code = (HIDE if hides else "") + "import slurm.queueing.jobs, train.stage"
    return cpu_of([sys.executable, "-c", code], checkout)


def launch_cpu_s(checkout: Path) -> dict[str, float | None]:
    """The launch's CPU with its children, twice in one fresh cache (LORA_CACHE_DIR): cold (the launcher's
    preflight imports torch, tokenizes and estimates memory; the job tokenizes) and warm (a relaunch after
    a change of the training's settings: both read their caches); and the training job's CPU before its
    first step in the warm launch."""
    with tempfile.TemporaryDirectory(prefix="job-start-") as tmp:
        folder = Path(tmp)
        configs = folder / "configs"
        shutil.copytree(checkout / "configs" / "demo", configs)
        shutil.copy(checkout / "configs" / "base.yaml", configs)
        rows = (checkout / "data" / "demo" / "sql" / "train.jsonl").read_text().splitlines()[:32]
        (folder / "train.jsonl").write_text("\n".join(rows) + "\n")
        env = os.environ | {"LORA_CACHE_DIR": str(folder / "cache")}
        figures = {}
        for run in ("cold", "warm"):
            runs = folder / run
            (configs / "cluster.yaml").write_text(f"run_dir: {runs / 'runs'}\nlog_dir: {runs / 'logs'}\n")
            argv = [sys.executable, "launch.py", "--exp", "sql-t5-lora", "--config-dir", str(configs)]
            argv += ["--backend", "local", "--wait", f"data.train={folder / 'train.jsonl'}"]
            argv += ["train.epochs=1", "eval.limit=4"]
            figures[f"launch, {run} cache"] = cpu_of(argv, checkout, env)
        summary = json.loads((runs / "runs" / "sql-t5-lora" / "train" / "summary.json").read_text())
        return figures | {"first step": summary.get("startup_cpu_s")}


def measure(checkout: Path) -> dict[str, float | None]:
    return {"imports": import_cpu_s(checkout)} | launch_cpu_s(checkout)


def median(values: list) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def text(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.job_start", description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--against", type=Path, help="another checkout, measured in turn with this one")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--imports", action="store_true", help="only what each library adds to the imports")
    args = parser.parse_args(argv)
    if args.imports:
        return print_breakdown(args.repeat)
    checkouts = {"this": ROOT} | ({"against": args.against.resolve()} if args.against else {})
    runs: dict[str, list[dict]] = {name: [] for name in checkouts}
    for _ in range(args.repeat):
        for name, checkout in checkouts.items():  # interleaved: a drift in the machine's speed hits both
            runs[name].append(measure(checkout))
    figures = {
        name: {key: median([run[key] for run in rows]) for key in rows[0]} for name, rows in runs.items()
    }
    if args.json:
        print(json.dumps({"runs": runs, "medians": figures}, indent=1))
        return 0
    print(f"CPU seconds (user + sys), median of {args.repeat}:")
    for key in runs["this"][0]:
        line = f"  {key:<18} " + "  ".join(f"{name} {text(figures[name][key])}" for name in checkouts)
        if args.against:
            pairs = [
                a[key] / b[key]
                for a, b in zip(runs["this"], runs["against"], strict=True)
                if a[key] is not None and b[key]
            ]
            line += f"  (this/against, pair by pair: {' '.join(f'{p:.2f}' for p in pairs) or 'n/a'})"
        print(line)
    return 0


def print_breakdown(repeat: int) -> int:
    hidden = [import_breakdown(ROOT) for _ in range(repeat)]
    shown = [import_breakdown(ROOT, hide=False) for _ in range(repeat)]
    print(f"CPU seconds each import adds, in this order, median of {repeat}:")
    for name in STEPS:
        print(f"  {name:<40} {median([run[name] for run in hidden]):.2f}")
    peft_with = median([run["peft"] for run in shown])
    print(f"  {'peft where bitsandbytes is not hidden':<40} {peft_with:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
