"""How one rank's effective batch is split into micro-batches: the micro-batch, the accumulation steps and
whether gradient checkpointing is on, chosen from the memory model's figures and a GPU's usable memory.

    resolve(train, figures, gpu_gb) → Split(micro_batch=32, grad_accum=1, ...)   (a job's entry)
    choose(figures, usable_gb, effective=32, checkpointing=False) → the same, for `micro_batch: auto`

The user's contract is the effective batch, `train.batch_size x train.grad_accum` per rank: the loss and its
gradient do not depend on how it is split (train/loss.py TargetTokenLoss; the sampler groups examples by
the effective batch), so the split is ours to choose for speed. A small micro-batch leaves a GPU idle (a
0.5B model's step at 8 x 240 tokens used 3 % of an H100), so `micro_batch: auto` takes the largest
micro-batch that divides the effective batch and whose training step and in-training eval fit without
checkpointing; checkpointing (a third more compute) only when not even a micro-batch of 1 fits without it.
The effective batch is never raised.

Pure and torch-free: the job applies it at its start with the GPU it got (train/recipe.py
StageRecipe.fresh_split), preflight with cluster.yaml's gpu_mem_gb, and the dry run from preflight's cache.
The figures are straight lines in the micro-batch, computed by train/memory.py (MemoryEstimate.lines()).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

# What a choice leaves free of the memory it is given, over and above the estimate's own 1 GB CUDA reserve:
# the estimate's measured error on an H100 (-0.4 % to +3 %), allocator fragmentation, and what another
# library may allocate later (NCCL's buffers under DDP).
HEADROOM = 0.05


@dataclass(frozen=True)
class StepLine:
    """A step's peak memory in GB: fixed_gb + micro_batch x per_example_gb."""

    fixed_gb: float
    per_example_gb: float

    def at(self, micro_batch: int) -> float:
        return self.fixed_gb + micro_batch * self.per_example_gb


@dataclass(frozen=True)
class MemoryFigures:
    """The memory model's lines for one job: its training step and its in-training eval step (if any),
    without and with gradient checkpointing. A job fits at a micro-batch when every line does."""

    plain: tuple[StepLine, ...]
    checkpointed: tuple[StepLine, ...]

    def peak_gb(self, micro_batch: int, checkpointing: bool) -> float:
        lines = self.checkpointed if checkpointing else self.plain
        return max(line.at(micro_batch) for line in lines)

    def as_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_json(value: dict) -> MemoryFigures:
        return MemoryFigures(
            plain=tuple(StepLine(**line) for line in value["plain"]),
            checkpointed=tuple(StepLine(**line) for line in value["checkpointed"]),
        )


@dataclass(frozen=True)
class Split:
    """What a job runs with: micro_batch x grad_accum = the effective batch per rank."""

    micro_batch: int
    grad_accum: int
    gradient_checkpointing: bool
    how: str  # "auto" (chosen here), "asked" (micro_batch: N) or "as written" (batch_size x grad_accum)
    reason: str
    fits: bool = True  # False: not even the smallest choice fits the memory given
    peak_gb: float | None = None  # the chosen step's estimated peak, reserve included
    usable_gb: float | None = None  # what it was judged against (the GPU's memory less HEADROOM)
    fused_loss: bool = False  # the output layer fused with the loss (train/loss.py): only where it helps
    # The ranks the effective batch was split for (None: a record from before this was written): a resumed
    # run keeps its split only at that world size (kept_on_resume).
    world_size: int | None = None

    def describe(self) -> str:
        """`micro 32 x accum 1, no checkpointing: step 13.5 of 79 GB (auto)`."""
        ckpt = "checkpointing" if self.gradient_checkpointing else "no checkpointing"
        text = f"micro {self.micro_batch} x accum {self.grad_accum}, {ckpt}"
        text += ", fused loss" if self.fused_loss else ""
        if self.peak_gb is not None and self.usable_gb is not None:
            text += f": step {self.peak_gb:.1f} of {self.usable_gb:.0f} GB"
        return f"{text} ({self.how}: {self.reason})"

    def short(self) -> str:
        """`32x1`, `4x8 ckpt`: micro-batch x accumulation, for a status column."""
        text = f"{self.micro_batch}x{self.grad_accum}" + (" ckpt" if self.gradient_checkpointing else "")
        return text + (" fused" if self.fused_loss else "")

    def as_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_json(value: dict) -> Split:
        return Split(**value)


