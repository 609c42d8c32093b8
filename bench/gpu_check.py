"""The GPU acceptance check: what CPU tests cannot show, in one command on a CUDA machine, in parts that each
end within about three minutes on one H100 and print their figures as they end (a run stopped by a time limit
keeps what it measured); on a CPU, the throughput part's rows on a tiny model, the rest skipped with the reason.

    python -m bench.gpu_check [--part throughput|memory|demo|all]

Prints one JSON line per part as it ends, then one JSON object with them all and the commit they were measured
at. Each part either reports its figures or says, under "skipped", why it did not run (no CUDA GPU, a missing
package, one GPU only):

- "memory": preflight's estimate (train/memory.py, on the meta device) against the whole step's
  `torch.cuda.max_memory_allocated` (forward, loss, backward, AdamW step) of a Qwen2.5-0.5B-shaped model
  built from its config with random weights, LoRA r16 on every linear layer, at two shapes with the plain
  loss and one with the fused loss (where liger-kernel is installed); "fused_loss": Liger's fused linear
  cross-entropy against the plain loss on that model: the loss and the LoRA gradients (relative difference,
  cosine); and "grpo_memory": a GRPO stage's whole step on that model (TRL's GRPOTrainer, the generation of
  the step's completions included: bench/preflight_memory.py measured_grpo on CUDA) against preflight's
  estimate of it, at GRPO_SHAPES (needs TRL).
- "demo": the demo's LoRA (sql-t5-lora) and QLoRA (sql-llama-qlora-curriculum) experiments through
  `launch.py --backend local --wait`, three tiny jobs at a time sharing the GPU (each planning for a third of
  its memory), runs and logs in a temporary folder: each stage's device and precision from summary.json,
  whether its loss fell, and whether metrics.jsonl carries NVML readings; and "ddp": with 2 GPUs or more,
  sql-t5-lora on 2 ranks (nccl) against 1 rank at the same global batch: the final train losses and each
  run's wall time.
- "throughput": bench/gpu_throughput.py's JSON: the Qwen2.5-0.5B shape at ~240-token prompts, warm, rows
  interleaved and repeated: tuned HF at the user's 4x8, tuned HF plain and + Liger at the split auto chose,
  ours auto, HF and ours at 8x1; the split gain and the trainer at equal split; the peak allocated and
  reserved over the epoch (dynamic padding); its checks (two different splits' adapters agree; the estimate
  against the measured peak).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LORA_DEMO, QLORA_DEMO = "sql-t5-lora", "sql-llama-qlora-curriculum"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--part", choices=[*PARTS, "all"], default="all")
    args = parser.parse_args(argv)
    import torch

    from bench.gpu_throughput import commit
    from train.device import Hardware
    from train.loss import liger_installed

    report: dict = {"commit": commit(), "skipped": {}}
    hardware = Hardware.detect()  # train/device.py: what the trainer itself sees
    gpus = hardware.cuda_devices
    cuda = gpus > 0
    if cuda:
        report["gpu"] = {"name": hardware.name, "count": gpus, "torch": torch.__version__}
    no_gpu = "no CUDA GPU here (torch.cuda.is_available() is False)"
    checks = {  # a CPU runs the throughput part only, on a tiny model: the same rows, figures that run here
        "memory": memory_rows if cuda else None,
        "fused_loss": fused_against_plain if cuda and liger_installed() else None,
        "grpo_memory": grpo_memory_rows if cuda and trl_installed() else None,
        "demo": demo_runs if cuda else None,
        "ddp": ddp_against_one_rank if gpus >= 2 else None,
        "throughput": throughput,
    }
    reasons = {
        "memory": no_gpu,
        "fused_loss": "liger-kernel is not installed (pip install -e '.[gpu]')" if cuda else no_gpu,
        "grpo_memory": "TRL is not installed" if cuda else no_gpu,
        "demo": no_gpu,
        "ddp": f"{gpus} GPU: needs 2",
    }
    for part in PARTS if args.part == "all" else [args.part]:
        started = time.monotonic()
        for name in PARTS[part]:
            check = checks[name]
            if check is None:
                report["skipped"][name] = reasons[name]
                continue
            try:
                report[name] = check()
            except Exception as exc:  # one failing check must not hide the others' figures
                report["skipped"][name] = f"failed: {type(exc).__name__}: {exc}"
        figures = {name: report.get(name, report["skipped"].get(name)) for name in PARTS[part]}
        print(json.dumps({"part": part, "part_s": round(time.monotonic() - started, 1), **figures}))
        sys.stdout.flush()
    report["wall_s"] = round(time.monotonic() - STARTED, 1)
    print(json.dumps(report, indent=1))
    return 0


PARTS = {
    "memory": ("memory", "fused_loss", "grpo_memory"),
    "demo": ("demo", "ddp"),
    "throughput": ("throughput",),
}
STARTED = time.monotonic()


def demo_folder(tmp: Path, extra_cluster: str = "", parallel: int = 1) -> Path:
    """configs/demo and base.yaml under tmp, with a cluster.yaml that keeps runs and logs there too."""
    configs = tmp / "configs"
    shutil.copytree(ROOT / "configs" / "demo", configs / "demo")
    for name in ("base.yaml", "baselines.yaml"):
        if (ROOT / "configs" / name).exists():
            shutil.copy(ROOT / "configs" / name, configs / name)
    (configs / "cluster.yaml").write_text(
        f"run_dir: {tmp / 'runs'}\nlog_dir: {tmp / 'logs'}\nlocal_parallel_jobs: {parallel}\n{extra_cluster}"
    )
    return configs / "demo"


def launch_local(folder: Path, experiments: list[str], *overrides: str, env: dict | None = None) -> float:
    """Run experiments to the end on this machine; the wall time in seconds."""
    started = time.monotonic()
    command = [sys.executable, "launch.py", "--exp", *experiments, "--config-dir", str(folder)]
    command += ["--backend", "local", "--wait", "--no-preflight", *overrides]
    subprocess.run(command, cwd=ROOT, check=True, capture_output=True, text=True, env=env)
    return time.monotonic() - started


SHARED_JOBS = 3


def demo_runs() -> dict:
    subprocess.run([sys.executable, "-m", "demo.tiny", "models"], cwd=ROOT, check=True, capture_output=True)
    with tempfile.TemporaryDirectory() as tmp:
        # The base-model rows are left out: the check is that each kind trains and evaluates on the GPU.
        # The tiny jobs share GPU 0, SHARED_JOBS at a time: the launcher is shown it that many times over
        # (slurm/cluster/local_gpus.py: that many slots, each job planning for its share of the memory).
        env = os.environ | {"CUDA_VISIBLE_DEVICES": ",".join(["0"] * SHARED_JOBS)}
        folder = demo_folder(Path(tmp), parallel=SHARED_JOBS)
        wall = launch_local(folder, [LORA_DEMO, QLORA_DEMO], "eval.baseline=false", env=env)
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
    """Preflight's estimate of the training step (train/memory_figures.py's own call) against the step's measured
    peak, per shape, with the plain loss and, where Liger is installed, the fused one. Both in GB (10**9
    bytes); the estimate's CUDA reserve is left out (it is not allocated)."""
    import torch

    from train.loss import liger_installed
    from train.memory import CUDA_RESERVE_GB, GB
    from train.memory_figures import measure_memory

    shapes = [(b, n, False) for b, n in MEMORY_SHAPES]
    shapes += [(b, n, True) for b, n in FUSED_SHAPES] if liger_installed() else []
    rows = []
    with qwen_shaped() as (folder, config):
        for batch, length, fused in shapes:
            job = memory_job(folder, batch)
            shape = {
                "batch_size": batch,
                "max_length": length,
                "max_target_length": length,
                "gradient_checkpointing": False,
                "grad_accum": 1,
            }
            predicted = measure_memory(job, shape, None, fused).train_gb - CUDA_RESERVE_GB
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            model, loss_of = adapted_on_gpu(config, fused)
            optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], fused=True)
            ids = torch.randint(0, config.vocab_size, (batch, length), device="cuda")
            for _ in range(2):  # the second step holds AdamW's moments, as every later step does
                loss = loss_step(model, loss_of, ids)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            measured = torch.cuda.max_memory_allocated() / GB
            rows.append(
                {
                    "shape": f"{batch}x{length}",
                    "loss": "fused (Liger)" if fused else "plain",
                    "estimate_gb": round(predicted, 3),
                    "measured_gb": round(measured, 3),
                    "error_percent": round(100 * (predicted / measured - 1), 1),
                }
            )
            del model, optimizer, loss
    return rows


