"""Examples → prompts → token ids, cached on disk under a key that changes with anything that matters.

Causal LMs learn only the target: input = prompt + target + eos, prompt tokens labelled -100 (padding gets
-100 from the collator). Conversations (data.format messages, sharegpt, alpaca) are rendered with the model's
chat template and learn only the assistant's answers (train/chat.py); a too-long one is cut after its last
whole assistant turn that fits, and dropped (and counted) when not even its first does. Token ids are
cached untruncated, and lengths are measured once, so `max_length: auto` can pick the smallest length that
truncates nothing (up to the model's positions) instead of a blind 2048, and a new max_length reuses the
cache (truncating is a cheap in-memory map). The examples the chosen lengths cut are counted, whichever way
they were chosen.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from core import below, preferences
from core.config import DataSpec
from core.conversations import conversation, prompt_of, scored_turns, target_of, templated
from core.examples import check_file, check_rows, numbered_csv, numbered_jsonl
from core.hashing import CACHE_KEY_CHARS, content_hash, file_fingerprint
from core.layout import cache_root
from core.names import PREFERENCE
from train import chat

if TYPE_CHECKING:  # imported where used: an eval job reads prompts without loading datasets
    import datasets

log = logging.getLogger("train.data")
FIXED_LENGTHS = (128, 256, 512, 1024, 2048)
CACHE_VERSION = 3  # bump whenever encode() changes what it produces: old cache entries are then ignored


# ---- rows and prompts ---------------------------------------------------------------------------------
def load_hf(source: str) -> datasets.Dataset:
    """`hf:NAME:SPLIT` or `hf:NAME:CONFIG:SPLIT` (split defaults to train); honours HF_DATASETS_OFFLINE."""
    import datasets

    parts = source[3:].split(":")
    name, config = parts[0], parts[1] if len(parts) == 3 else None
    return datasets.load_dataset(name, config, split=parts[-1] if len(parts) > 1 else "train")


def read_rows(source: str, spec: DataSpec) -> list[dict]:
    """Checked rows of a .jsonl/.csv/.parquet file, or of an `hf:` dataset."""
    if source.startswith("hf:"):
        rows = list(load_hf(source))
        check_rows(list(enumerate(rows, 1)), spec, Path(source))
        return rows
    path = Path(source)
    check_file(path, spec)
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
        check_rows(list(enumerate(rows, 1)), spec, path)
        return rows
    return [row for _, row in (numbered_csv(path) if suffix == ".csv" else numbered_jsonl(path))]


def prompts_and_targets(
    source: str, spec: DataSpec, tokenizer, kind: str, limit: int | None = None, turns: str = "last"
) -> tuple[list[str], list[str]]:
    """The eval's prompts and references. A conversation's prompt is its chat rendering up to the last
    assistant turn with the generation prompt (what a chat endpoint sends), its reference that turn; with
    `turns` "all" (eval.turns) every assistant turn is one such pair, given the conversation before it as
    written. An image-text example's image is in its first user turn. `limit`: the first N examples
    (conversations)."""
    rows = read_rows(source, spec)[:limit]
    if spec.format == PREFERENCE:  # a pair is scored as its prompt with the chosen answer the reference
        return preference_prompts(tokenizer, rows, spec)
    if not templated(spec, kind) and kind != "image-text":
        return [prompt_of(r, spec) for r in rows], [target_of(r, spec) for r in rows]
    conversations = [turns_of(row, spec, kind) for row in rows]
    chat.within_bounds(tokenizer, conversations)
    pairs = [
        chat.eval_prompt(tokenizer, scored)
        for whole in conversations
        for scored in scored_turns(whole, turns)
    ]
    return [prompt for prompt, _ in pairs], [reference for _, reference in pairs]


def preference_prompts(tokenizer, rows: list[dict], spec: DataSpec) -> tuple[list[str], list[str]]:
    """Pairs' prompts (a string prompt as written, as `fields`; turns, or any prompt when data.chat_template
    is set, rendered with the generation prompt) and their chosen answers. Each prompt carries the ids the
    DPO stage trained before its answers (as train/pairs.py encode_pair tokenizes a pair; chat.ChatPrompt):
    its text tokenized again merged Llama 3's header newlines, and a bos-adding tokenizer gave it two bos
    (N3)."""
    prompts, references = [], []
    chat.within_bounds(tokenizer, [preferences.pair(row)[0] for row in rows if not plain_prompt(row, spec)])
    for row in rows:
        turns, chosen, _ = preferences.pair(row)
        if plain_prompt(row, spec):
            encoded = encode(tokenizer, [turns[0]["content"]], [chosen], "causal")
            ids, labels = encoded["input_ids"][0], encoded["labels"][0]
            answer = next((i for i, label in enumerate(labels) if label != -100), len(ids))
            prompts.append(chat.ChatPrompt(turns[0]["content"], ids[:answer]))
        else:
            prompts.append(chat.eval_prompt(tokenizer, [*turns, {"role": "assistant", "content": chosen}])[0])
        references.append(chosen)
    return prompts, references


def plain_prompt(row: dict, spec: DataSpec) -> bool:
    """A pair whose prompt is a string and no data.chat_template is set: rendered as `fields` are."""
    return isinstance(row["prompt"], str) and spec.chat_template is None


def turns_of(row: dict, spec: DataSpec, kind: str) -> list[dict]:
    turns = conversation(row, spec)
    return chat.with_image(turns) if kind == "image-text" else turns


# ---- tokens -------------------------------------------------------------------------------------------
def encode_conversations(tokenizer, rows: list[dict], spec: DataSpec) -> dict[str, list]:
    """Chat-rendered conversations; `turn_ends` says where each may be cut whole (see `truncate`)."""
    conversations = [conversation(row, spec) for row in rows]
    chat.within_bounds(tokenizer, conversations)
    encoded = [chat.encode(tokenizer, turns, spec.train_on) for turns in conversations]
    return {
        "input_ids": [e.input_ids for e in encoded],
        "labels": [e.labels for e in encoded],
        "length": [len(e.input_ids) for e in encoded],
        "turn_ends": [e.turn_ends for e in encoded],
    }


def warn_marker_text(tokenizer, conversations: list[list[dict]]) -> int:
    """Conversations whose content holds a special token's text (`<|im_end|>injected<|im_start|>system`):
    the tokenizer reads it as that control token, in labels and prompts alike, as TRL and axolotl do. They
    are trained as written, counted and named in a warning; returns the count."""
    holding, found = marker_text(tokenizer, conversations)
    if holding:
        log.warning(
            "%d of %d conversations hold special-token text in their content (%s): it is encoded as those "
            "control tokens, in the labels and the eval's prompts; escape or remove it if it is not meant so",
            holding,
            len(conversations),
            ", ".join(sorted(found)),
        )
    return holding


def marker_text(tokenizer, conversations: list[list[dict]]) -> tuple[int, set[str]]:
    """(how many conversations hold a special token's text in their content, the tokens found)."""
    markers = [m for m in chat.text_tokenizer(tokenizer).all_special_tokens if len(m) > 1]
    found = {
        m for turns in conversations for turn in turns for m in markers if m in content_text(turn["content"])
    }
    holding = sum(
        1 for turns in conversations if any(m in content_text(t["content"]) for t in turns for m in found)
    )
    return holding, found


def marker_text_in(source: str, spec: DataSpec, tokenizer, kind: str) -> int | None:
    """marker_text's count for a data file, quietly (preflight shows it; `tokenized` warned in its log);
    None when its examples are not conversations rendered with a chat template (preference pairs are read
    by train/pairs.py, not here)."""
    if not templated(spec, kind) or spec.format == PREFERENCE:
        return None
    return marker_text(tokenizer, [conversation(row, spec) for row in read_rows(source, spec)])[0]


def content_text(content) -> str:
    return content if isinstance(content, str) else str(content)


def encode(tokenizer, prompts: list[str], targets: list[str], kind: str) -> dict[str, list]:
    """Token ids with no truncation; truncation comes later, once lengths are known."""
    if kind == "seq2seq":
        inputs = tokenizer(prompts)["input_ids"]
        labels = tokenizer(text_target=targets)["input_ids"]
        return {"input_ids": inputs, "labels": labels, "length": [len(i) for i in inputs]}
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos token: a causal LM could never learn where a target ends")
    # Prompt and target are tokenized apart so the mask falls exactly on the prompt's tokens.
    prompt_ids = tokenizer(prompts)["input_ids"]
    target_ids = tokenizer(targets, add_special_tokens=False)["input_ids"]
    input_ids, labels = [], []
    for p, t in zip(prompt_ids, target_ids, strict=True):
        input_ids.append(p + t + [tokenizer.eos_token_id])
        labels.append([-100] * len(p) + t + [tokenizer.eos_token_id])
    return {"input_ids": input_ids, "labels": labels, "length": [len(i) for i in input_ids]}


def tokenizer_fingerprint(tokenizer) -> str:
    """Vocabulary, merges, normalizer, added tokens and post-processor (all in the backend's JSON)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    extra = json.dumps([str(t) for t in tokenizer.all_special_tokens] + [len(tokenizer)])
    return hashlib.sha256((text + extra).encode()).hexdigest()[:16]


def source_fingerprint(source: str) -> str:
    """Content hash of a file (a copy hits the cache, an edit in the same second does not); an `hf:`
    dataset's own fingerprint."""
    if source.startswith("hf:"):
        return load_hf(source)._fingerprint
    return file_fingerprint(source)


def cache_key(source: str, spec: DataSpec, tokenizer, kind: str) -> str:
    """Everything the cached token ids depend on. Max lengths are left out on purpose: the cache holds
    untruncated ids, so changing them must not re-tokenize."""
    parts = [
        CACHE_VERSION,
        source_fingerprint(source),
        tokenizer_fingerprint(tokenizer),
        kind,
        spec.prompt_template or "",
        spec.input_field,
        spec.target_field,
    ]
    if spec.format != "fields":  # fields keys are as they were: caches made before formats stay valid
        parts += [spec.format, spec.conversation_field, spec.train_on, chat.template_of(tokenizer)]
    return content_hash(parts, CACHE_KEY_CHARS)


def tokenized(source: str, spec: DataSpec, tokenizer, kind: str) -> datasets.Dataset:
    """The tokenized examples of one file, from the disk cache when nothing that matters changed."""
    import datasets  # here, not at the top: an eval job reads prompts through this module without it

    key = cache_key(source, spec, tokenizer, kind)
    folder = cache_root() / "tokenized" / key
    if templated(
        spec, kind
    ):  # warned on every read, the cache's too: the job's log says it as preflight's does
        rows = read_rows(source, spec)
        warn_marker_text(tokenizer, [conversation(row, spec) for row in rows])
    if (folder / "dataset_info.json").is_file():
        log.info("tokenized %s: from cache %s", source, folder)
        return datasets.load_from_disk(str(folder))
    if templated(spec, kind):
        encoded = encode_conversations(tokenizer, rows, spec)
        dataset = datasets.Dataset.from_dict(encoded)
    else:
        prompts, targets = prompts_and_targets(source, spec, tokenizer, kind)
        text = datasets.Dataset.from_dict({"prompt": prompts, "target": targets})
        dataset = text.map(
            lambda batch: encode(tokenizer, batch["prompt"], batch["target"], kind),
            batched=True,
            remove_columns=["prompt", "target"],
            keep_in_memory=True,
            new_fingerprint=key,  # the key already says what this is; hashing the tokenizer again is slow
        )
    save_atomic(dataset, folder)
    log.info("tokenized %s: %d examples, cached in %s", source, len(dataset), folder)
    return datasets.load_from_disk(str(folder))


def save_atomic(dataset: datasets.Dataset, folder: Path) -> None:
    """`folder` written whole: saved beside it, then renamed. datasets writes the files itself, so the
    path is checked for a link below the cache root (`tokenized/` -> elsewhere, planted after the job
    started) immediately before the save and the rename (core/below.py check)."""
    tmp = folder.with_name(f"{folder.name}.{os.getpid()}.tmp")
    below.check(cache_root(), tmp)
    dataset.save_to_disk(str(tmp))
    try:
        below.check(cache_root(), folder)
    except below.LinkBelowRoot:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        os.replace(tmp, folder)
    except OSError:  # another job cached the same data meanwhile: theirs is as good
        shutil.rmtree(tmp, ignore_errors=True)


# ---- lengths ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LengthReport:
    max_length: int
    max_target_length: int | None  # seq2seq only: causal targets live inside max_length
    longest: int
    longest_target: int
    inputs_truncated: int  # examples longer than max_length (causal: prompt + target + eos)
    targets_truncated: int  # seq2seq targets longer than max_target_length (causal: 0, counted above)
    truncated_at: dict[int, int]  # fixed length → how many examples it would cut
    dropped: int = 0  # examples left out whole (pairs whose answer alone does not fit max_length)

    def describe(self) -> str:
        """What the lengths used cut, then, apart, what fixed lengths would have cut (before: "truncated: 0
        inputs" beside "examples truncated at fixed lengths: 2 at 128" read as a contradiction)."""
        cuts = ", ".join(f"{n} at {length}" for length, n in self.truncated_at.items())
        cut_targets = (
            f"; at max_target_length {self.max_target_length}: {self.targets_truncated} targets cut"
            if self.max_target_length
            else ""
        )
        return (
            f"longest example {self.longest} tokens (target {self.longest_target}); at max_length "
            f"{self.max_length}: {self.inputs_truncated} examples cut{cut_targets}; a fixed max_length "
            f"instead would cut: {cuts}"
        )


def round_up(value: int, multiple: int = 8) -> int:
    return -(-value // multiple) * multiple


def target_lengths(dataset: datasets.Dataset) -> list[int]:
    return [sum(1 for t in labels if t != -100) for labels in dataset["labels"]]


def pick_length(wanted: int | str, longest: int, max_positions: int | None, key: str) -> int:
    """`auto`: the smallest multiple of 8 that holds `longest`, but no more than the model has positions
    for; an explicit length is taken as it is (with a warning when the model cannot use it)."""
    if wanted != "auto":
        if max_positions is not None and wanted > max_positions:
            log.warning("data.%s %d is beyond the model's %d positions", key, wanted, max_positions)
        return wanted
    fits = round_up(longest)
    if max_positions is None or fits <= max_positions:
        return fits
    log.warning(
        "data.%s auto: the longest example has %d tokens but the model has %d positions "
        "(max_position_embeddings); capped at %d, longer examples are truncated",
        key,
        longest,
        max_positions,
        max_positions,
    )
    return max_positions


def choose_lengths(
    dataset: datasets.Dataset, spec: DataSpec, kind: str, max_positions: int | None = None
) -> LengthReport:
    """The lengths to cut at (see pick_length; `max_positions` None: relative positions, as T5's, have no
    maximum), and how many examples they cut."""
    lengths, targets = dataset["length"], target_lengths(dataset)
    longest, longest_target = max(lengths), max(targets)
    max_length = pick_length(spec.max_length, longest, max_positions, "max_length")
    target, targets_cut = None, 0
    if kind == "seq2seq":
        target = pick_length(spec.max_target_length, longest_target, max_positions, "max_target_length")
        targets_cut = sum(1 for x in targets if x > target)
    inputs_cut = sum(1 for x in lengths if x > max_length)
    truncated = {n: sum(1 for x in lengths if x > n) for n in FIXED_LENGTHS}
    return LengthReport(max_length, target, longest, longest_target, inputs_cut, targets_cut, truncated)


def cut(ids: list[int], limit: int, keep_last: bool) -> list[int]:
    """The first `limit` ids; with keep_last the final (eos) id survives, as tokenizer truncation does."""
    if len(ids) <= limit:
        return ids
    return ids[: limit - 1] + ids[-1:] if keep_last else ids[:limit]


def trained_tokens(dataset: datasets.Dataset, kind: str) -> list[int]:
    """Each example's prompt + target tokens as trained (after truncation): a causal (or image-text) example
    is one sequence; a seq2seq example is its encoder input plus its labels. The speed book's tokens/s and
    preflight's tokens per epoch both count this way, so estimates multiply like with like."""
    lengths = dataset["length"]
    if kind == "seq2seq":
        return [n + len(labels) for n, labels in zip(lengths, dataset["labels"], strict=True)]
    return list(lengths)


def labelled_tokens(dataset: datasets.Dataset) -> int:
    """Tokens the loss sees (labels other than -100), after truncation."""
    return sum(sum(1 for label in labels if label != -100) for labels in dataset["labels"])


def truncate(dataset: datasets.Dataset, lengths: LengthReport, kind: str = "causal") -> datasets.Dataset:
    """Cut to the chosen lengths; causal examples whose whole target was cut away are dropped (they would
    add nothing but a 0/0 loss)."""
    input_limit = lengths.max_length
    label_limit = lengths.max_target_length or lengths.max_length
    seq2seq = kind == "seq2seq"
    if "turn_ends" in dataset.column_names:  # a conversation: the collator takes ids and labels only
        cut_set = whole_turns(dataset, input_limit) if lengths.longest > input_limit else dataset
        return cut_set.remove_columns("turn_ends")
    if lengths.longest <= input_limit and lengths.longest_target <= label_limit:
        return dataset

    def cut_batch(batch):
        batch["input_ids"] = [cut(x, input_limit, seq2seq) for x in batch["input_ids"]]
        batch["labels"] = [cut(x, label_limit, seq2seq) for x in batch["labels"]]
        batch["length"] = [len(x) for x in batch["input_ids"]]
        return batch

    cut_set = dataset.map(cut_batch, batched=True, keep_in_memory=True)
    kept = cut_set.filter(lambda labels: any(t != -100 for t in labels), input_columns="labels")
    if len(kept) == 0:
        raise ValueError(
            f"max_length {input_limit} leaves no target token in any example (longest example "
            f"{lengths.longest} tokens): raise data.max_length or use 'auto'"
        )
    if len(kept) < len(cut_set):
        log.warning(
            "%d of %d examples dropped: max_length %d cuts their whole target (prompt too long)",
            len(cut_set) - len(kept),
            len(cut_set),
            input_limit,
        )
    return kept


def whole_turns(dataset: datasets.Dataset, limit: int) -> datasets.Dataset:
    """Conversations cut after their last whole assistant turn within `limit` tokens; those whose first
    answer does not fit are dropped, and both are counted (a turn cut mid-answer would teach the model to
    stop mid-sentence, and one without its end-of-turn never to stop)."""

    def cut_batch(batch):
        for index, ends in enumerate(batch["turn_ends"]):
            if batch["length"][index] <= limit:
                continue
            end = max((e for e in ends if e <= limit), default=0)
            batch["input_ids"][index] = batch["input_ids"][index][:end]
            batch["labels"][index] = batch["labels"][index][:end]
            batch["length"][index] = end
        return batch

    cut_set = dataset.map(cut_batch, batched=True, keep_in_memory=True)
    kept = cut_set.filter(lambda length: length > 0, input_columns="length")
    cut = sum(1 for n in dataset["length"] if n > limit)
    if len(kept) == 0:
        raise ValueError(
            f"max_length {limit} holds not even the first answer of any conversation (the shortest needs "
            f"{min(min(e) for e in dataset['turn_ends'])} tokens): raise data.max_length or use 'auto'"
        )
    log.warning(
        "%d of %d conversations are longer than max_length %d: %d cut after their last whole assistant turn "
        "that fits, %d dropped (not even their first answer fits)",
        cut,
        len(dataset),
        limit,
        cut - (len(dataset) - len(kept)),
        len(dataset) - len(kept),
    )
    return kept


def padding_fraction(lengths: list[int], order: list[int], batch_size: int, multiple: int = 1) -> float:
    """Share of pad tokens in the batches formed in `order` (dynamic padding to the longest, rounded up)."""
    padded = total = 0
    for start in range(0, len(order), batch_size):
        batch = [lengths[i] for i in order[start : start + batch_size]]
        padded += round_up(max(batch), multiple) * len(batch)
        total += sum(batch)
    return 1 - total / padded if padded else 0.0
