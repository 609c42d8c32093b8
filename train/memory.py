"""GPU memory of a training step and of an in-training eval step, worked out without weights or a GPU.

    training peak = frozen weights + trainable state (fp32 weight, fp32 gradient, two fp32 AdamW moments)
                    + what forward, loss and backward allocate above them, at their highest
    eval peak     = frozen weights + trainable weights and moments (the step's gradients are freed first)
                    + what a no-grad forward and loss allocate at the eval batch (2 × batch_size)
    a job fits when the larger of the two, plus a CUDA reserve, fits in one GPU's memory.

The step is not a formula: the adapted model runs a real forward, the trainer's own loss and a backward on
fake tensors (shapes and dtypes, no data: torch's FakeTensorMode) under the autocast a bf16 GPU runs, and a
dispatch mode follows every storage an op creates until it is freed. So what a sum of saved activations
misses is there as it happens in the job: the loss's fp32 copy of the logits and its log-softmax, the
backward's logits-sized gradients while those are alive, autocast's bf16 copies of LoRA inputs, a
checkpointed layer's recompute. Transformer layers are alike, so the step runs with one and with two layers
and is extrapolated to the model's depth: a fraction of a second for any model size.
bench/preflight_memory.py checks the result against the whole step's allocations measured on a CPU.

Units: GB is 10**9 bytes everywhere here, as GPUs are sold ("80 GB"), as cluster.yaml's `gpu_mem_gb` is
read and as train/gpu_use.py reports NVML's readings. An "80 GB" H100 holds 85.5 GB (79.6 GiB).

Assumptions, stated so a user can judge them: a bf16-capable GPU (train/device.py's placement for it: bf16
weights and autocast); AdamW keeps two fp32 moments per trainable parameter, every one of which is fp32
(train/device.py TRAINABLE_DTYPE); batches are padded to at most max_length (rounded up to the collator's
multiple); every example of a batch has as many target tokens as the longest answer (the loss's output
layer runs at those only, train/loss.py; `targets` in the shape); the in-training eval's batches are at the
eval set's own lengths; an image-text model's vision tower runs on no images (its activations are not counted).

A preference (DPO) step is TRL's: chosen and rejected run as one batch of 2 sequences per example (the
shape's `sequences: 2`; the lines stay per example, so the micro-batch rule splits pairs), the output layer
fused at the answer tokens only (TRL's own chunked log-prob function: train/dpo_step.py
fused_log_prob_loss); then, while the policy's saved activations are alive, the reference forward without
gradients on the same batch (`reference_forward`; run here with the adapter on, a little above the base's
adapters-off forward); then the backward. `reference: previous` holds the adapter's frozen copy besides, fp32
as the policy's (`reference_copy`, counted with the frozen weights). TRL's eval step runs both forwards
without gradients.

A GRPO step is TRL's, in three phases that do not overlap (trl 1.16 GRPOTrainer), each judged on its own:
- the generation (the shape's `generation`): a whole step's completions of this rank sampled at once
  (train/grpo.py sampled_completions), no gradients, the optimizer's moments held; its peak is the KV cache of
  every sequence at its full length (prompt + completion) in the last decoding step, or the prompts' prefill
  if that is higher (`generation_peak_bytes`). A line with no part per training example: the micro-batch does not
  change it, only the prompts per step and num_generations do;
- the reference forward (beta > 0), without gradients, in micro-batches over the step's sequences: under
  the training step's peak at the same micro-batch (a forward that keeps nothing), so not judged apart;
  `reference: previous` holds the adapter's frozen copy, as DPO's;
- the training step: micro-batches of completions, each sequence prompt + completion, the output layer fused
  at the completion's tokens (TRL's fused LM head, as for DPO), then the backward.
"""

from __future__ import annotations

import copy
import inspect
import math
import weakref
from collections.abc import Callable, Iterable
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import asdict, dataclass
from functools import cache, partial
from unittest.mock import patch

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import masking_utils

from train import device
from train.vl import is_vision

