"""The demo's tiny causal experiment as 1 node x 2 ranks and as 2 nodes x 1 rank, on the two-node dev cluster.

    SLURM_DEV_NODES=2 SLURM_PORT_BASE=6917 bash slurm/dev-cluster/up.sh /tmp/slurm-2n
    SLURM_CONF=/tmp/slurm-2n/etc/slurm.conf python -m bench.two_nodes

Prints each run's wall time (submit to COMPLETED, through the real launcher), its last logged losses, and the
two adapters' largest relative difference (the math check: the same examples in each step, so only the
all-reduce's order may differ; LoRA dropout 0, fp32). On CPUs over loopback the times are no speed claim:
both nodes share this machine's cores.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

EXPERIMENT = """\
name: {name}
model: {{name_or_path: {root}/models/tiny-llama, kind: causal}}
adapter: {{rank: 4, alpha: 8, dropout: 0.0, max_trainable_percent: 30}}
data:
  train: {root}/data/demo/sql/easy.jsonl
  input_field: question
  target_field: sql
  prompt_template: "{{schema}} | {{question}} | SQL: "
train: {{epochs: 2, batch_size: 8, learning_rate: 3.0e-3, eval_every_epochs: null, logging_steps: 4}}
eval: {{metrics: []}}
resources: {{{shape}, cpus: 1, mem_gb: 2, time: "00:20:00"}}
"""
SHAPES = {"one-node-x2": "gpus: 2", "two-nodes-x1": "gpus: 1, nodes: 2, partition: multi"}


def adapter_difference(a: Path, b: Path) -> float:
    from safetensors.torch import load_file

    first, second = (load_file(p / "adapter" / "adapter_model.safetensors") for p in (a, b))
    return max(
        float((first[k] - second[k]).abs().max()) / max(1.0, float(second[k].abs().max())) for k in first
    )


def main() -> int:
    from demo.tiny import build_tiny_models

    build_tiny_models(ROOT / "models")
    work = Path(tempfile.mkdtemp(prefix="bench-two-nodes-"))
    configs = work / "configs"
    configs.mkdir()
    (configs / "cluster.yaml").write_text(f"run_dir: {work / 'runs'}\nlog_dir: {work / 'logs'}\n")
    runs = {}
    for name, shape in SHAPES.items():
        (configs / f"{name}.yaml").write_text(EXPERIMENT.format(name=name, root=ROOT, shape=shape))
        started = time.monotonic()
        argv = ["--exp", name, "--config-dir", str(configs), "--backend", "slurm", "--wait"]
        code = subprocess.run([sys.executable, str(ROOT / "launch.py"), *argv], cwd=ROOT).returncode
        runs[name] = (code, time.monotonic() - started, work / "runs" / name / "train")
    for name, (code, seconds, run_dir) in runs.items():
        losses = [
            json.loads(line)["loss"]
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if '"loss"' in line
        ][-3:]
        print(f"{name:14} exit {code}  wall {seconds:6.1f} s  last losses {[round(x, 6) for x in losses]}")
    (_, _, one), (_, _, two) = runs.values()
    print(f"adapters' largest relative difference: {adapter_difference(one, two):.2e} (target <= 1e-4)")
    return max(code for code, _, _ in runs.values())


if __name__ == "__main__":
    sys.exit(main())
