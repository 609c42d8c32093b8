"""Guessed speeds for jobs the speed book knows nothing about: rough on purpose, replaced after one run.

Assumed hardware: the job's GPU model when its resources name one (GPUS below), else one NVIDIA A100 per
GPU (312 TFLOP/s bf16 dense, 2 TB/s memory); a job without GPUs runs on a few CPU cores (0.2 TFLOP/s,
20 GB/s). GPUS is also what a speed-book row measured on another GPU model is scaled by (slurm/planning/estimate.py).
- Training: a token costs 4 x N FLOPs under LoRA (forward 2N, backward through the frozen weights 2N, and
  no weight gradients for them), 6 x N with gradient checkpointing (one more forward), at 30% MFU in
  bf16/fp16 (fp32 runs as TF32 at half that peak). QLoRA dequantises every weight at every use: 0.6 x.
  Models below ~1B parameters are bound by kernel launches and Python, not FLOPs: at most 30,000 tokens/s
  per GPU (2,000 on a CPU). Data parallel jobs scale linearly with their GPUs.
- Start-up: 45 s (imports, CUDA context, tokenizing) + reading the weights (2 bytes a parameter) at 1 GB/s.
- In-training eval: forward only, 3 x the training speed. A checkpoint save: 3 s (an adapter and its
  optimizer state are megabytes; the time goes to trainer state, RNG files and fsync).
- Generation (eval jobs): each new token is one decoding step of a batch, bound by reading the weights
  (2N bytes at half the memory bandwidth) and at least 30 ms (per-step overhead of `generate`); beams
  cost sqrt(beams), most of a step's cost being shared.
N, the parameter count, comes from the model's config.json (a local folder, or the Hugging Face cache),
else from its name ("Qwen2.5-0.5B", "flan-t5-base"), else 1B is assumed; read as JSON, never with torch.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

# Per GPU model: (peak dense bf16 tensor TFLOP/s, fp16 where the GPU has no bf16; memory TB/s), from the
# vendors' data sheets (SXM/OAM parts unless the name says PCIe or NVL). One place: guesses on a GPU model
# and the scaling of a speed-book row from one model to another both read it.
GPUS: dict[str, tuple[float, float]] = {
    "B200": (2250, 8.0),
    "GH200": (989, 4.0),
    "H200": (989, 4.8),
    "H100": (989, 3.35),
    "H100 PCIE": (756, 2.0),
    "H100 NVL": (835, 3.9),
    "A100": (312, 2.0),
    "L40S": (362, 0.864),
    "L40": (181, 0.864),
    "L4": (121, 0.3),
    "A40": (150, 0.696),
    "A10": (125, 0.6),
    "A6000": (155, 0.768),  # RTX A6000
    "RTX 4090": (165, 1.0),  # with fp32 accumulation, as torch runs it
    "V100": (125, 0.9),  # fp16: no bf16
    "T4": (65, 0.32),  # fp16: no bf16
    "MI300X": (1307, 5.3),
    "MI250X": (383, 3.2),
}
ASSUMED_GPU = "A100"
CPU_PEAK_FLOPS, CPU_MEMORY_BYTES_PER_S = 0.2e12, 20e9
MAX_TOKENS_PER_S = {"gpu": 30_000, "cpu": 2_000}
MFU = 0.3
QLORA_SPEED = 0.6
EVAL_SPEEDUP = 3.0  # an eval forward pass against a training step
STARTUP_S = 45.0
LOAD_BYTES_PER_S = 1e9
SAVE_S = 3.0
DECODE_STEP_MIN_S = 0.03
UNKNOWN_PARAMETERS = 1e9
SIZE_WORDS = {"small": 60e6, "base": 220e6, "large": 770e6, "xl": 3e9, "xxl": 11e9}  # the T5 family


def device_kind(gpus: int) -> str:
    return "gpu" if gpus > 0 else "cpu"


def gpu_model(text: str | None) -> str | None:
    """The GPUS key named in a device name ("NVIDIA H100 80GB HBM3" → "H100", "NVIDIA A100-SXM4-80GB" →
    "A100") or in a SLURM constraint or partition ("a100_80g", "gpu-h100&ib"); None when none is named.
    A constraint naming several ("a100|h100") gives the slowest: the job may land on any of them."""
    words = re.split(r"[^A-Z0-9]+", (text or "").upper())
    keys = sorted((key.split() for key in GPUS), key=len, reverse=True)  # "H100 PCIE" before "H100"
    found, position = [], 0
    while position < len(words):
        key = next((k for k in keys if words[position : position + len(k)] == k), None)
        found += [" ".join(key)] if key else []
        position += len(key) if key else 1
    return min(found, key=peak_flops, default=None)


def job_gpu(resources, partition: str | None = None) -> str | None:
    """The GPUS model a job with these `resources` will get, when its constraint or its partition
    (cluster.yaml's `partition` when it names none) says; None for a CPU job or when neither does."""
    if not resources.gpus:
        return None
    return gpu_model(resources.constraint) or gpu_model(resources.partition or partition)


def peak_flops(gpu: str | None) -> float:
    """Peak dense bf16 FLOP/s of a GPUS model; the assumed GPU's for an unknown one."""
    return GPUS[gpu if gpu in GPUS else ASSUMED_GPU][0] * 1e12


def peak_bandwidth(gpu: str | None) -> float:
    """Memory bytes/s of a GPUS model; the assumed GPU's for an unknown one."""
    return GPUS[gpu if gpu in GPUS else ASSUMED_GPU][1] * 1e12


def hardware_name(gpus: int, gpu: str | None = None) -> str:
    """What a guess assumes, for its basis: "H100", "A100" (assumed), "CPU"."""
    if not gpus:
        return "CPU"
    return gpu if gpu in GPUS else f"{ASSUMED_GPU} (assumed)"


def training_tokens_per_s(
    parameters: float, gpus: int, method: str, precision: str, checkpointing: bool, gpu: str | None = None
) -> float:
    """The whole job's tokens/s (all its GPUs) on `gpu` (a GPUS model; None: the assumed one)."""
    kind = device_kind(gpus)
    flops_per_token = (6 if checkpointing else 4) * parameters
    peak = peak_flops(gpu) * (0.5 if precision == "fp32" else 1) if gpus else CPU_PEAK_FLOPS
    per_device = min(MFU * peak / flops_per_token, MAX_TOKENS_PER_S[kind])
    return per_device * (QLORA_SPEED if method == "qlora" else 1) * max(1, gpus)


def startup_s(parameters: float) -> float:
    return STARTUP_S + 2 * parameters / LOAD_BYTES_PER_S


def decode_step_s(parameters: float, gpus: int, num_beams: int, gpu: str | None = None) -> float:
    """Seconds for one new token of a whole batch."""
    bandwidth = peak_bandwidth(gpu) if gpus else CPU_MEMORY_BYTES_PER_S
    read_weights = 2 * parameters / (0.5 * bandwidth)
    return max(DECODE_STEP_MIN_S, read_weights) * math.sqrt(num_beams)


def model_parameters(name_or_path: str) -> tuple[float, str]:
    """(parameters, where the number came from)."""
    config = find_config(name_or_path)
    if config is not None:
        counted = parameters_from_config(json.loads(config.read_text()))
        if counted:
            return counted, f"{config}"
    from_name = parameters_from_name(name_or_path)
    if from_name:
        return from_name, "its name"
    return UNKNOWN_PARAMETERS, "assumed: size unknown"


def find_config(name_or_path: str) -> Path | None:
    """config.json of a local folder, or of the newest snapshot of a hub id in the Hugging Face cache."""
    local = Path(name_or_path).expanduser() / "config.json"
    if local.is_file():
        return local
    hub = os.environ.get("HF_HUB_CACHE") or Path(os.environ.get("HF_HOME", "~/.cache/huggingface")) / "hub"
    snapshots = Path(hub).expanduser() / f"models--{name_or_path.replace('/', '--')}" / "snapshots"
    found = (
        sorted(snapshots.glob("*/config.json"), key=lambda p: p.stat().st_mtime) if snapshots.is_dir() else []
    )
    return found[-1] if found else None


def parameters_from_config(config: dict) -> float | None:
    """Weights of a transformer from its shape (attention with grouped KV heads, gated or plain MLP,
    embeddings tied or not); norms and biases left out. None when the config is not of that shape."""
    hidden = config.get("hidden_size") or config.get("d_model") or config.get("n_embd")
    heads = config.get("num_attention_heads") or config.get("num_heads") or config.get("n_head")
    if not hidden or not heads:
        return None
    head_dim = config.get("head_dim") or config.get("d_kv") or hidden // heads
    kv_heads = config.get("num_key_value_heads") or heads
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    ffn = config.get("intermediate_size") or config.get("d_ff") or config.get("n_inner") or 4 * hidden
    gated = (
        config.get("hidden_act") == "silu"
        or config.get("is_gated_act")
        or "gated" in str(config.get("feed_forward_proj", ""))
    )
    mlp = (3 if gated else 2) * hidden * ffn
    layers = config.get("num_hidden_layers") or config.get("num_layers") or config.get("n_layer") or 0
    blocks = layers * (attention + mlp)
    if config.get("is_encoder_decoder"):  # decoder layers add cross-attention
        blocks += config.get("num_decoder_layers", layers) * (2 * attention + mlp)
    embeddings = config.get("vocab_size", 0) * hidden * (1 if config.get("tie_word_embeddings", True) else 2)
    return float(blocks + embeddings)


def parameters_from_name(name: str) -> float | None:
    """'Qwen2.5-0.5B' → 5e8, 'Llama-3.1-8B-Instruct' → 8e9, 'opt-350m' → 3.5e8, 'flan-t5-base' → 2.2e8."""
    last = name.rstrip("/").split("/")[-1]
    count = re.search(r"(?<![\w.])(\d+(?:\.\d+)?)([bBmM])(?![a-zA-Z])", last.replace("_", "-"))
    if count:
        return float(count.group(1)) * (1e9 if count.group(2) in "bB" else 1e6)
    word = re.search(r"(?:^|-)(small|base|large|xl|xxl)(?:$|-)", last.lower().replace("_", "-"))
    return SIZE_WORDS[word.group(1)] if word else None