GB = 10**9  # decimal gigabytes: see the module docstring
CUDA_RESERVE_GB = 1.0  # CUDA context, cuBLAS workspace and allocator fragmentation
EVAL_BATCH_FACTOR = 2  # the in-training eval's batch over the training batch (train/recipe.py uses it)
TRAINABLE_BYTES = 4 + 4 + 8  # fp32 weight, its fp32 gradient, AdamW's two fp32 moments
REFERENCE_COPY_BYTES = 4  # DPO's frozen copy of the adapter (reference: previous), fp32 as the policy's
EVAL_TRAINABLE_BYTES = 4 + 8  # the Trainer frees gradients (zero_grad to None) after each optimizer step
NF4_BLOCK = 64  # bitsandbytes' 4-bit block: one absmax per 64 weights
NF4_NESTED_BLOCK = 256  # double quantization: one fp32 absmax per 256 8-bit absmaxes
BF16_GPU = device.Hardware(cuda_devices=1, bf16_supported=True, capability_major=9, name="a bf16 GPU")

Loss = Callable[..., torch.Tensor]  # the trainer's compute_loss_func: (outputs, labels) → loss


def nf4_bytes(double_quant: bool) -> float:
    """Bytes per 4-bit weight with its block constants: half a byte, plus one absmax per block of 64,
    fp32, or with double quantization 8-bit plus one fp32 second-level absmax per 256 of them."""
    absmax = 1 + 4 / NF4_NESTED_BLOCK if double_quant else 4
    return 0.5 + absmax / NF4_BLOCK


def nf4_tensor_bytes(double_quant: bool) -> int:
    """Bytes each 4-bit weight tensor holds besides: its 16-value fp32 code book, and with double
    quantization the 256-value fp32 code book of its absmaxes and their fp32 offset."""
    return 16 * 4 + (256 * 4 + 4 if double_quant else 0)


@dataclass(frozen=True)
class MemoryEstimate:
    """GB (10**9 bytes) per GPU. Each step's peak is a line in the training batch (lines());
    a line's shared part may be below zero: only its values at batch sizes from 1 up mean anything."""

    weights_gb: float  # frozen weights as held (QLoRA: 4-bit layers, the rest upcast to fp32)
    trainable_state_gb: float  # trainable weights, gradients and AdamW moments, all fp32
    activations_gb: float  # the training step's peak above weights and state, at the job's batch
    activations_shared_gb: float  # the part of activations_gb that does not grow with the batch
    activations_per_example_gb: float
    train_gb: float  # the training step's whole peak, reserve included
    eval_batch_size: int | None  # None: the job runs no in-training eval
    eval_activations_gb: float | None  # the eval step's peak above weights, trainable weights and moments
    eval_activations_shared_gb: float | None
    eval_activations_per_example_gb: float | None  # per example of the eval batch
    eval_gb: float | None  # the eval step's whole peak, reserve included
    total_gb: float  # the largest of train_gb, eval_gb and generation_gb: what must fit
    generation_sequences: int | None = None  # a GRPO stage's completions sampled at once (None: none)
    generation_activations_gb: float | None = None  # its peak above weights, trainable weights and moments
    generation_gb: float | None = None  # its whole peak, reserve included

    def as_dict(self) -> dict:
        return asdict(self)

    def lines(self) -> list[tuple[float, float]]:
        """(fixed GB, GB per training example) of the training step, and of the eval step if any."""
        found = [(self.train_fixed_gb, self.activations_per_example_gb)]
        if self.eval_batch_size is not None:
            state = self.trainable_state_gb * EVAL_TRAINABLE_BYTES / TRAINABLE_BYTES
            fixed = self.weights_gb + state + self.eval_activations_shared_gb + CUDA_RESERVE_GB
            found.append((fixed, EVAL_BATCH_FACTOR * self.eval_activations_per_example_gb))
        if self.generation_gb is not None:  # the same whatever the micro-batch
            found.append((self.generation_gb, 0.0))
        return found

    @property
    def train_fixed_gb(self) -> float:
        return self.weights_gb + self.trainable_state_gb + self.activations_shared_gb + CUDA_RESERVE_GB


