"""The GPU acceptance check: what CPU tests cannot show, in one command on a CUDA machine (a few minutes).

    python -m bench.gpu_check [--skip-demo] [--skip-throughput]

Prints one JSON object. Each part either reports its figures or says, under "skipped", why it did not run
(no CUDA GPU, a missing package, one GPU only):

- "demo": the demo's LoRA (sql-t5-lora) and QLoRA (sql-llama-qlora-curriculum) experiments through
  `launch.py --backend local --wait`, runs and logs in a temporary folder: each stage's device and
  precision from summary.json, whether its loss fell, and whether metrics.jsonl carries NVML readings.
- "memory": preflight's estimate (train/memory.py, on the meta device) against the whole step's
  `torch.cuda.max_memory_allocated` (forward, loss, backward, AdamW step) of a Qwen2.5-0.5B-shaped model
  built from its config with random weights, LoRA r16 on every linear layer, at two shapes.
- "throughput": bench/gpu_throughput.py's JSON: the Qwen2.5-0.5B shape at ~240-token prompts, our trainer
  (micro_batch auto and as written) against tuned HF (and HF + Liger where installed), tokens/s, wall, peak
  GB, MFU, the split auto chose, and its checks (two splits' adapters agree; the estimate against the peak).

The demo part runs beside the memory part (both are checks, not timings), the throughput part alone after
them: the whole command answers in about three minutes on one H100.
- "ddp": with 2 GPUs or more, sql-t5-lora on 2 ranks (nccl) against 1 rank at the same global batch:
  the final train losses and each run's wall time.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LORA_DEMO, QLORA_DEMO = "sql-t5-lora", "sql-llama-qlora-curriculum"
MEMORY_SHAPES = [(2, 512), (4, 1024)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--skip-demo", action="store_true")
    parser.add_argument("--skip-throughput", action="store_true")
    args = parser.parse_args(argv)
    import torch

    report: dict = {"skipped": {}}
    if not torch.cuda.is_available():
        report["skipped"]["everything"] = "no CUDA GPU here (torch.cuda.is_available() is False)"
        print(json.dumps(report))
        return 0
    gpus = torch.cuda.device_count()
    report["gpu"] = {"name": torch.cuda.get_device_name(), "count": gpus, "torch": torch.__version__}
    demo = None if args.skip_demo else Background(demo_runs)
    parts = {
        "memory": memory_rows,
        "demo": demo.result if demo else None,
        "throughput": None if args.skip_throughput else throughput,
        "ddp": ddp_against_one_rank if gpus >= 2 else None,
    }
    reasons = {"demo": "--skip-demo", "throughput": "--skip-throughput", "ddp": f"{gpus} GPU: needs 2"}
    for name, part in parts.items():
        if part is None:
            report["skipped"][name] = reasons[name]
            continue
        try:
            report[name] = part()
        except Exception as exc:  # one failing part must not hide the others' figures
            report["skipped"][name] = f"failed: {type(exc).__name__}: {exc}"
    report["wall_s"] = round(time.monotonic() - STARTED, 1)
    print(json.dumps(report, indent=1))
    return 0


STARTED = time.monotonic()


class Background:
    """A part run in a thread (its work is in subprocesses), its result or exception taken later."""

    def __init__(self, part):
        self.value, self.error = None, None
        self.thread = threading.Thread(target=self.run, args=(part,), daemon=True)
        self.thread.start()

    def run(self, part) -> None:
        try:
            self.value = part()
        except Exception as exc:  # handed to the caller by result()
            self.error = exc

    def result(self):
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.value


def demo_folder(tmp: Path, extra_cluster: str = "") -> Path:
    """configs/demo and base.yaml under tmp, with a cluster.yaml that keeps runs and logs there too."""
    configs = tmp / "configs"
    shutil.copytree(ROOT / "configs" / "demo", configs / "demo")
    for name in ("base.yaml", "baselines.yaml"):
        if (ROOT / "configs" / name).exists():
            shutil.copy(ROOT / "configs" / name, configs / name)
    (configs / "cluster.yaml").write_text(
        f"run_dir: {tmp / 'runs'}\nlog_dir: {tmp / 'logs'}\nlocal_parallel_jobs: 1\n{extra_cluster}"
    )
    return configs / "demo"


def launch_local(folder: Path, experiments: list[str], *overrides: str) -> float:
    """Run experiments to the end on this machine; the wall time in seconds."""
    started = time.monotonic()
    command = [sys.executable, "launch.py", "--exp", *experiments, "--config-dir", str(folder)]
    command += ["--backend", "local", "--wait", "--no-preflight", *overrides]
    subprocess.run(command, cwd=ROOT, check=True, capture_output=True, text=True)
    return time.monotonic() - started


def demo_runs() -> dict:
    subprocess.run([sys.executable, "-m", "demo.tiny", "models"], cwd=ROOT, check=True, capture_output=True)
    with tempfile.TemporaryDirectory() as tmp:
        # The base-model rows are left out: the check is that each kind trains and evaluates on the GPU.
        wall = launch_local(demo_folder(Path(tmp)), [LORA_DEMO, QLORA_DEMO], "eval.baseline=false")
        stages = {}
        for summary in sorted((Path(tmp) / "runs").glob("*/*/summary.json")):
            stage = summary.parent
            facts = json.loads(summary.read_text())
            rows = [json.loads(line) for line in (stage / "metrics.jsonl").read_text().splitlines() if line]
            losses = [row["loss"] for row in rows if "loss" in row]
            stages[f"{stage.parent.name}/{stage.name}"] = {
                "device": facts.get("device"),
                "device_name": facts.get("device_name"),
                "precision": facts.get("precision"),
                "loss_first_last": [losses[0], losses[-1]] if losses else None,
                "loss_fell": bool(losses) and losses[-1] < losses[0],
                "nvml_rows": sum(1 for row in rows if "gpu_util_percent" in row),
            }
    return {"wall_s": round(wall, 1), "stages": stages}


def memory_rows() -> list[dict]:
    """Preflight's estimate of the training step (train/preflight.py's own call) against the step's measured
    peak, per shape. Both in GB (10**9 bytes); the estimate's CUDA reserve is left out (it is not allocated)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from bench.gpu_throughput import QWEN_05B
    from spec.config import AdapterSpec, TrainJob
    from train.loss import TargetTokenLoss
    from train.memory import CUDA_RESERVE_GB, GB
    from train.model import new_adapter
    from train.preflight import measure_memory

    adapter = {
        "rank": 16,
        "alpha": 32,
        "dropout": 0.0,
        "target_modules": "all-linear",
        "max_trainable_percent": 100,
    }
    config = AutoConfig.for_model("qwen2", **QWEN_05B)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        config.save_pretrained(tmp)
        for batch, length in MEMORY_SHAPES:
            job = TrainJob(
                experiment="gpu-check",
                stage="memory",
                model={"name_or_path": tmp, "kind": "causal"},
                adapter=adapter,
                data={
                    "train": str(ROOT / "data/demo/sql/train.jsonl"),
                    "input_field": "question",
                    "target_field": "sql",
                },
                train={"batch_size": batch, "precision": "bf16", "eval_every_epochs": None},
                run_dir=str(Path(tmp) / "run"),
            )
            shape = {
                "batch_size": batch,
                "max_length": length,
                "max_target_length": length,
                "gradient_checkpointing": False,
                "grad_accum": 1,
            }
            predicted = measure_memory(job, shape, None).train_gb - CUDA_RESERVE_GB
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            with torch.device("cuda"):
                base = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
            model = new_adapter(base, AdapterSpec(**adapter), "causal")
            optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], fused=True)
            loss_of = TargetTokenLoss(shifted=True)
            ids = torch.randint(0, QWEN_05B["vocab_size"], (batch, length), device="cuda")
            for _ in range(2):  # the second step holds AdamW's moments, as every later step does
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = loss_of(model(input_ids=ids), ids)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            measured = torch.cuda.max_memory_allocated() / GB
            rows.append(
                {
                    "shape": f"{batch}x{length}",
                    "estimate_gb": round(predicted, 3),
                    "measured_gb": round(measured, 3),
                    "error_percent": round(100 * (predicted / measured - 1), 1),
                }
            )
            del base, model, optimizer, loss
    return rows


def throughput() -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "bench.gpu_throughput", "--json"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def ddp_against_one_rank() -> dict:
    figures = {}
    for gpus, batch in ((1, 8), (2, 4)):  # the same global batch
        with tempfile.TemporaryDirectory() as tmp:
            wall = launch_local(
                demo_folder(Path(tmp)), [LORA_DEMO], f"resources.gpus={gpus}", f"train.batch_size={batch}"
            )
            summary = json.loads((Path(tmp) / "runs" / LORA_DEMO / "train" / "summary.json").read_text())
            figures[f"{gpus}_rank"] = {
                "wall_s": round(wall, 1),
                "train_loss": summary.get("train_loss"),
                "eval_loss": summary.get("best_eval_loss") or summary.get("eval_loss"),
                "world_size": summary.get("world_size"),
                "rank_devices": summary.get("rank_devices"),
            }
    return figures


if __name__ == "__main__":
    sys.exit(main())