class DoesNotFit(RuntimeError):
    """A job's automatic split that fits nowhere on its GPU: refused at the job's start, with the figures,
    rather than found out by running out of memory at the first step or, worse, the first eval."""


def refuse_unless_fits(split: Split) -> Split:
    """`split`, if it fits the memory it was judged against; else DoesNotFit with the figures."""
    if split.fits:
        return split
    raise DoesNotFit(
        f"batch split {split.describe()}: the training step, the in-training eval step or a GRPO stage's "
        f"generation needs {split.peak_gb:.2f} GB where {split.usable_gb:.2f} GB may be filled on this GPU. "
        "Lower data.max_length, use adapter.method: qlora, ask for a GPU with more memory, or evaluate less "
        "(data.eval's longest example sets the eval step's length); a GRPO stage generates a step's "
        "completions at once: fewer prompts per step (batch_size x grad_accum) or num_generations"
    )


def label(recorded) -> str | None:
    """`32x1 (auto)`: a recorded split (Split.as_json, from summary.json or preflight) as its micro-batch x
    accumulation and how it was chosen; None when it is no split record (absent, another version's)."""
    if not isinstance(recorded, dict):
        return None
    try:
        return f"{Split.from_json(recorded).short()} ({recorded['how']})"
    except TypeError:
        return None


def kept_on_resume(
    recorded: object, effective: int, world_size: int, fused_possible: bool = True
) -> tuple[Split | None, str]:
    """The split a resumed run keeps: its record (split.json) when that is a split record, made at this world
    size, whose micro-batch x accumulation is this rank's effective batch, and whose fused loss (if any) this
    device can run; a changed world size is said as such (an elastic job's per-rank batch follows it, L11) (`fused_possible`); else None and why not, and the job chooses afresh (train/recipe.py).
    Before: a foreign or tampered split.json (micro 3 x accum 1 on a 2 x 2 stage) was trusted, and the run
    trained to the end with an effective batch of 3; one asking for the fused loss on a CPU failed every
    retry with `No module named 'liger_kernel'` (L7)."""
    if recorded is None:
        return None, "the run has no split.json"
    try:
        split = Split.from_json(recorded) if isinstance(recorded, dict) else None
    except TypeError:
        split = None
    if split is None or not all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 1
        for n in (split.micro_batch, split.grad_accum)
    ):
        return None, "its split.json is not a split record"
    if split.world_size is not None and split.world_size != world_size:
        return None, (
            f"its split.json was chosen for {split.world_size} rank(s) and the job now has {world_size}"
        )
    if split.micro_batch * split.grad_accum != effective:
        return None, (
            f"its split.json (micro {split.micro_batch} x accum {split.grad_accum} = "
            f"{split.micro_batch * split.grad_accum}) does not make this stage's effective batch per rank, "
            f"batch_size x grad_accum = {effective}"
        )
    if split.fused_loss is not False and not (split.fused_loss is True and fused_possible):
        return None, (
            "its split.json asks for the fused loss, which this job cannot run here (it needs a CUDA GPU and "
            "liger-kernel installed)"
        )
    return split, ""


def elastic_accumulation(grad_accum: int, most: int, now: int) -> int | None:
    """A rank's accumulation steps when a job whose global batch is set at `most` nodes (or ranks) runs on
    `now`: grad_accum x most / now, so that micro-batch x accumulation x ranks stays the global batch
    (`nodes: min-max`, an elastic job). None when that is not whole: the range is refused at validation
    (slurm/planning/checks.py check_elastic), and a job that got such a size fails at its start.

        elastic_accumulation(1, 2, 1) == 2;  elastic_accumulation(2, 3, 2) == 3;  elastic_accumulation(1, 3, 2) is None
    """
    steps, left = divmod(grad_accum * most, now)
    return steps if left == 0 and steps >= 1 else None


def usable_gb(gpu_gb: float) -> float:
    """The part of a GPU's (free) memory a split may plan to fill."""
    return gpu_gb * (1 - HEADROOM)


def divisors(n: int) -> list[int]:
    """n's divisors, largest first: the micro-batches that split an effective batch of n exactly."""
    return [d for d in range(n, 0, -1) if n % d == 0]