def largest_batch(estimate_: MemoryEstimate, gpu_mem_gb: float) -> int:
    """The largest training batch whose step and eval both fit in `gpu_mem_gb` (0: not even one)."""
    batches = []
    for fixed, per_example in estimate_.lines():
        room = gpu_mem_gb - fixed
        if room < 0:
            return 0
        batches.append(math.floor(room / per_example) if per_example > 0 else math.inf)
    return int(min(min(batches), 2**31))


# ---- how a bf16 GPU holds and computes ------------------------------------------------------------------
def gpu_placement(precision: str) -> device.Placement:
    """train/device.py's placement on a bf16-capable GPU: what the job's weights and autocast will be."""
    return device.decide(BF16_GPU, precision)


def weight_dtype(precision: str) -> torch.dtype:
    return gpu_placement(precision).load_dtype


def autocast_dtype(precision: str) -> torch.dtype | None:
    """What the Trainer's autocast computes in (bf16=True or fp16=True); None for plain fp32."""
    runs = gpu_placement(precision).precision
    return None if runs == "fp32" else device.DTYPES[runs]


def padded_length(length: int, precision: str) -> int:
    """The longest batch the collator makes: max_length rounded up to its pad_to_multiple_of."""
    multiple = gpu_placement(precision).pad_to_multiple_of or 1
    return -(-length // multiple) * multiple


# ---- the frozen weights, as held -------------------------------------------------------------------------
def quantized_weights(model) -> set[int]:
    """ids of the weights bitsandbytes stores in 4 bits under QLoRA: every Linear of the model but the
    output layer and the vision tower (train/model.py load_base keeps both out)."""
    output = model.get_output_embeddings()
    output_weight = getattr(output, "weight", None)
    return {
        id(module.weight)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear)
        and "lora_" not in name
        and not is_vision(name)
        and module is not output
        and module.weight is not output_weight  # a Linear tied to the output layer (its weight shared)
    }


def held_as_qlora(model, compute_dtype: torch.dtype) -> None:
    """Give the model the dtypes a QLoRA job holds, and its 4-bit layers' behaviour: peft's
    prepare_model_for_kbit_training casts every parameter that is not 4-bit (embeddings, lm_head, norms,
    biases, a vision tower) to fp32, so the residual stream runs in fp32; a 4-bit layer computes in the
    compute dtype and returns its input's dtype (bitsandbytes Linear4bit.forward)."""
    quantized = quantized_weights(model)
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and id(module.weight) in quantized:
            module.weight.data = module.weight.data.to(compute_dtype)
            module.forward = partial(four_bit_forward, module, compute_dtype)
    for param in model.parameters():
        if id(param) not in quantized and param.dtype in (torch.float16, torch.bfloat16):
            param.data = param.data.to(torch.float32)


def four_bit_forward(module, compute_dtype: torch.dtype, x: torch.Tensor) -> torch.Tensor:
    bias = None if module.bias is None else module.bias.to(compute_dtype)
    return torch.nn.functional.linear(x.to(compute_dtype), module.weight, bias).to(x.dtype)


def weight_bytes(model, qlora: bool, double_quant: bool = True) -> float:
    """Frozen weights and buffers, each storage once; trainable ones are counted with their optimizer
    state instead. Under QLoRA, `model` holds QLoRA's dtypes (held_as_qlora) and its 4-bit layers are
    counted with their quantization constants."""
    quantized = quantized_weights(model) if qlora else set()
    seen: set[int] = set()
    total = 0.0
    for param in [*model.parameters(), *model.buffers()]:
        if param.requires_grad or id(param) in seen:
            continue
        seen.add(id(param))
        if id(param) in quantized:
            total += param.numel() * nf4_bytes(double_quant) + nf4_tensor_bytes(double_quant)
        else:
            total += param.numel() * param.element_size()
    return total


def dequantized_bytes(model, dtype: torch.dtype) -> int:
    """The largest 4-bit weight dequantized for its matmul: bitsandbytes does that in every forward and
    backward of a 4-bit layer, a transient no meta layer has."""
    quantized = quantized_weights(model)
    sizes = [p.numel() for p in model.parameters() if id(p) in quantized]
    return max(sizes, default=0) * dtype.itemsize