MEMORY_SHAPES = [(2, 512), (4, 1024)]
# (prompts per step, num_generations, micro-batch in completions, prompt tokens, completion tokens, beta)
GRPO_SHAPES = [(8, 8, 8, 128, 256, 0.0), (4, 8, 4, 128, 256, 0.04)]


def trl_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("trl") is not None


def grpo_memory_rows() -> list[dict]:
    """A GRPO step's estimate (bench/preflight_memory.py estimated_grpo: the larger of its training and its
    generation) against TRL's whole step measured on this GPU, in GB (10**9 bytes), reserve left out."""
    import torch

    from bench import preflight_memory as bench
    from train.memory import GB

    rows = []
    with qwen_shaped() as (folder, _):
        for prompts, generations, micro, prompt, completion, beta in GRPO_SHAPES:
            job = bench.grpo_job(memory_job(folder, 1), prompts, generations, micro, completion, beta)
            predicted = bench.estimated_grpo(job, prompt)
            torch.cuda.empty_cache()
            measured = bench.measured_grpo(job, prompt, cuda=True)["train"]
            rows.append(
                {
                    "completions": prompts * generations,
                    "micro_batch": micro,
                    "tokens": f"{prompt}+{completion}",
                    "beta": beta,
                    "peak": predicted["peak"],
                    "estimate_gb": round(predicted["train"] / GB, 3),
                    "measured_gb": round(measured / GB, 3),
                    "error_percent": round(100 * (predicted["train"] / measured - 1), 1),
                }
            )
    return rows


