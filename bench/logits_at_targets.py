"""The output layer at the target positions only, against logits at every position: one training step of
the Qwen2.5-0.5B shape on the prompt-heavy data shape, A B A B in one process. Prints figures.

    python -m bench.logits_at_targets [--layers 24] [--pairs 2] [--batch 2] [--profile] [--json]

A step is what the trainer's compute_loss and backward do: the adapted model's forward (LoRA r16 on every
linear layer, random weights, fp32 on a CPU, bf16 autocast on a GPU), the trainer's loss (train/loss.py
TargetTokenLoss, the token-mean cross-entropy) and the backward. "everywhere": the model's whole logits, as
a tuned HF Trainer computes them (its model's own loss takes every position's logits); "at targets": inside
`output_at_targets`, as our trainer runs it. The batch: `--batch` examples of a 240-token prompt and a
30-token answer (bench/gpu_throughput.py's data shape: ~89 % of the positions carry no label). Untimed
warm-up of each path first, then the pairs alternate; the median of each, their spread and the ratio.
`--profile`: then one more step of each path under torch.profiler, its costliest operators by own time, to
say where a step's time goes when the ratio falls short of the FLOPs' prediction.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from bench.gpu_throughput import LORA, QWEN_05B
from core.config import AdapterSpec
from train.device import current
from train.loss import TargetTokenLoss
from train.model import new_adapter

PROMPT, ANSWER = 240, 30


def adapted(layers: int, device: str, dtype: torch.dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("qwen2", **(QWEN_05B | {"num_hidden_layers": layers}))
    torch.manual_seed(0)
    with torch.device(device):
        base = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return new_adapter(base, AdapterSpec(**LORA), "causal")


def batch_of(examples: int, vocab: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, vocab, (examples, PROMPT + ANSWER), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[:, :PROMPT] = -100
    return ids.to(device), labels.to(device)


def step(model, loss: TargetTokenLoss, ids, labels, at_targets: bool, autocast) -> float:
    """Seconds of one forward, loss and backward."""
    model.zero_grad(set_to_none=True)
    if ids.is_cuda:
        torch.cuda.synchronize()
    started = time.perf_counter()
    with autocast():
        if at_targets:
            with loss.output_at_targets(model, labels):
                value = loss(model(input_ids=ids), labels)
        else:
            value = loss(model(input_ids=ids), labels)
    value.backward()
    if ids.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    placement = current("auto")
    model = adapted(args.layers, placement.device, placement.load_dtype)
    ids, labels = batch_of(args.batch, QWEN_05B["vocab_size"], placement.device)
    loss = TargetTokenLoss(shifted=True)

    def autocast():
        kind = "cuda" if placement.cuda else "cpu"
        return torch.autocast(kind, dtype=torch.bfloat16, enabled=placement.bf16)

    for at_targets in (False, True):  # untimed warm-up of each path
        step(model, loss, ids, labels, at_targets, autocast)
    times: dict[str, list[float]] = {"everywhere": [], "at_targets": []}
    for _ in range(args.pairs):
        times["everywhere"].append(step(model, loss, ids, labels, False, autocast))
        times["at_targets"].append(step(model, loss, ids, labels, True, autocast))
    ratios = [a / b for a, b in zip(times["everywhere"], times["at_targets"], strict=True)]
    result = {
        "device_name": placement.device_name,
        "threads": torch.get_num_threads(),
        "layers": args.layers,
        "batch": f"{args.batch} x ({PROMPT} prompt + {ANSWER} answer)",
        "step_s": {
            k: {"median": round(statistics.median(v), 3), "min": round(min(v), 3), "max": round(max(v), 3)}
            for k, v in times.items()
        },
        "speedup_pairwise": {
            "median": round(statistics.median(ratios), 3),
            "min": round(min(ratios), 3),
            "max": round(max(ratios), 3),
        },
    }
    for name, figures in result["step_s"].items():
        print(
            f"{name:11s} step {figures['median']:.3f} s (min {figures['min']:.3f}, max {figures['max']:.3f})"
        )
    print(f"logits everywhere / at the targets only, pair by pair: {result['speedup_pairwise']}")
    if args.profile:
        result["profile"] = {
            name: profiled(lambda at=at: step(model, loss, ids, labels, at, autocast), placement.cuda)
            for name, at in (("everywhere", False), ("at_targets", True))
        }
    if args.json:
        print(json.dumps(result))
    return result


def profiled(run, cuda: bool, top: int = 8) -> list[dict]:
    """The `top` operators of one `run()` by their own time (ms), each with its share of the step, printed."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as prof:
        run()
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, attr), reverse=True)
    total = sum(getattr(e, attr) for e in events) or 1
    rows = [
        {"op": e.key, "ms": round(getattr(e, attr) / 1e3, 1), "share": round(getattr(e, attr) / total, 3)}
        for e in events[:top]
    ]
    print(f"{round(total / 1e3)} ms in all: " + ", ".join(f"{r['op']} {r['share']:.0%}" for r in rows))
    return rows


if __name__ == "__main__":
    main()