# ---- one step on fake tensors ----------------------------------------------------------------------------
class LiveBytes(TorchDispatchMode):
    """Every storage an op creates, from its creation until it is freed (a weak reference's callback),
    and the highest sum they reach. Storages that exist before (weights, the batch) are not counted."""

    def __init__(self, existing: Iterable[torch.Tensor]):
        super().__init__()
        self.live = self.peak = 0
        self.storages: dict[int, tuple[weakref.ref, int | None]] = {}  # size None: existed before
        for tensor in existing:
            self.track(tensor.untyped_storage(), counted=False)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self.track(leaf.untyped_storage())
        self.peak = max(self.peak, self.live)
        return out

    def track(self, storage, counted: bool = True) -> None:
        key, size = id(storage), storage.nbytes()
        known = self.storages.get(key)
        if known is not None and known[0]() is storage:
            if known[1] is not None and size > known[1]:  # a counted storage resized in place (out= ops)
                self.live += size - known[1]
                self.storages[key] = (known[0], size)
            return
        self.storages[key] = (
            weakref.ref(storage, lambda _, key=key: self.free(key)),
            size if counted else None,
        )
        self.live += size if counted else 0

    def free(self, key: int) -> None:
        _, size = self.storages.pop(key)
        self.live -= size or 0


def to_fake(model, mode) -> None:
    """Replace the meta model's parameters and buffers by fake CPU tensors (tied ones stay tied): fake
    tensors on a CPU take autocast, which meta tensors do not."""
    converter, done = mode.fake_tensor_converter, {}
    cpu = torch.device("cpu")
    for module in model.modules():
        for table, wrap in ((module._parameters, True), (module._buffers, False)):
            for name, tensor in list(table.items()):
                if tensor is None:
                    continue
                if id(tensor) not in done:
                    fake = converter.from_meta_and_device(mode, tensor.data, cpu)
                    done[id(tensor)] = torch.nn.Parameter(fake, tensor.requires_grad) if wrap else fake
                table[name] = done[id(tensor)]


