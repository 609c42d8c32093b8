"""Packed vs separate jobs on the dev cluster: a seed-like scenario of five experiments (two single-stage, a
3-stage and a 2-stage curriculum, one `after:` another) with the tiny models.

    make cluster && SLURM_CONF=/tmp/slurm-lora-dev/etc/slurm.conf python -m bench.packing

Runs the scenario as separate jobs (which fills the speed book), then packed on --gpus lanes with the speed
book copied over, and prints: wall time from submission to the last job's end (each), the pack's lane
utilisation (busy lane-seconds ÷ (lanes × span of the lanes), from each unit's lane.json; target ≥ 85%)
and the estimate error of each unit (|estimated − actual| ÷ actual; target median ≤ 25% once the speed
book has a record). Figures, not a test: tests/test_cluster_pack.py checks behaviour.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

BASE = """\
model: {{name_or_path: {root}/models/tiny-llama, kind: causal}}
adapter: {{rank: 8, alpha: 16, dropout: 0.0, max_trainable_percent: 30}}
data:
  train: {root}/data/demo/sql/easy.jsonl
  eval: {root}/data/demo/sql/dev.jsonl
  input_field: question
  target_field: sql
  prompt_template: "{{schema}} | {{question}} | SQL: "
train: {{epochs: 1, learning_rate: 3.0e-3, batch_size: 8, save_every_steps: 8, logging_steps: 4,
        eval_every_epochs: null}}
eval: {{metrics: []}}
resources: {{gpus: 1, cpus: 1, mem_gb: 2, time: "00:20:00", signal_delay_s: 60}}
"""
SQL = "{root}/data/demo/sql"
SCENARIO = {
    "single-a": "eval: {{metrics: [exact_match], limit: 8, max_new_tokens: 16}}\n",
    "single-b": "",
    "three": (
        "stages:\n"
        "  - {{name: easy}}\n"
        f"  - {{{{name: medium, data: {{{{train: {SQL}/medium.jsonl}}}}}}}}\n"
        f"  - {{{{name: long, data: {{{{train: {SQL}/train.jsonl}}}}, train: {{{{epochs: 12}}}}}}}}\n"
    ),
    "two": f"stages:\n  - {{{{name: easy}}}}\n  - {{{{name: hard, data: {{{{train: {SQL}/hard.jsonl}}}}}}}}\n",
    "later": "after: [single-a]\n",
}


def scenario(root: Path, tmp: Path, experiments: dict[str, str], cluster: str = "") -> Path:
    """A config folder of `experiments` (name → YAML lines) on the shared base; runs and logs under tmp."""
    folder = tmp / "configs"
    folder.mkdir(parents=True)
    limits = "max_gpus_per_node: 4\nmax_cpus_per_node: 8\nmax_mem_gb_per_node: 15\n"
    (folder / "cluster.yaml").write_text(
        f"run_dir: {tmp / 'runs'}\nlog_dir: {tmp / 'logs'}\n{limits}{cluster}"
    )
    (folder / "_base.yaml").write_text(BASE.format(root=root))
    for name, text in experiments.items():
        (folder / f"{name}.yaml").write_text(f"name: {name}\ninherits: _base.yaml\n{text.format(root=root)}")
    return folder


def launch(folder: Path, *extra: str) -> float:
    """Seconds from `launch.py --all ... --wait` to every job's end."""
    started = time.perf_counter()
    argv = ["--all", "--config-dir", str(folder), "--backend", "slurm", "--no-preflight", "--wait", *extra]
    subprocess.run([sys.executable, str(ROOT / "launch.py"), *argv], check=True, capture_output=True)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gpus", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-packing-") as tmp:
        separate, packed = (
            scenario(ROOT, Path(tmp) / "separate", SCENARIO),
            scenario(ROOT, Path(tmp) / "packed", SCENARIO),
        )
        separate_s = launch(separate)
        runs = Path(tmp) / "packed" / "runs"
        runs.mkdir(parents=True)
        shutil.copy(Path(tmp) / "separate" / "runs" / "speeds.jsonl", runs / "speeds.jsonl")
        plan = subprocess.run(
            [
                sys.executable,
                str(ROOT / "launch.py"),
                "--all",
                "--config-dir",
                str(packed),
                "--dry-run",
                "--json",
                "--pack",
                str(args.gpus),
                "--budget",
                "01:00:00",
            ],
            check=True,
            capture_output=True,
            text=True,
        )
        planned = json.loads(plan.stdout)
        packed_s = launch(packed, "--pack", str(args.gpus), "--budget", "01:00:00")
        lanes = {j["id"]: json.loads((Path(j["run_dir"]) / "lane.json").read_text()) for j in planned["jobs"]}
        busy = sum(lane["ended_s"] - lane["started_s"] for lane in lanes.values())
        span = max(lane["ended_s"] for lane in lanes.values()) - min(
            lane["started_s"] for lane in lanes.values()
        )
        print(
            f"separate jobs: {separate_s:.0f} s from submission to the last end ({len(planned['jobs'])} jobs)"
        )
        print(
            f"packed on {args.gpus} lanes: {packed_s:.0f} s; simulated makespan {planned['packing']['makespan_s']} s; "
            f"lane utilisation {busy / (args.gpus * span):.0%} (busy {busy:.0f} lane-s over {span:.0f} s)"
        )
        errors = []
        for job in planned["jobs"]:
            actual = lanes[job["id"]]["ended_s"] - lanes[job["id"]]["started_s"]
            estimate = job["estimate"]
            errors.append(abs(estimate["seconds"] - actual) / actual)
            print(
                f"  {job['id']:<22} lane {lanes[job['id']]['lane']}  estimate {estimate['seconds']:>4} s "
                f"({estimate['source']})  actual {actual:5.1f} s  error {errors[-1]:.0%}"
            )
        print(f"estimate error: median {statistics.median(errors):.0%}, worst {max(errors):.0%}")


if __name__ == "__main__":
    main()