def choose(
    figures: MemoryFigures,
    usable: float,
    effective: int,
    checkpointing: bool = False,
    fused: MemoryFigures | None = None,
) -> Split:
    """The split for the plain loss (choose_with); and where `fused` (the figures with the output layer
    fused into the loss) lets a larger micro-batch fit, or fit without checkpointing, or fit at all, that
    one. A fused loss was measured slower than the plain one at the same micro-batch (Liger at 8 x 240 tokens on
    an H100: 0.65x plain HF, but cold: Triton compiled inside the timed window; a warm re-measurement is
    pending a GPU, bench/gpu_throughput.py), so it is taken only for what it buys."""
    plain = choose_with(figures, usable, effective, checkpointing)
    if fused is None:
        return plain
    candidate = choose_with(fused, usable, effective, checkpointing)
    if rank(candidate) <= rank(plain):
        return plain
    why = f"{candidate.reason}, with the fused loss (the plain one: micro {plain.micro_batch}"
    why += " with checkpointing)" if plain.gradient_checkpointing else ")"
    return replace(candidate, fused_loss=True, reason=why)


def rank(split: Split) -> tuple:
    """What makes one split better than another: it fits, then no checkpointing, then a larger micro-batch."""
    return (split.fits, not split.gradient_checkpointing, split.micro_batch)


def choose_with(figures: MemoryFigures, usable: float, effective: int, checkpointing: bool = False) -> Split:
    """The largest micro-batch dividing `effective` that fits in `usable` GB without checkpointing; else the
    largest that fits with it; else a micro-batch of 1 with checkpointing, marked as not fitting.
    `checkpointing`: the user asked for it (train.gradient_checkpointing: true), so it stays on."""
    for ckpt in [True] if checkpointing else [False, True]:
        for micro in divisors(effective):
            peak = figures.peak_gb(micro, ckpt)
            if peak <= usable:
                why = "the largest micro-batch that fits" + (
                    " without checkpointing"
                    if not ckpt
                    else " with checkpointing (asked for)"
                    if checkpointing
                    else " with checkpointing (not even 1 fits without)"
                )
                if micro == effective:
                    why = "the whole effective batch fits" + (" with checkpointing" if ckpt else "")
                return Split(micro, effective // micro, ckpt, "auto", why, True, peak, usable)
    peak = figures.peak_gb(1, True)
    why = "not even a micro-batch of 1 with checkpointing fits"
    return Split(1, effective, True, "auto", why, False, peak, usable)


def as_written(batch_size: int, grad_accum: int, checkpointing: bool, reason: str) -> Split:
    """The user's own split (a CPU, or no memory figures to choose by)."""
    return Split(batch_size, grad_accum, checkpointing, "as written", reason)


def asked(micro_batch: int, effective: int, checkpointing: bool, figures, usable: float | None) -> Split:
    """An explicit `train.micro_batch: N`, honoured as written; judged when there are figures."""
    if figures is None or usable is None:
        return Split(micro_batch, effective // micro_batch, checkpointing, "asked", "train.micro_batch")
    peak = figures.peak_gb(micro_batch, checkpointing)
    return Split(
        micro_batch,
        effective // micro_batch,
        checkpointing,
        "asked",
        "train.micro_batch",
        peak <= usable,
        peak,
        usable,
    )


def resolve(
    train,
    figures: MemoryFigures | None,
    gpu_gb: float | None,
    why_not: str = "",
    fused: MemoryFigures | None = None,
) -> Split:
    """The split a job runs with, for its `train` section (core/config.py TrainSpec), its memory figures
    and the GPU memory it may fill (None: no GPU, or unknown). `why_not`: why there is no GPU or figure.
    `fused`: the figures with a fused loss, where one can run (CUDA, the extra installed, a plain output
    layer); an explicit micro_batch never takes it (it is honoured as written)."""
    effective = train.batch_size * train.grad_accum
    usable = usable_gb(gpu_gb) if gpu_gb is not None else None
    if train.micro_batch != "auto":
        return asked(train.micro_batch, effective, train.gradient_checkpointing, figures, usable)
    if figures is None or usable is None:
        why = why_not or "no GPU memory to choose by"
        return as_written(train.batch_size, train.grad_accum, train.gradient_checkpointing, why)
    return choose(figures, usable, effective, train.gradient_checkpointing, fused)
