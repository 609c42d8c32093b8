"""A trained adapter loaded onto this process's device, and batched generation from it: sorted by length,
decoded by the eval's own settings (never the base model's generation_config), without prompt, padding,
bos or eos, but with the model's added tokens."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch
from transformers import GenerationConfig

from core.config import EvalJob, EvalSpec
from core.conversations import templated
from core.rundir import RunDir
from train import chat, vl
from train.chat import text_tokenizer
from train.device import Hardware, Placement, decide, ranks
from train.model import load_base, load_tokenizer, load_trained

log = logging.getLogger("eval.generate")
# What frames an output, kept from the model's own generation_config; every other setting is the eval's.
FRAMING = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")


def trained_precision(adapter_dir: str | None) -> str:
    """The precision the stage ran in, from its summary.json next to the adapter; "auto" when absent
    (an adapter from elsewhere, or none: a base-model eval)."""
    if adapter_dir is None:
        return "auto"
    summary = RunDir.of_adapter(adapter_dir).read_summary()
    return summary.get("precision", "auto")  # an unreadable summary is named in a warning (core/files.py)


def eval_placement(adapter_dir: str | None, hardware: Hardware | None = None) -> Placement:
    """This process's device, and the precision the adapter was trained in (train/device.py decides)."""
    placement = decide(hardware or Hardware.detect(), trained_precision(adapter_dir), **ranks())
    for warning in placement.warnings:
        log.warning("%s", warning)
    return placement


def load_for_eval(job: EvalJob, placement: Placement):
    """(model, tokenizer) of the job's adapter on `placement.device`, in eval mode; without an adapter
    (a base-model eval), the base as the adapter's eval loads it (4-bit for QLoRA), with its own tokenizer."""
    if job.adapter_dir is None:
        tokenizer = load_tokenizer(job.model.name_or_path, job.model, job.data)
        model = load_base(job.model, job.adapter, placement)
    else:
        model, tokenizer = load_trained(
            job.model, job.adapter_dir, quantize=job.adapter, placement=placement, data=job.data
        )
    stop_at_end_of_turn(job, model, tokenizer)
    log.info("generating on %s (%s) in %s", placement.device, placement.device_name, placement.precision)
    return model.eval(), tokenizer


def base_for_eval(job: EvalJob, placement: Placement):
    """The base model alone, held as the job's adapter's eval holds it (4-bit for QLoRA): the base that
    eval/shared.py puts each adapter on in turn."""
    return load_base(job.model, job.adapter, placement)


def adapter_on_base(base, job: EvalJob):
    """(model, tokenizer): the job's adapter on `base` (base_for_eval's), as load_for_eval loads it
    (train/model.py load_trained: the adapter folder's tokenizer, PeftModel.from_pretrained, not
    trainable), or the base alone for a base-model eval; in eval mode, stopping at the chat template's end
    of turn. `model.unload()` gives the base back, nothing merged. An adapter that adds tokens is refused:
    its embeddings are its own."""
    from peft import PeftModel

    if job.adapter_dir is None:
        model, tokenizer = base, load_tokenizer(job.model.name_or_path, job.model, job.data)
    else:
        tokenizer = load_tokenizer(job.adapter_dir, job.model, job.data)
        if len(text_tokenizer(tokenizer)) > base.get_input_embeddings().weight.shape[0]:
            raise ValueError(
                f"{job.adapter_dir} adds tokens to the base model: its embeddings are its own, so it is "
                "scored by an eval job of its own, not a shared one"
            )
        model = PeftModel.from_pretrained(base, job.adapter_dir, is_trainable=False)
    stop_at_end_of_turn(job, model, tokenizer)
    return model.eval(), tokenizer


def stop_at_end_of_turn(job: EvalJob, model, tokenizer) -> None:
    """For chat prompts, generation ends at the chat template's end-of-turn token, as a chat endpoint's
    does: a base model given a template (ChatML's <|im_end|> as an added token) has only its own eos in
    generation_config. The export saves this generation_config with the merged model, so vLLM and Ollama
    stop there too."""
    if not templated(job.data, job.model.kind):
        return
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    eos = base.generation_config.eos_token_id
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    missing = [i for i in chat.end_of_turn_ids(tokenizer) if i not in eos]
    if missing:
        base.generation_config.eos_token_id = eos + missing