def step_inputs(kind: str, batch: int, length: int, target_length: int | None) -> dict:
    """A batch of the job's padded shape as the collator makes it (decoder inputs for seq2seq); its labels
    come from step_labels."""
    ids = torch.zeros(batch, length, dtype=torch.long)
    mask = torch.ones(batch, length, dtype=torch.long)
    if kind == "seq2seq":
        decoder = torch.zeros(batch, target_length or length, dtype=torch.long)
        return {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": decoder}
    return {"input_ids": ids, "attention_mask": mask}


def step_labels(kind: str, batch: int, length: int, target_length: int | None, targets: int | None):
    """Real (not fake) labels of the batch's shape, each example with `targets` target tokens at its end
    (None: every position, as `train_on: all`): the loss's output layer runs at those only (train/loss.py),
    and it counts them, which a fake tensor cannot. Seq2seq: every decoder position is a target."""
    if kind == "seq2seq":
        return torch.zeros(batch, target_length or length, dtype=torch.long)
    labels = torch.zeros(batch, length, dtype=torch.long)
    if targets is not None and targets < length:
        labels[:, : length - targets] = -100  # the prompt
    return labels


@contextmanager
def counting(mode, existing: Iterable[torch.Tensor]):
    """Inside `mode` (fake tensors), a LiveBytes of what the ops create above the `existing` tensors."""
    with ExitStack() as stack:
        stack.enter_context(mode)
        # The mask helpers ask "is this mask all ones?", which fake tensors cannot answer: they take the
        # branch they take under torch.compile, which asks none (a padded batch's full mask).
        stack.enter_context(patch.object(masking_utils, "is_tracing", lambda *args, **kwargs: True))
        yield stack.enter_context(LiveBytes(existing))


def step_peak_bytes(
    model, kind: str, shape: dict, precision: str, training: bool, loss: Loss | None = None
) -> int:
    """Bytes one step allocates above what exists before it (the model, its trainable state, the
    batch), at their highest: forward, loss and backward when `training`, else a no-grad forward and loss.
    `model`: the adapted model on the meta device (consumed: its tensors become fake). `loss`: the trainer's
    compute_loss_func, called on the outputs and the labels; None: the model's own loss."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    to_fake(model, mode)
    if training and shape["gradient_checkpointing"]:  # as the Trainer enables it
        model.get_base_model().activation_checkpointing_enable()
    model.train(training)
    sizes = (kind, shape["batch_size"], shape["max_length"], shape["max_target_length"])
    labels = step_labels(*sizes, shape.get("targets"))
    positions = loss.target_positions(labels) if hasattr(loss, "target_positions") else None
    with mode:
        inputs = step_inputs(*sizes) | {"labels": labels}
        if training and accumulates(shape):  # later micro-batches find every gradient there
            for param in model.parameters():
                param.grad = torch.zeros_like(param) if param.requires_grad else None
    existing = [*model.parameters(), *model.buffers(), *inputs.values()]
    existing += [p.grad for p in model.parameters() if p.grad is not None]
    dtype = autocast_dtype(precision)
    reference = shape.get("reference_forward", False)
    with counting(mode, existing) as tracker, torch.enable_grad() if training else torch.no_grad():
        with torch.autocast("cpu", dtype=dtype) if dtype is not None else nullcontext():
            value = run_loss(model, dict(inputs), loss, positions)
            if reference:  # TRL's reference forward comes after the policy's, before the backward
                with torch.no_grad():
                    run_loss(model, dict(inputs), loss, positions)
        if training:
            value.backward()
        del value
    return tracker.peak


def generation_peak_bytes(model, generation: dict) -> tuple[int, int]:
    """Bytes a GRPO stage's generation allocates above the model and its trainable state, at their highest
    (transformers' generate without autocast: train/grpo.py sampled_completions), for `sequences` sequences of
    `prompt_length` + `completion_length` tokens: (prefill, last decoding step), the larger of which is the peak
    (apart, since each extrapolates to the model's depth on its own line: at_depth)
    - the prefill: the prompts' forward keeping their KV cache, the output layer at the last position only;
    - the last decoding step: one token's forward on the cache grown to the whole length (each layer's cache
      concatenated with the new token's keys and values), then the sampler's fp32 scores and probabilities.
    `model`: the adapted model on the meta device (consumed: its tensors become fake)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    to_fake(model, mode)
    model.eval()
    sequences, prompt = generation["sequences"], generation["prompt_length"]
    longest = prompt + generation["completion_length"]

    def tracked(run, existing) -> int:
        with counting(mode, [*model.parameters(), *model.buffers(), *existing]) as tracker, torch.no_grad():
            run()
        return tracker.peak

    # transformers 5 renamed a forward's `past_key_values` to `cache`: the name this model's forward takes
    forward_parameters = inspect.signature(model.get_base_model().forward).parameters
    cache_key = "cache" if "cache" in forward_parameters else "past_key_values"

    def forward(length: int, cache=None):
        ids = torch.zeros(sequences, length, dtype=torch.long)
        before = 0 if cache is None else cache.get_seq_length()
        mask = torch.ones(sequences, before + length, dtype=torch.long)
        kept = {cache_key: cache} if cache is not None else {}
        return model(input_ids=ids, attention_mask=mask, use_cache=True, logits_to_keep=1, **kept)

    prefill = tracked(lambda: forward(prompt), [])
    with mode, torch.no_grad():  # the cache one token short of the whole length, not counted
        cache = forward(longest - 1)[cache_key]

    def last_step() -> None:
        scores = forward(1, cache).logits[:, -1, :].to(copy=True, dtype=torch.float32)  # as generate samples
        torch.softmax(scores / generation.get("temperature", 1.0), dim=-1)

    # Each layer's concatenation makes its cache anew (counted) and then frees the old one (which existed
    # before, so never counted): the step's count holds the whole grown cache, as the memory does once it has
    # run, and while one tensor is concatenated its old copy is alive besides.
    before = [t for layer in cache.layers for t in (layer.keys, layer.values)]
    concatenating = max(t.untyped_storage().nbytes() for t in before)
    return prefill, tracked(last_step, before) + concatenating


def accumulates(shape: dict) -> bool:
    return shape.get("grad_accum", 1) > 1


def run_loss(model, inputs: dict, loss: Loss | None, positions: torch.Tensor | None) -> torch.Tensor:
    if loss is None:
        return model(**inputs).loss
    labels = inputs.pop("labels")  # as the Trainer does when it has a compute_loss_func
    # The output layer at the target positions only (or, fused, the hidden states there), as the trainer's
    # step runs it; the positions were counted on real labels (fake tensors cannot count).
    at_targets = getattr(loss, "output_at_targets", lambda *_: nullcontext())
    with at_targets(model, labels, positions):
        return loss(model(**inputs), labels)


# ---- depth ---------------------------------------------------------------------------------------------
LAYER_KEYS = ("num_hidden_layers", "num_layers", "num_decoder_layers")


def depth(config) -> int:
    """The deepest layer stack of the (language) model: T5's encoder or decoder, a VL model's text model."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return max([getattr(text, key, None) or 0 for key in LAYER_KEYS] + [1])


def shallow(config, layers: int):
    """A copy of `config` whose layer stacks hold at most `layers` layers, the first ones."""
    config = copy.deepcopy(config)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key in LAYER_KEYS:
        value = getattr(text, key, None)
        if isinstance(value, int) and value > layers:
            setattr(text, key, layers)
    if isinstance(getattr(text, "layer_types", None), list):
        text.layer_types = text.layer_types[:layers]
    return config


def at_depth(peak: Callable[[int | None], int], layers: int) -> int:
    """A step's peak at the model's depth, from its peaks with one and two layers: everything a layer
    adds is alive at the peak for every layer (saved activations, a checkpointed layer's input), the rest
    (embeddings, logits, loss, one layer's recompute) once. `peak(None)`: the model as it is."""
    if layers <= 2:
        return peak(None)
    one, two = peak(1), peak(2)
    return one + (layers - 1) * max(0, two - one)


# ---- the estimate ----------------------------------------------------------------------------------------
def estimate(
    build: Callable[[int | None], torch.nn.Module],
    kind: str,
    adapter,
    precision: str,
    shape: dict,
    evaluating: bool,
    loss: Loss | None = None,
) -> MemoryEstimate:
    """`build(layers)`: a fresh adapted model on the meta device in weight_dtype(precision), at most
    `layers` deep (None: as configured), LoRA over an unquantized base even for QLoRA (given QLoRA's
    dtypes here). `adapter`: the job's AdapterSpec. `shape`: batch_size, max_length, max_target_length,
    gradient_checkpointing, grad_accum; `targets`, the most target tokens an example has (None or absent:
    every position; the trainer's loss computes logits only there); `eval_max_length`,
    `eval_max_target_length`, `eval_targets`: the eval set's own (absent: the training set's).
    `evaluating`: the job runs in-training evals. `loss`: the trainer's loss. A preference step (module
    docstring): `sequences` per example (absent: 1), `reference_forward`, `reference_copy` (absent: False).
    A GRPO step: `generation`, {sequences, prompt_length, completion_length, temperature} (absent: none), and
    `reference_copy`."""
    qlora = adapter.method == "qlora"
    compute = gpu_placement(precision).compute_dtype
    full = build(None)
    if qlora:
        held_as_qlora(full, compute)
    weights = weight_bytes(full, qlora, adapter.double_quant)
    trainable = sum(p.numel() for p in full.parameters() if p.requires_grad)
    weights += REFERENCE_COPY_BYTES * trainable if shape.get("reference_copy") else 0
    layers = depth(full.config)
    extra = dequantized_bytes(full, compute) if qlora else 0
    del full
    steps = {True: padded(shape, precision), False: padded(eval_shape(shape), precision)}

    def peak(batch: int, training: bool) -> int:
        def at(layers_: int | None) -> int:
            model = build(layers_)
            if qlora:
                held_as_qlora(model, compute)
            step = steps[training] | {"batch_size": batch * shape.get("sequences", 1)}
            return step_peak_bytes(model, kind, step, precision, training, loss)

        return at_depth(at, layers) + extra

    batch, far = shape["batch_size"], max(2, shape["batch_size"])
    # Counted in the trainable state, and in the step's peak as far as the backward made them by then; with
    # accumulation they were all there before (the step's peak then leaves them out).
    grads = 0 if accumulates(shape) else 4 * trainable
    train = line(lambda b: peak(b, True) - grads, 1, far)
    eval_ = line(lambda b: peak(b, False), EVAL_BATCH_FACTOR, EVAL_BATCH_FACTOR * far) if evaluating else None
    generation = None
    if "generation" in shape:

        @cache  # one model and one run per depth give both phases
        def generating(layers_: int | None) -> tuple[int, int]:
            model = build(layers_)
            if qlora:
                held_as_qlora(model, compute)
            return generation_peak_bytes(model, shape["generation"])

        peaks = [at_depth(lambda layers_, k=phase: generating(layers_)[k], layers) for phase in (0, 1)]
        generation = (shape["generation"]["sequences"], max(peaks) + extra)
    return assemble(weights, trainable, batch, train, eval_, generation)


EVAL_KEYS = ("max_length", "max_target_length", "targets")


def eval_shape(shape: dict) -> dict:
    """The in-training eval step's shape: the eval set's own lengths where given (the job's eval set may be
    much longer than its training set), the training set's otherwise."""
    return shape | {key: shape[f"eval_{key}"] for key in EVAL_KEYS if f"eval_{key}" in shape}


def padded(shape: dict, precision: str) -> dict:
    length = shape["max_length"]
    return shape | {
        "max_length": padded_length(length, precision),
        "max_target_length": padded_length(shape["max_target_length"] or length, precision),
    }


def line(peak: Callable[[int], int], low: int, high: int) -> tuple[float, float]:
    """(shared, per example) bytes through the peaks at batches `low` and `high`: exact at both. A
    step's peak is the largest of lines in the batch (one per moment of the step), so between the two the
    line is above it, and a batch between them is never under-estimated."""
    at_low, at_high = peak(low), peak(high)
    per_example = (at_high - at_low) / (high - low)
    return at_low - low * per_example, per_example


def assemble(weights: float, trainable: int, batch: int, train, eval_, generation=None) -> MemoryEstimate:
    """`train`, `eval_`: lines (shared, per example) in bytes; `generation`: (sequences, peak bytes) or None."""
    state = trainable * TRAINABLE_BYTES / GB
    activations = (train[0] + batch * train[1]) / GB
    train_gb = weights / GB + state + activations + CUDA_RESERVE_GB
    eval_batch = eval_gb = eval_activations = None
    if eval_ is not None:
        eval_batch = EVAL_BATCH_FACTOR * batch
        eval_activations = (eval_[0] + eval_batch * eval_[1]) / GB
        eval_state = trainable * EVAL_TRAINABLE_BYTES / GB
        eval_gb = weights / GB + eval_state + eval_activations + CUDA_RESERVE_GB
    generation_gb = None
    if generation is not None:  # between steps: gradients freed, the moments held
        generation_gb = (weights + trainable * EVAL_TRAINABLE_BYTES + generation[1]) / GB + CUDA_RESERVE_GB
    return MemoryEstimate(
        weights_gb=weights / GB,
        trainable_state_gb=state,
        activations_gb=activations,
        activations_shared_gb=train[0] / GB,
        activations_per_example_gb=train[1] / GB,
        train_gb=train_gb,
        eval_batch_size=eval_batch,
        eval_activations_gb=eval_activations,
        eval_activations_shared_gb=None if eval_ is None else eval_[0] / GB,
        eval_activations_per_example_gb=None if eval_ is None else eval_[1] / GB,
        eval_gb=eval_gb,
        total_gb=max(train_gb, eval_gb or 0.0, generation_gb or 0.0),
        generation_sequences=None if generation is None else generation[0],
        generation_activations_gb=None if generation is None else generation[1] / GB,
        generation_gb=generation_gb,
    )
