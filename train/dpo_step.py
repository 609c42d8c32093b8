"""What a DPO step is, for the trainer (train/preference.py) and the memory model (train/memory_figures.py): which
reference it compares against, and its output layer as TRL runs it. Apart from the trainer so that preflight
can ask without importing the trainer (which imports the memory figures for its split)."""

from __future__ import annotations


def reference_of(job) -> str:
    """A DPO or GRPO stage's reference as it runs: the written one, else previous after a stage and base for
    a first."""
    train = job.train
    written = (train.reward_objective if train.method == "grpo" else train.preference).reference
    return written or ("previous" if job.init_adapter else "base")


# TRL's DPO step asks its fused LM head for these per-token fields (trl 1.16 DPOTrainer.__init__)
FUSED_OUTPUTS = ("log_probs", "entropy", "mean_logits", "is_top1")


def fused_log_prob_loss(hidden, weight, targets, reduction: str):
    """TRL's fused LM head at the answer tokens (its chunked log-prob function, as a GPU step runs it: only
    the positions with a target): minus their log-probabilities, summed or per token. The memory model's
    stand-in for a DPO step's output layer (train/memory.py), in train/loss.py's LinearCrossEntropy form."""
    from train.trl_seams import imported

    chunked = imported("trl.trainer.utils", "_ChunkedLogProbFunction")
    chunk_size = imported("trl.trainer.utils", "_CHUNKED_LOGPROB_CHUNK_SIZE")
    log_probs = chunked.apply(hidden, weight, None, targets, 1.0, chunk_size, None, 1.0, FUSED_OUTPUTS)[0]
    return -log_probs.sum() if reduction == "sum" else -log_probs