def explicit_decoding(model, spec: EvalSpec) -> dict:
    """Make the eval's own settings the whole of the model's generation_config: greedy (beam search with
    num_beams > 1), `eval.generation`'s penalties, and of the model's own config only the token ids that
    frame an output (an Instruct model's end-of-turn eos among them). transformers fills every setting a
    generate() call leaves unset from the model's generation_config (generation/utils.py,
    _prepare_generation_config), so a hub file's repetition_penalty, sampling or no_repeat_ngram_size
    would otherwise change the predictions. Returns, for results.json, the settings used and what the
    model's own config said otherwise."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    own = base.generation_config
    settings = {
        "do_sample": False,
        "num_beams": spec.num_beams,
        "max_new_tokens": spec.max_new_tokens,
        **spec.generation.model_dump(),
    }
    framing = {k: getattr(own, k) for k in FRAMING if getattr(own, k, None) is not None}
    base.generation_config = GenerationConfig(**framing, **settings)
    defaults = GenerationConfig._get_default_generation_params()
    used = defaults | settings
    overridden = {
        key: value
        for key, value in own.to_diff_dict().items()
        if key not in (*FRAMING, "transformers_version")
        and not key.startswith("_")
        and value != used.get(key)
        and (value or used.get(key))  # False, 0 or empty where the library leaves it unset: no change
    }
    if overridden:
        log.info("the base model's generation_config is not used for decoding: %s", overridden)
    return {"generation": settings, "generation_overridden": overridden}


def framing_ids(model, tokenizer) -> set[int]:
    """Ids that frame an output rather than say anything: pad, bos, eos and the decoder start (T5: pad)."""
    ids = {tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id}
    ids.add(getattr(model.generation_config, "decoder_start_token_id", None))
    eos = getattr(model.generation_config, "eos_token_id", None)  # an end-of-turn among them
    ids.update(eos if isinstance(eos, list) else [eos])
    return {i for i in ids if i is not None}


def decode(tokenizer, sequences, strip: set[int]) -> list[str]:
    """Text of each sequence without the `strip` ids. skip_special_tokens would also drop the model's
    added tokens (model.added_tokens are special tokens), which are part of the answer."""
    rows = sequences.tolist() if hasattr(sequences, "tolist") else sequences  # a tensor, or lists of ids
    kept = [[i for i in sequence if i not in strip] for sequence in rows]
    return [text.strip() for text in tokenizer.batch_decode(kept, skip_special_tokens=False)]


def length_batches(prompts: list[str], batch_size: int) -> list[list[int]]:
    """Prompt indices in batches of similar length (little padding, so little wasted compute). The same
    batches on every run: a resumed eval generates each batch as an uninterrupted one does."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    return [order[start : start + batch_size] for start in range(0, len(order), batch_size)]


def generate(model, tokenizer, prompts: list[str], *, batch_size: int, **options) -> list[str]:
    """One output per prompt, in the prompts' order (`options`: those of `generated_batches`)."""
    outputs: list[str] = [""] * len(prompts)
    for batch, texts in generated_batches(
        model, tokenizer, prompts, length_batches(prompts, batch_size), **options
    ):
        for index, text in zip(batch, texts, strict=True):
            outputs[index] = text
    return outputs


@torch.inference_mode()  # on each resumption of the generator
def generated_batches(
    model,
    tokenizer,
    prompts: list[str],
    batches: list[list[int]],
    *,
    kind: str,
    num_beams: int,
    max_new_tokens: int,
    max_length: int | None = None,
    images: list[str] | None = None,
    templated: bool = False,
) -> Iterator[tuple[list[int], list[str]]]:
    """(batch, its outputs) for each batch of prompt indices, generated on the model's device as asked for.

    Causal models pad on the left so every prompt ends where generation starts, and only the new tokens
    are decoded. For image-text `tokenizer` is the processor and `images` the prompts' image files (never
    truncated: that would cut image tokens). Chat prompts (`templated`, and every image-text one) come
    rendered with their chat template, as in training (train/data.py prompts_and_targets); a text model's
    come as the training ids before the answer (train/chat.py ChatPrompt), never tokenized again.
    Decoding follows the model's generation_config: the eval job sets it (`explicit_decoding`).
    """
    processor, tokenizer = tokenizer, text_tokenizer(tokenizer)
    tokenizer.padding_side = "right" if kind == "seq2seq" else "left"
    strip = framing_ids(model, tokenizer)
    for batch in batches:
        if kind == "image-text":
            encoded = vl.generation_inputs(
                processor, [prompts[i] for i in batch], [images[i] for i in batch], model.device
            )
        elif all(isinstance(prompts[i], chat.ChatPrompt) for i in batch):  # the training ids themselves
            ids = [prompts[i].ids[:max_length] for i in batch]
            encoded = tokenizer.pad({"input_ids": ids}, return_tensors="pt").to(model.device)
        else:
            encoded = tokenizer(
                [prompts[i] for i in batch],
                return_tensors="pt",
                padding=True,
                truncation=max_length is not None,
                max_length=max_length,
                # as in training: a chat rendering holds its template's own bos (train/chat.py)
                add_special_tokens=not templated,
            ).to(model.device)
        generated = model.generate(
            **encoded,
            num_beams=num_beams,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
        if kind != "seq2seq":
            generated = generated[:, encoded["input_ids"].shape[1] :]
        yield batch, decode(tokenizer, generated, strip)


def adapter_changes_output(model, tokenizer, prompts: list[str], **kwargs) -> bool:
    """Does the adapter change anything? A "fine-tuned" model that generates exactly like its base
    usually means the adapter was never applied (or never trained)."""
    with_adapter = generate(model, tokenizer, prompts, **kwargs)
    with model.disable_adapter():
        base = generate(model, tokenizer, prompts, **kwargs)
    return with_adapter != base