FUSED_SHAPES = [(16, 512)]


@contextmanager
def qwen_shaped():
    """(folder, config): the Qwen2.5-0.5B shape's config.json in a temporary folder."""
    from transformers import AutoConfig

    from bench.gpu_throughput import QWEN_05B

    config = AutoConfig.for_model("qwen2", **QWEN_05B)
    with tempfile.TemporaryDirectory() as tmp:
        config.save_pretrained(tmp)
        yield tmp, config


def memory_job(folder: str, batch: int):
    from core.config import TrainJob

    return TrainJob(
        experiment="gpu-check",
        stage="memory",
        model={"name_or_path": folder, "kind": "causal"},
        adapter=ADAPTER,
        data={
            "train": str(ROOT / "data/demo/sql/train.jsonl"),
            "input_field": "question",
            "target_field": "sql",
        },
        train={"batch_size": batch, "precision": "bf16", "eval_every_epochs": None},
        run_dir=str(Path(folder) / "run"),
    )


ADAPTER = {
    "rank": 16,
    "alpha": 32,
    "dropout": 0.0,
    "target_modules": "all-linear",
    "max_trainable_percent": 100,
}


def adapted_on_gpu(config, fused: bool, seed: int = 0):
    """(the model with LoRA r16 on every linear layer, bf16 on cuda, random weights; the trainer's loss)."""
    import torch
    from transformers import AutoModelForCausalLM

    from core.config import AdapterSpec
    from train.loss import TargetTokenLoss, liger_linear_cross_entropy
    from train.model import new_adapter

    torch.manual_seed(seed)
    with torch.device("cuda"):
        base = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model = new_adapter(base, AdapterSpec(**ADAPTER), "causal")
    return model, TargetTokenLoss(shifted=True, fused=liger_linear_cross_entropy if fused else None)


def loss_step(model, loss_of, ids):
    import torch

    with torch.autocast("cuda", dtype=torch.bfloat16), loss_of.output_at_targets(model, ids):
        return loss_of(model(input_ids=ids), ids)


def fused_against_plain() -> dict:
    """Liger's fused loss against the plain one on the same model and batch (8 x 256, the 0.5B shape with
    its 152k vocabulary): the loss, and the LoRA gradients as one vector (relative difference, cosine)."""
    import torch

    from train.loss import TargetTokenLoss, liger_linear_cross_entropy

    with qwen_shaped() as (_, config):
        model, plain = adapted_on_gpu(config, fused=False)
        fused = TargetTokenLoss(shifted=True, fused=liger_linear_cross_entropy)  # one model, two losses
        ids = torch.randint(0, config.vocab_size, (8, 256), device="cuda")
        figures = {}
        for name, loss_of in (("plain", plain), ("fused", fused)):
            model.zero_grad(set_to_none=True)
            loss = loss_step(model, loss_of, ids)
            loss.backward()
            grads = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.requires_grad])
            figures[name] = (loss.item(), grads)
    (plain_loss, a), (fused_loss, b) = figures["plain"], figures["fused"]
    return {
        "loss_plain": round(plain_loss, 5),
        "loss_fused": round(fused_loss, 5),
        "loss_relative_difference": abs(fused_loss - plain_loss) / abs(plain_loss),
        "grad_relative_difference": float((a - b).norm() / a.norm()),
        "grad_cosine": float(torch.nn.functional.cosine_similarity(a, b, dim=0)),
    }


def throughput() -> dict:
    """bench/gpu_throughput.py's JSON; its rows go to stderr as each ends (a stopped run keeps them)."""
    done = subprocess.run(
        [sys.executable, "-m", "bench.gpu_throughput", "--json"],
        cwd=ROOT,
        check=True,
        stdout=subprocess.PIPE,
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
