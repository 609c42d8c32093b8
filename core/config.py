"""The experiment schema: what a YAML file may say, checked before anything leaves the login node.

Torch-free on purpose: the launcher validates every experiment with these models on a login node, and the
trainer reads the very same objects inside the job. Every section forbids unknown keys, so a typo fails at
load time instead of being silently ignored after hours in the queue.
"""

from __future__ import annotations

import json
import math
import re
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from core import chat_templates, layout
from core.durations import TIME_FORMAT, slurm_seconds, slurm_time
from core.names import (
    DATA_FORMATS,
    DEFAULT_METRICS,
    DPO_LOSSES,
    GRPO_LOSSES,
    METRICS,
    NOT_A_GRPO_LOSS,
    NOT_A_REWARD,
    PREFERENCE,
    REWARD_SCORES,
    SPLITS,
    SQL_REWARD_SCORES,
    SQL_TIMEOUT_S,
    missing_inputs,
)

SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
# What SLURM accepts as partition, account and qos names (',' between several) and as a --constraint
# expression (features joined by & | , with [ ] ( ) grouping and *N counts). These values are written into
# the job script's `#SBATCH` lines, where a newline would start a line of shell: nothing else gets through.
SLURM_NAMES = re.compile(r"[A-Za-z0-9_.-]+(,[A-Za-z0-9_.-]+)*")
SLURM_CONSTRAINT = re.compile(r"[A-Za-z0-9_.\-&|,\[\]()*]+")

# Layers whose full matrices become trainable when listed in modules_to_save: a "LoRA" run then trains
# tens of percent of the model (46% for flan-t5-small) and saves a full-size copy of them.
FULL_MATRIX_MODULES = (
    "embed_tokens",
    "lm_head",
    "shared",
    "wte",
    "word_embeddings",
    "embed_out",
    "output",
)


def not_a_yes_or_no(value: object) -> object:
    """`value`, unless it is a boolean: pydantic reads True as 1 in a number's place, so `eval.limit: yes`
    scored one example and `adapter.rank: [8, true]` in a sweep trained rank 1."""
    if isinstance(value, bool):
        raise ValueError(f"{str(value).lower()} is a yes/no, not a number: write the number itself")
    return value


# Every whole-number and every real-number key of every section (and a sweep's values, which land in them):
# a boolean is refused where a number belongs; otherwise pydantic's usual reading (an int is a float).
Int = Annotated[int, BeforeValidator(not_a_yes_or_no)]
Float = Annotated[float, BeforeValidator(not_a_yes_or_no)]


class Section(BaseModel):
    # allow_inf_nan: YAML reads `.inf` and `.nan` as floats; no key of any section can run with one (an
    # alpha of inf trained to NaN and was reported complete; epochs: .inf crashed the dry run).
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class ModelSpec(Section):
    """The base model: a hub id (validated here, downloaded only on a compute node) or a local folder."""

    name_or_path: str = Field(
        description="The base model: a hub id or a local folder (`./…` or `/…`, which must exist). Preflight fetches a hub model on the login node and the jobs read it offline; with `cluster.yaml` `hub_downloads: nodes`, each job fetches it."
    )
    # image-text: a vision-language model (Qwen2.5-VL, Qwen3-VL) through AutoModelForImageTextToText and
    # AutoProcessor; its examples carry an image (data.image_field) besides their text.
    kind: Literal["seq2seq", "causal", "image-text"] = Field(
        description="`seq2seq` (T5, FLAN-T5), `causal` (Llama, Qwen, …) or `image-text` (Qwen2.5-VL, Qwen3-VL, loaded with `AutoModelForImageTextToText` and `AutoProcessor`; needs `data.image_field`). A kind the model's `config.json` contradicts is refused, naming the right one."
    )
    revision: str | None = Field(
        None,
        description="The hub revision (branch, tag or commit) of `name_or_path`; `null` takes the hub's default.",
    )
    added_tokens: list[str] = Field(default_factory=list, description="special tokens added before training")


def kind_mismatch(kind: str, model_config: dict) -> str | None:
    """Why a model whose config.json is `model_config` cannot be trained as `model.kind`, with the kind it
    is; None when it can (or its config does not say). Before: seq2seq on a Llama passed validation and
    failed on the node, with the library's words."""
    model_type = model_config.get("model_type", "?")
    encoder_decoder = bool(model_config.get("is_encoder_decoder"))
    vision = "vision_config" in model_config
    if kind == "seq2seq" and not encoder_decoder:
        right = "image-text" if vision else "causal"
        return f"is seq2seq, but this model ({model_type}) has no encoder-decoder: use model.kind: {right}"
    if kind == "causal" and encoder_decoder:
        return f"is causal, but this model ({model_type}) is an encoder-decoder: use model.kind: seq2seq"
    if kind == "causal" and vision:
        return f"is causal, but this model ({model_type}) reads images: use model.kind: image-text"
    if kind == "image-text" and not vision:
        right = "seq2seq" if encoder_decoder else "causal"
        return f"is image-text, but this model ({model_type}) has no vision tower: use model.kind: {right}"
    return None


class AdapterSpec(Section):
    method: Literal["lora", "qlora"] = Field(
        "lora",
        description="`lora`, or `qlora`: the base model loaded in 4 bits (bitsandbytes) with LoRA on top.",
    )
    rank: Annotated[Int, Field(ge=1, le=1024)] = Field(16, description="The LoRA rank, 1 to 1024.")
    alpha: Annotated[Float, Field(gt=0)] = Field(
        32, description="The LoRA alpha (> 0); the update is scaled by `alpha / rank`."
    )
    dropout: Annotated[Float, Field(ge=0, lt=1)] = Field(
        0.05, description="The LoRA dropout, in [0, 1); DPO and GRPO stages train without dropout."
    )
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear",
        description="The modules LoRA adapts: a non-empty list of module names, or `all-linear`. For `image-text` only the language model's Linear layers are adapted, by full name (a bare name would also hit the vision tower); `adapter_config.json` lists exactly what was trained.",
    )
    modules_to_save: list[str] = Field(
        default_factory=list,
        description="Extra modules trained in full and saved with the adapter. Embedding and output layers (`embed_tokens`, `lm_head`, `shared`, `wte`, `word_embeddings`, `embed_out`, `output`) are refused unless `allow_full_modules: true`: they make tens of percent of the model trainable.",
    )
    allow_full_modules: bool = Field(
        False,
        description="Allows embedding and output layers in `modules_to_save`, which otherwise refuses them.",
    )
    max_trainable_percent: Annotated[Float, Field(gt=0, le=100)] = Field(
        10.0,
        description="The trainer refuses to start when more than this percent of the model's parameters is trainable, naming the modules responsible; in (0, 100].",
    )
    quant_type: Literal["nf4", "fp4"] = Field(
        "nf4",
        description="`qlora`'s 4-bit quantisation type: `nf4` or `fp4`. An `image-text` model keeps its vision tower and `lm_head` out of 4-bit.",
    )
    double_quant: bool = Field(
        True, description="`qlora`: also quantise the quantisation constants (double quantisation)."
    )
    # image-text: LoRA goes on the language model's layers only, unless this widens it to the vision tower
    # (and its merger); the vision tower always stays out of 4-bit.
    train_vision: bool = Field(
        False,
        exclude_if=lambda value: value is False,
        description="`image-text` only: also adapt every Linear of the vision tower and its projector/merger (the vision tower still stays out of 4-bit).",
    )

    @field_validator("target_modules")
    @classmethod
    def _not_empty(cls, value):
        if isinstance(value, list) and not value:
            raise ValueError("is empty; name the projections to adapt or write 'all-linear'")
        return value

    @model_validator(mode="after")
    def _no_full_matrices(self):
        full = [m for m in self.modules_to_save if m.split(".")[-1] in FULL_MATRIX_MODULES]
        if full and not self.allow_full_modules:
            raise ValueError(
                f"modules_to_save: {full} makes those full matrices trainable (tens of percent of the model, "
                "saved in full with every adapter); remove them, or set adapter.allow_full_modules: true "
                "if you really mean it (added tokens are handled without this)"
            )
        return self


# The one rule for what a stage inherits (slurm/planning/validation.py inherited_section): a stage's data and
# train are the experiment's, changed by its own keys, except the experiment's keys that the stage's format
# or method does not read, which are the other stages' (`--dry-run` lists them per stage). A key here is read
# by these formats (data) or methods (train) only; DataSpec and TrainSpec refuse it elsewhere. data.train and
# data.eval are files written in the experiment's format: a stage of another format reads neither.
KEYS_OF_FORMATS = {
    "input_field": {"fields"},
    "target_field": {"fields"},
    "prompt_template": {"fields"},
    "messages_field": {"messages", "sharegpt"},
    "train_on": {"messages", "sharegpt", "alpaca"},
    "chat_template": {"messages", "sharegpt", "alpaca", PREFERENCE},
}
FILES_OF_A_FORMAT = ("train", "eval")
KEYS_OF_METHODS = {"dpo": {"dpo"}, "grpo": {"grpo"}}


class DataSpec(Section):
    """Where examples come from and how they become tokens. Paths are local files or `hf:NAME:SPLIT`."""

    train: str = Field(
        description="The training data: a `.jsonl`, `.csv` or `.parquet` file, or `hf:NAME:SPLIT` (e.g. `hf:b-mc2/sql-create-context:train[:95%]`). Required; `image-text` data must be a local file."
    )
    eval: str | None = Field(
        None,
        description="The held-out data, in the same forms as `train`; optional. The in-training loss eval, `train.early_stopping`, a sweep's `prune` and the eval job's default `eval.split: eval` read it.",
    )
    input_field: str = Field(
        "input", description="`format: fields` only: the column holding the model's input."
    )
    target_field: str = Field(
        "target", description="`format: fields` only: the column holding the target answer."
    )
    prompt_template: str | None = Field(None, description="e.g. 'question: {question} schema: {schema}'")
    max_length: Int | Literal["auto"] = Field(
        "auto",
        description="The token limit of an example's input (a causal model's prompt and answer together): a number ≥ 8, or `auto`, the smallest multiple of 8 covering the longest example, capped at the model's `max_position_embeddings`. Examples cut are counted (`summary.json` `truncated_inputs`).",
    )
    max_target_length: Int | Literal["auto"] = Field(
        "auto",
        description="`seq2seq` only (a causal answer counts inside `max_length`): the token limit of a target, a number ≥ 8 or `auto` (the smallest multiple of 8 covering the longest target, capped at the model's positions). Targets cut are counted (`truncated_targets`).",
    )
    order: Literal["shuffle", "file"] = Field("shuffle", description="'file' keeps a curriculum's order")
    num_workers: Annotated[Int, Field(ge=0)] | Literal["auto"] = Field(
        "auto", description="Dataloader workers: a number ≥ 0, or `auto` (up to 4 on a GPU, none on a CPU)."
    )
    # image-text only (left out of the spec, and so of its hash, when unset): the field holding each
    # example's image path, relative to the data file; and the bounds the processor resizes images into
    # (pixels, width x height), which decide how many image tokens an example costs.
    image_field: str | None = Field(
        None,
        exclude_if=lambda value: value is None,
        description="`image-text` only, and required there: the column holding each example's image path, relative to the data file. Every image must exist (a missing one is refused before anything is queued); local data files only, no `hf:`.",
    )
    min_pixels: Annotated[Int, Field(ge=1)] | None = Field(
        None,
        exclude_if=lambda value: value is None,
        description="`image-text` only: the smallest size (width × height, in pixels) the processor resizes each image into; unset, the processor's own. It decides how many image tokens an example costs and is saved with the adapter, so the eval resizes the same way.",
    )
    max_pixels: Annotated[Int, Field(ge=1)] | None = Field(
        None,
        exclude_if=lambda value: value is None,
        description="`image-text` only: the largest size (width × height, in pixels) the processor resizes each image into, at least `min_pixels`; unset, the processor's own. An example whose prompt, image and answer tokens exceed `max_length` is dropped and counted (`dropped_too_long`), never truncated.",
    )
    # How an example is written (core/conversations.py): `fields` (input_field, target_field,
    # prompt_template) or a conversation: `messages` ([{role, content}], OpenAI/TRL), `sharegpt`
    # ([{from, value}]), `alpaca` (instruction, input, output). Conversations are rendered with the model's
    # chat template (or `chat_template`, a name in core/chat_templates or inline Jinja) and, by default,
    # learn only the assistant turns (`train_on: all` learns every token). Each is left out of the spec
    # (and so of its hash) at its default, as image_field: stages trained before these keys existed keep
    # their identity.
    format: Literal[DATA_FORMATS] = Field(
        "fields",
        exclude_if=lambda value: value == "fields",
        description="How an example is written: `fields` (`input_field`, `target_field`, `prompt_template`); a conversation: `messages` (`{role, content}` turns), `sharegpt` (`{from, value}` turns) or `alpaca` (`instruction`, optional `input`, `output`); or `preference` (`{prompt, chosen, rejected}`, for `dpo` stages). `seq2seq` refuses `messages` and `sharegpt`.",
    )
    messages_field: str | None = Field(
        None,
        exclude_if=lambda value: value is None,
        description="`messages` and `sharegpt` only: the column holding the turns; unset, `messages` for `messages` and `conversations` for `sharegpt`.",
    )
    chat_template: str | None = Field(
        None,
        exclude_if=lambda value: value is None,
        description="Conversations and `preference` pairs only, not `seq2seq`: the template that renders them for training and eval, saved with the adapter and the export. Unset, the tokenizer's own (a model without one is refused); else `chatml`, `llama-3` or inline Jinja.",
    )
    train_on: Literal["assistant", "all"] = Field(
        "assistant",
        exclude_if=lambda value: value == "assistant",
        description="Conversations only (`messages`, `sharegpt`, `alpaca`; causal and image-text models): `assistant` puts the loss on each assistant turn's content and end-of-turn token, never on system/user turns or headers; `all` on every token.",
    )

    @property
    def conversation_field(self) -> str:
        """The field holding each example's turns (messages / sharegpt)."""
        return self.messages_field or {"sharegpt": "conversations"}.get(self.format, "messages")

    def scored_only(self, source: str) -> DataSpec:
        """This data as an eval reads it, scoring `source`: what only training reads (the training file, a
        curriculum's `order`, the loader's workers) at its default, so two evals of the same examples are
        one eval (a base row: slurm/planning/plan.py base_eval_content; a shared eval: EvalJob.sharing_key)."""
        return self.model_copy(update={"train": source, "order": "shuffle", "num_workers": "auto"})

    @model_validator(mode="after")
    def _keys_of_the_format(self):
        if self.format == "fields":
            written = [k for k in ("messages_field", "chat_template") if getattr(self, k) is not None]
            written += ["train_on"] if self.train_on != "assistant" else []
            if written:
                raise ValueError(
                    f"{', '.join(written)} {are(written)} for conversations (format: messages, sharegpt or alpaca); this "
                    "data is format: fields (input_field, target_field, prompt_template): set data.format, or "
                    "remove them"
                )
            return self
        defaults = {"input_field": "input", "target_field": "target"}
        written = [key for key, default in defaults.items() if getattr(self, key) != default]
        written += ["prompt_template"] if self.prompt_template is not None else []
        if written and self.format == PREFERENCE:
            raise ValueError(
                f"{', '.join(written)} {are(written)} for format: fields; a preference pair is {{prompt, "
                "chosen, rejected}: a string prompt is used as written, a prompt of turns is rendered by the "
                "chat template: remove them"
            )
        if written:
            raise ValueError(
                f"{', '.join(written)} {are(written)} for format: fields; a {self.format} example is rendered by the "
                "model's chat template (data.chat_template to choose another): remove them"
            )
        if self.format == PREFERENCE and (self.messages_field is not None or self.train_on != "assistant"):
            raise ValueError(
                "messages_field and train_on are not for format: preference; a pair is {prompt, chosen, "
                "rejected} (strings, or the prompt as turns and each answer as an assistant turn), and DPO "
                "learns from the answers only: remove them"
            )
        if self.messages_field is not None and self.format == "alpaca":
            raise ValueError(
                "messages_field is for format: messages or sharegpt; alpaca examples have the fields "
                "instruction, input (optional) and output"
            )
        return self

    @field_validator("chat_template")
    @classmethod
    def _template_known_or_parses(cls, value):
        if value is not None:
            chat_templates.check(value)
        return value

    @model_validator(mode="after")
    def _pixel_bounds_ordered(self):
        if self.min_pixels and self.max_pixels and self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels {self.min_pixels} is above max_pixels {self.max_pixels}")
        return self

    @field_validator("max_length", "max_target_length")
    @classmethod
    def _positive_length(cls, value):
        if isinstance(value, int) and value < 8:
            raise ValueError("must be at least 8 tokens, or 'auto' to fit the data")
        return value

    @field_validator("prompt_template")
    @classmethod
    def _template_parses(cls, value):
        if value is not None:
            placeholders(value)
        return value


class EarlyStopping(Section):
    patience: Annotated[Int, Field(ge=1)] = Field(
        2,
        description="Stop after this many in-training evals (≥ 1) without an improvement of more than `threshold`.",
    )
    threshold: Annotated[Float, Field(ge=0)] = Field(
        0.0, description="The smallest improvement of the metric (≥ 0) that counts as one."
    )
    metric: str = Field(
        "eval_loss",
        description="The metric watched: `eval_loss` (also written `loss`), the only one the loss-only in-training eval computes.",
    )

    @field_validator("metric")
    @classmethod
    def _computed_in_training(cls, value):
        if value.removeprefix("eval_") != "loss":
            raise ValueError(
                f"{value!r} is not computed during training: the in-training eval is loss-only (generation "
                "metrics come from the eval job, once); use eval_loss"
            )
        return value


class DpoSpec(Section):
    """`train.dpo`: the preference objective of a `train.method: dpo` stage (TRL's DPOTrainer)."""

    beta: Annotated[Float, Field(gt=0)] = Field(
        0.1, description="DPO's beta (> 0): how strongly the policy is held to the reference."
    )
    loss_type: Literal[DPO_LOSSES] = Field(
        "sigmoid",
        description="TRL's DPO loss: `sigmoid` (default), `hinge`, `ipo`, `exo_pair`, `nca_pair`, `robust`, `bco_pair`, `sppo_hard`, `aot`, `aot_unpaired`, `apo_zero`, `apo_down`, `discopop` or `sigmoid_norm`.",
    )
    # What the policy is compared against: the previous stage's adapter frozen, or the base model with
    # adapters disabled. Unset: previous after another stage, base for a first (or only) stage.
    reference: Literal["previous", "base"] | None = Field(
        None,
        exclude_if=lambda value: value is None,
        description="What the policy is compared against: `previous` (the previous stage's adapter, frozen) or `base` (the base model with adapters disabled). Unset: `previous` after another stage, `base` for a first stage, where `previous` is refused.",
    )


class RewardSpec(Section):
    """One term of a GRPO stage's reward (an entry of `rewards` in `train.grpo`): an eval score of the completion against
    the example's reference (`score`), or a user's function (`function: "module:name"`, importable from the
    config's folder, called as TRL calls a reward function). The terms are summed with their weights."""

    score: str | None = Field(
        None,
        exclude_if=lambda value: value is None,
        description="An eval score of the completion against the example's target, by the eval's own per-example code: `exact_match`, `rouge_1`, `rouge_2`, `rouge_l`, `sql_exec_accuracy`, `sql_record_f1` (partial credit) or `sql_executes` (1 when it runs); `bleu`, `bertscore_f1`, `sql_error_rate` are refused. Give `score` or `function`.",
    )
    function: str | None = Field(
        None,
        exclude_if=lambda value: value is None,
        description="`module:name`: a function in a .py file beside the config, called as TRL calls a reward function (`completions` are the cleaned texts, `reference` the targets). Give `score` or `function`, not both.",
    )
    weight: Float = Field(1.0, description="This term's weight in the summed reward.")
    # SQL scores only: the database the completions run against (default: eval.db), and each query's limit
    # (shorter than the eval's: a training step waits for every completion's query).
    db: str | None = Field(
        None,
        exclude_if=lambda value: value is None,
        description="SQL scores only: the SQLite database the completions run against; unset, `eval.db` (one of the two is required).",
    )
    timeout_s: Annotated[Float, Field(gt=0, le=60)] = Field(
        1.0,
        exclude_if=lambda value: value == 1.0,
        description="SQL scores only: each completion query's time limit in seconds, in (0, 60]; shorter than the eval's, since a training step waits for every query.",
    )

    @field_validator("score")
    @classmethod
    def _a_per_example_score(cls, value):
        if value is None or value in REWARD_SCORES:
            return value
        if value in NOT_A_REWARD:
            raise ValueError(f"{value} cannot be a reward: {NOT_A_REWARD[value]}")
        raise ValueError(f"{value!r} is no per-example score; rewards: {', '.join(REWARD_SCORES)}")

    @field_validator("function")
    @classmethod
    def _module_and_name(cls, value):
        if value is not None and not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", value):
            raise ValueError(
                f"{value!r} is not module:name (a function in a .py file beside the config, e.g. "
                "rewards:tiered for tiered() in rewards.py)"
            )
        return value

    @model_validator(mode="after")
    def _one_source(self):
        if (self.score is None) == (self.function is None):
            raise ValueError(
                "give one of score (an eval score, e.g. sql_exec_accuracy) or function (module:name)"
            )
        if self.score not in SQL_REWARD_SCORES and (
            self.db is not None or "timeout_s" in self.model_fields_set
        ):
            raise ValueError(
                "db and timeout_s are for the SQL scores (sql_exec_accuracy, sql_record_f1, sql_executes)"
            )
        return self

    @property
    def name(self) -> str:
        """The reward's name in metrics.jsonl and the logs: the score, or the function's name."""
        return self.score or self.function.rpartition(":")[2]


class GrpoSpec(Section):
    """`train.grpo`: a `train.method: grpo` stage (TRL's GRPOTrainer). Each prompt of the step gets
    `num_generations` completions, sampled at `temperature` up to `max_completion_length` tokens (they stop
    at the end of turn the eval stops at); each completion's reward is the weighted sum of `rewards`; its
    advantage is its reward against its group's. `beta` > 0 adds a KL term to `reference`. `from_base`:
    a first stage that knowingly starts from the base model (else preflight warns)."""

    num_generations: Annotated[Int, Field(ge=2)] = Field(
        4,
        description="Completions sampled per prompt (a group), ≥ 2. `train.batch_size` × `grad_accum` counts prompts; `train.micro_batch` counts completions.",
    )
    max_completion_length: Annotated[Int, Field(ge=1)] = Field(
        128,
        description="The most tokens a completion may have (≥ 1); it stops earlier at the eval's stop ids (eos, and the chat template's end of turn). The share cut is logged as `completions/clipped_ratio`.",
    )
    temperature: Annotated[Float, Field(gt=0)] = Field(
        1.0, description="The sampling temperature of the completions (> 0)."
    )
    beta: Annotated[Float, Field(ge=0)] = Field(
        0.0, description="The weight of a KL term against `reference` (≥ 0); `0.0` adds none."
    )
    loss_type: str = Field(
        "dapo",
        description="`dapo`, `grpo` or `dr_grpo`: the losses whose step is the same for any split into micro-batches and ranks. `bnpo` is refused (it normalises per micro-batch).",
    )
    reference: Literal["previous", "base"] | None = Field(
        None,
        exclude_if=lambda value: value is None,
        description="What the KL term (`beta` > 0) compares against: `previous` (the adapter the stage starts from, frozen) or `base`. Unset: `previous` after another stage, `base` for a first stage, where `previous` is refused.",
    )
    rewards: list[RewardSpec] = Field(
        default_factory=list,
        description="The reward terms, summed with their `weight`: each an eval score (`score`) or a user's function (`function`). At least one is required, and no reward name (the score, or the function's name) may repeat.",
    )  # none written: refused before queueing
    from_base: bool = Field(
        False,
        exclude=True,
        description="`true` says a first GRPO stage knowingly starts from the base model; otherwise the launch warns (a model that never earns a reward learns nothing). Not part of the stage's identity.",
    )  # a warning's switch, not what the stage computes

    @field_validator("loss_type")
    @classmethod
    def _split_free_loss(cls, value):
        if value in GRPO_LOSSES:
            return value
        if value in NOT_A_GRPO_LOSS:
            raise ValueError(f"{value} is refused: {NOT_A_GRPO_LOSS[value]}")
        raise ValueError(
            f"{value!r} is not a GRPO loss run here; use one of {', '.join(GRPO_LOSSES)} (losses whose step is "
            "the same for any split into micro-batches and ranks)"
        )

    @field_validator("rewards")
    @classmethod
    def _some_reward(cls, value):
        if not value:
            raise ValueError("is empty: a GRPO stage learns from rewards, e.g. [{score: sql_exec_accuracy}]")
        if repeated := repeats(reward.name for reward in value):
            raise ValueError(f"rewards repeat: {repeated} (give one entry a weight instead)")
        return value


class TrainSpec(Section):
    # sft: next-token loss on the answers; dpo: TRL's DPOTrainer on {prompt, chosen, rejected} pairs
    # (data.format: preference); grpo: TRL's GRPOTrainer on the SFT data's prompts, rewarded by train.grpo.
    # Left out of the spec (and so of its hash) at their defaults: every stage trained before these keys
    # existed keeps its identity.
    method: Literal["sft", "dpo", "grpo"] = Field(
        "sft",
        exclude_if=lambda value: value == "sft",
        description="`sft` (next-token loss on the answers), `dpo` (TRL's `DPOTrainer` on `data.format: preference` pairs) or `grpo` (TRL's `GRPOTrainer`, rewarded by `train.grpo`, on `fields` or conversation data). `dpo` and `grpo` train causal models only.",
    )
    dpo: DpoSpec | None = Field(
        None,
        exclude_if=lambda value: value is None,
        description="A `dpo` stage's objective (`beta`, `loss_type`, `reference`); refused on any other stage.",
    )
    grpo: GrpoSpec | None = Field(
        None,
        exclude_if=lambda value: value is None,
        description="A `grpo` stage's settings: sampling, loss, reference and `rewards`; refused on any other stage.",
    )
    epochs: Annotated[Float, Field(gt=0)] = Field(
        3, description="Passes over the training data (> 0, fractions allowed); `max_steps` overrides it."
    )
    max_steps: Annotated[Int, Field(ge=1)] | None = Field(
        None, description="Optimizer steps to train (≥ 1); when set, it overrides `epochs`."
    )
    learning_rate: Annotated[Float, Field(gt=0)] = Field(
        2e-4, description="The peak learning rate: above 0 and below 1e-2 (LoRA diverges above)."
    )
    batch_size: Annotated[Int, Field(ge=1)] = Field(
        8,
        description="Examples per rank per accumulation step (≥ 1); the effective batch is `batch_size` × `grad_accum` × ranks, however `micro_batch` splits it. A GRPO stage counts prompts.",
    )
    grad_accum: Annotated[Int, Field(ge=1)] = Field(
        1,
        description="Accumulation steps per optimizer step (≥ 1); the effective batch is `batch_size` × `grad_accum` × ranks. An elastic job (`resources.nodes: min-max`) accumulates `grad_accum` × max / n on n nodes.",
    )
    # How the effective batch (batch_size x grad_accum per rank) is split on a GPU: auto chooses the
    # largest micro-batch that fits (core/split.py); N is honoured as written. Not part of a stage's
    # identity: the split does not change what is computed.
    micro_batch: Literal["auto"] | Annotated[Int, Field(ge=1)] = Field(
        "auto",
        description="How a GPU splits each rank's `batch_size` × `grad_accum` (× `grpo.num_generations` in a GRPO stage): `auto` takes the largest divisor whose step fits the GPU's free memory without gradient checkpointing; `N` must divide it and is used as written. Not part of the stage's identity.",
    )
    warmup_ratio: Annotated[Float, Field(ge=0, le=0.5)] = Field(
        0.03, description="The share of steps spent warming up the learning rate, in [0, 0.5]."
    )
    weight_decay: Annotated[Float, Field(ge=0, le=1)] = Field(
        0.0, description="The optimizer's (AdamW) weight decay, in [0, 1]."
    )
    scheduler: Literal["linear", "cosine", "constant", "constant_with_warmup"] = Field(
        "linear",
        description="The learning-rate schedule: `linear`, `cosine`, `constant` or `constant_with_warmup`.",
    )
    precision: Literal["auto", "bf16", "fp16", "fp32"] = Field(
        "auto",
        description="`auto` (bf16 on a GPU that has it, fp16 AMP on one that has not, fp32 on a CPU), `bf16`, `fp16` or `fp32`. What a device cannot do falls back with a warning; `summary.json` records what ran, and the eval loads the adapter in it.",
    )
    gradient_checkpointing: bool = Field(
        False,
        description="Keeps gradient checkpointing on (saves memory, costs about 30% speed) whatever `micro_batch` chooses; `micro_batch: auto` turns it on by itself only when nothing fits without it.",
    )
    eval_every_epochs: Annotated[Float, Field(gt=0)] | None = Field(
        1,
        description="How often, in epochs (> 0), the loss-only in-training eval runs on `data.eval`; `null`: never.",
    )
    early_stopping: EarlyStopping | None = Field(
        None,
        description="`{patience, threshold, metric}`: stop when the in-training eval loss stops improving. Needs `data.eval` and `eval_every_epochs`; refused on GRPO stages.",
    )
    save_every_steps: Annotated[Int, Field(ge=1)] = Field(
        200,
        description="Checkpoint interval in steps (≥ 1): where a resume after a time limit or preemption starts.",
    )
    logging_steps: Annotated[Int, Field(ge=1)] = Field(
        10, description="Steps between rows of `metrics.jsonl` (≥ 1)."
    )
    seed: Annotated[Int, Field(ge=0, le=2**32 - 1)] = Field(
        42, description="The training seed, 0 to 2^32 − 1; a sweep's `seeds` set it per replicate."
    )  # what torch, numpy and random all accept

    @field_validator("learning_rate")
    @classmethod
    def _lora_learning_rate(cls, value):
        if value >= 1e-2:
            raise ValueError(
                f"{value:g} is far too high for LoRA and diverges; use 1e-5 to 5e-4 (2e-4 is a good start)"
            )
        return value

    @model_validator(mode="after")
    def _micro_batch_divides(self):
        effective = self.batch_size * self.grad_accum * self.completions_per_example
        if self.micro_batch != "auto" and effective % self.micro_batch:
            fitting = ", ".join(str(d) for d in range(1, effective + 1) if effective % d == 0)
            counted = " x grpo.num_generations" if self.method == "grpo" else ""
            raise ValueError(
                f"micro_batch {self.micro_batch} does not divide the effective batch batch_size x grad_accum"
                f"{counted} = {effective} (the loss is the same for any exact split): use one of {fitting}, or auto"
            )
        return self

    @property
    def completions_per_example(self) -> int:
        """Sequences a step trains per example: a GRPO stage's batch_size counts prompts, each with
        num_generations completions, and its micro_batch counts completions; any other stage's, one."""
        return self.reward_objective.num_generations if self.method == "grpo" else 1

    @field_validator("dpo")
    @classmethod
    def _dpo_keys_on_a_dpo_stage(cls, value, info: ValidationInfo):
        method = info.data.get("method")  # method is checked before dpo
        if value is not None and method is not None and method != "dpo":
            raise ValueError(
                f"is the preference objective's block, but this stage is train.method: {method}; set "
                "train.method: dpo (with data.format: preference), or remove train.dpo"
            )
        return value

    @field_validator("grpo")
    @classmethod
    def _grpo_keys_on_a_grpo_stage(cls, value, info: ValidationInfo):
        method = info.data.get("method")
        if value is not None and method is not None and method != "grpo":
            raise ValueError(
                f"is a GRPO stage's block, but this stage is train.method: {method}; set train.method: grpo, "
                "or remove train.grpo"
            )
        return value

    @property
    def preference(self) -> DpoSpec:
        """The DPO block as it runs (its defaults when none is written)."""
        return self.dpo or DpoSpec()

    @property
    def reward_objective(self) -> GrpoSpec:
        """The GRPO block as it runs (its defaults when none is written: no rewards, refused before queueing)."""
        return self.grpo or GrpoSpec()

    @model_validator(mode="after")
    def _early_stopping_needs_eval(self):
        if self.early_stopping and self.eval_every_epochs is None:
            raise ValueError("early_stopping needs eval_every_epochs (it stops on the eval metric)")
        return self

    def steps_per_epoch(self, examples: int, ranks: int) -> int:
        """Optimizer steps per epoch as the Trainer counts them (each rank takes its own batches; a last,
        shorter accumulation still steps): the recipe's eval interval and the estimator's work."""
        batches = math.ceil(examples / (self.batch_size * ranks))
        return max(1, math.ceil(batches / self.grad_accum))


def slurm_names(value: str) -> str:
    if not SLURM_NAMES.fullmatch(value):
        raise ValueError(
            f"{value!r} is not a SLURM name: use letters, digits, '_', '-' and '.', with ',' between several "
            "(no spaces or newlines: it is written into the job script's #SBATCH lines)"
        )
    return value


def slurm_constraint(value: str) -> str:
    if not SLURM_CONSTRAINT.fullmatch(value):
        raise ValueError(
            f"{value!r} is not a SLURM feature expression: feature names (letters, digits, '_', '-', '.') "
            "joined by '&', '|' or ',', grouped with [ ] or ( ), counted with *N, e.g. 'a100&ib' "
            "(no spaces or newlines: it is written into the job script's #SBATCH lines)"
        )
    return value


ASCII_DIGITS = re.compile(r"[0-9]+")


def ascii_int(text: str) -> int | None:
    """The integer `text` spells in ASCII digits (spaces around allowed), else None. str.isdigit() also
    takes '²' and other digits int() refuses: a scheduler tool's odd output crashed the login node."""
    text = str(text).strip()
    return int(text) if ASCII_DIGITS.fullmatch(text) else None


def slurm_duration(value: str | int) -> str:
    """A SLURM time limit, 'HH:MM:SS' or 'D-HH:MM:SS', wherever one is written: `resources.time`,
    `eval.resources.time`, cluster.yaml's `max_time` and `budget`, `--budget`. An int is how YAML 1.1
    reads an unquoted 6:00:00 (base-60 seconds, 21600): taken as that duration."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        value = slurm_time(value)
    if not isinstance(value, str) or not TIME_FORMAT.match(value):
        raise ValueError(f"{value!r} must look like HH:MM:SS or D-HH:MM:SS (e.g. '04:00:00')")
    return value


def slurm_duration_or_auto(value: str | int) -> str:
    try:
        return value if value == "auto" else slurm_duration(value)
    except ValueError as exc:
        raise ValueError(f"{exc}, or be 'auto' (the plan sets it from the job's estimate)") from None


NODE_RANGE = re.compile(r"\s*(\d+)\s*-\s*(\d+)\s*")


def whole_nodes(value):
    """`resources.nodes`: a whole number, or SLURM's `min-max` (an elastic job, read into `nodes` = max and
    `min_nodes` = min by Resources before this runs); a range left here is malformed, and said so."""
    if isinstance(value, str) and (found := NODE_RANGE.fullmatch(value)):
        low, high = (int(part) for part in found.groups())
        if low > high:
            raise ValueError(f"the range {value!r} starts above its end; write min-max with min <= max")
        raise ValueError(f"the range {value!r} starts at {low} nodes; a job runs on 1 node at least")
    return value


SlurmTime = Annotated[str, BeforeValidator(slurm_duration)]
SlurmTimeOrAuto = Annotated[str, BeforeValidator(slurm_duration_or_auto)]
SlurmNames = Annotated[str, AfterValidator(slurm_names)]
SlurmConstraint = Annotated[str, AfterValidator(slurm_constraint)]
# sbatch --mail-type values worth asking for (SLURM mails the submitting user, or cluster.yaml's mail_user).
MailType = Literal["BEGIN", "END", "FAIL", "REQUEUE", "ALL", "TIME_LIMIT", "TIME_LIMIT_90", "TIME_LIMIT_80"]
SLURM_TIMER_S = 30


class Resources(Section):
    # gpus > 1: one process (SLURM task) per GPU, data parallel (DDP); `gpus`, `cpus` and `mem_gb` are each
    # node's, `cpus` split evenly over a node's tasks. `nodes` > 1: the same on every node, one DDP run of
    # nodes x gpus ranks (slurm/cluster/rendezvous.py: where they meet).
    gpus: Annotated[Int, Field(ge=0)] = Field(
        1,
        description="GPUs per node (≥ 0; 0 runs on CPUs). N > 1 trains data parallel: one SLURM task and DDP rank per GPU, `cpus` split evenly over them. At most `cluster.yaml`'s `max_gpus_per_node`.",
    )
    nodes: Annotated[Int, BeforeValidator(whole_nodes), Field(ge=1)] = Field(
        1,
        description="Nodes of the job (≥ 1), each with the same `gpus`, `cpus` and `mem_gb`: one DDP run of nodes × `gpus` ranks. `min-max` (e.g. `1-2`) is elastic, read as `nodes: max` and `min_nodes: min`, keeping max nodes' global batch at every size. At most `cluster.yaml`'s `max_nodes`.",
    )
    # `nodes: 1-2` (SLURM's --nodes=min-max): elastic, the job starts on what SLURM gives and may come back
    # on fewer nodes after a requeue; read as nodes 2 (what the global batch, GPU-hours and the budget count)
    # and min_nodes 1. Left out at None, so every fixed-size job keeps its spec.
    min_nodes: Annotated[Int, Field(ge=1)] | None = Field(
        None,
        exclude_if=lambda value: value is None,
        description="An elastic job's fewest nodes, at most `nodes`; usually written through `nodes: min-max`. Unset: a fixed size.",
    )
    # "auto": the plan sets it from the job's estimate (slurm/planning/estimate.py); every consumer sees a time.
    time: SlurmTimeOrAuto = Field(
        "04:00:00",
        description="The time limit: `HH:MM:SS` or `D-HH:MM:SS` (an unquoted `6:00:00` is read right), or `auto`: the job's estimate × 1.3 (× 4 for a guessed speed) + `signal_delay_s` + 5 minutes, rounded up to 5 minutes, at most `cluster.yaml`'s `max_time`. `auto` is refused with `hf:` data.",
    )
    mem_gb: Annotated[Float, Field(gt=0)] = Field(
        32, description="Memory per node in GB (> 0); at most `cluster.yaml`'s `max_mem_gb_per_node`."
    )
    cpus: Annotated[Int, Field(ge=1)] = Field(
        8,
        description="CPUs per node (≥ 1), split evenly over its tasks; at most `cluster.yaml`'s `max_cpus_per_node`.",
    )
    partition: SlurmNames | None = Field(
        None,
        description="The SLURM partition; unset, `cluster.yaml`'s. Letters, digits, `_`, `-` and `.`, with `,` between several.",
    )
    account: SlurmNames | None = Field(
        None,
        description="The SLURM account; unset, `cluster.yaml`'s. Letters, digits, `_`, `-` and `.`, with `,` between several.",
    )
    qos: SlurmNames | None = Field(
        None,
        description="The SLURM QOS; unset, `cluster.yaml`'s. Letters, digits, `_`, `-` and `.`, with `,` between several.",
    )
    constraint: SlurmConstraint | None = Field(
        None,
        description="The SLURM `--constraint`: features joined by `&`, `|` or `,`, grouped with `[ ]` or `( )`, counted with `*N` (e.g. `a100&ib`); no spaces, quotes or shell characters.",
    )
    signal_delay_s: Annotated[Int, Field(ge=10)] = Field(
        120,
        description="Seconds before the limit SLURM sends USR2 (≥ 10): the job checkpoints, requeues and resumes. `signal_delay_s` + 30 must stay below a written `time` (SLURM may signal up to 30 s early).",
    )
    max_requeues: Annotated[Int, Field(ge=0)] = Field(
        3, description="Time-limit requeues (≥ 0) before the job is left failed."
    )
    mail: list[MailType] = Field(default_factory=list, description="sbatch --mail-type, e.g. [END, FAIL]")

    @model_validator(mode="before")
    @classmethod
    def _node_range(cls, values):
        """`nodes: 1-2` → nodes 2, min_nodes 1; a malformed range is left to `whole_nodes`, which names it."""
        if isinstance(values, dict) and isinstance(values.get("nodes"), str):
            found = NODE_RANGE.fullmatch(values["nodes"])
            low, high = (int(part) for part in found.groups()) if found else (0, 0)
            if 1 <= low <= high:
                values = {**values, "nodes": high, "min_nodes": low if low < high else None}
        return values

    @model_validator(mode="after")
    def _min_nodes_at_most_nodes(self):
        if self.min_nodes is not None and self.min_nodes > self.nodes:
            raise ValueError(f"min_nodes {self.min_nodes} is above nodes {self.nodes}; write nodes: min-max")
        return self

    @model_validator(mode="after")
    def _signal_inside_the_limit(self):
        # slurmctld looks at time limits every 30 s, so the signal can come up to 30 s before it was asked for.
        # An auto limit always leaves room: it is the estimate plus the signal delay plus a margin.
        if self.time != "auto" and self.signal_delay_s + SLURM_TIMER_S >= self.time_s:
            raise ValueError(
                f"signal_delay_s {self.signal_delay_s} leaves no time to train in time {self.time!r}: SLURM may "
                f"signal up to {SLURM_TIMER_S} s early, so the job would be told to checkpoint and requeue as "
                "soon as it starts, over and over; make it at most half the time limit"
            )
        return self

    @property
    def time_s(self) -> int:
        if self.time == "auto":
            raise ValueError("time 'auto' has no seconds until the plan resolves it (slurm/planning/plan.py)")
        return slurm_seconds(self.time)

    @property
    def timeout_min(self) -> int:
        return max(1, -(-self.time_s // 60))

    @property
    def tasks_per_node(self) -> int:
        """Processes on each node: one per GPU (DDP), one for a CPU or one-GPU job."""
        return max(1, self.gpus)

    @property
    def tasks(self) -> int:
        """Processes of the job, every node's: its DDP world size."""
        return self.tasks_per_node * self.nodes

    @property
    def total_gpus(self) -> int:
        """The GPUs the job holds on all its nodes: what GPU-hours and a per-user GPU cap count."""
        return self.gpus * self.nodes

    @property
    def elastic(self) -> bool:
        """`nodes: min-max` with min < max: the job runs on as many nodes as SLURM gives, its math at max."""
        return self.min_nodes is not None and self.min_nodes < self.nodes

    @property
    def node_count(self) -> str:
        """What sbatch --nodes gets: `2`, or `1-2` for an elastic job."""
        return f"{self.min_nodes}-{self.nodes}" if self.elastic else str(self.nodes)

    def placement(self) -> str:
        """`2 nodes x 4 GPUs`, `1-2 nodes x 4 GPUs`, `4 GPUs`, `CPU`: how the dry run and --json say where a
        job runs."""
        gpus = f"{self.gpus} GPU{'s' if self.gpus != 1 else ''}" if self.gpus else "CPU"
        return f"{self.node_count} nodes x {gpus}" if self.nodes > 1 else gpus


# An eval job's limit when it scores an `hf:` dataset (fetched on the node: nothing to estimate from) and
# eval.resources.time is left out.
EVAL_TIME_WITHOUT_ESTIMATE = "01:00:00"


class EvalResources(Resources):
    """The eval job's own allocation (`eval.resources`): generating and scoring needs far less than training.

    Left out, `gpus` is 1, or 0 when training asks for none (a CPU experiment's eval stays on CPUs); `cpus`,
    `mem_gb`, `partition`, `account`, `qos`, `constraint` and `mail` are the training job's; `time` is
    `auto` (the plan sets it from the eval's estimate), or EVAL_TIME_WITHOUT_ESTIMATE for an `hf:` dataset.
    """

    gpus: Annotated[Int, Field(ge=0)] | None = Field(
        None,
        description="The eval job's GPUs: 0 or 1 (generation runs as one process). Unset: 1, or 0 when `resources.gpus` is 0.",
    )
    time: SlurmTimeOrAuto | None = Field(
        None,
        description="The eval job's limit: `HH:MM:SS`, `D-HH:MM:SS` or `auto` (the eval's estimate × 1.3 + `signal_delay_s` + 5 minutes; at least an hour while its speed is a guess). Unset: `auto`, or `01:00:00` when the scored data is `hf:`, where `auto` is refused.",
    )
    mem_gb: Annotated[Float, Field(gt=0)] | None = Field(
        None, description="The eval job's memory per node in GB (> 0); unset, the training job's."
    )
    cpus: Annotated[Int, Field(ge=1)] | None = Field(
        None, description="The eval job's CPUs (≥ 1); unset, the training job's."
    )
    mail: list[MailType] | None = Field(
        None,
        description="The eval job's sbatch `--mail-type`s; unset, the training job's, and `[]` silences them.",
    )

    @model_validator(mode="after")
    def _signal_inside_the_limit(self):
        return self if self.time is None else Resources._signal_inside_the_limit(self)

    def for_training(self, training: Resources, source: str) -> Resources:
        """The resources of the eval job that follows a training job holding `training` and scores the
        data file `source`."""
        inherited = ("cpus", "mem_gb", "partition", "account", "qos", "constraint", "mail")
        values = self.model_dump()
        values.update({k: getattr(training, k) for k in inherited if values[k] is None})
        if values["gpus"] is None:
            values["gpus"] = min(1, training.gpus)
        if values["time"] is None:
            values["time"] = EVAL_TIME_WITHOUT_ESTIMATE if source.startswith("hf:") else "auto"
        return Resources(**values)


Metric = Literal[METRICS]  # core/names.py owns the list


class GenerationSpec(Section):
    """How the eval job decodes (`eval.generation`), besides `eval.num_beams` and `eval.max_new_tokens`:
    greedy, or beam search with num_beams > 1; never sampled (scores must be reproducible). Whatever else
    the base model's generation_config.json says (a Qwen Instruct model's repetition_penalty 1.05, its
    sampling, top_k, ...) is overridden: it would change the predictions (eval/generate.py)."""

    repetition_penalty: Annotated[Float, Field(gt=0)] = Field(
        1.0,
        description="> 0: 1.0 is none; above 1 discourages tokens already in the output (and, for causal models, the prompt).",
    )
    no_repeat_ngram_size: Annotated[Int, Field(ge=0)] = Field(
        0, description="Above 0, never repeat an n-gram of this size; 0 is none."
    )
    length_penalty: Float = Field(1.0, description="beam search only: above 1 favours longer outputs")


class EvalSpec(Section):
    metrics: list[Metric] = Field(
        default_factory=lambda: list(DEFAULT_METRICS),
        description="What the eval job scores: any of `rouge`, `rouge_l`, `bleu`, `exact_match`, `sql_exec` (needs `db`) and `bertscore` (needs `bertscore_model`); `[]` runs no eval job.",
    )
    num_beams: Annotated[Int, Field(ge=1, le=16)] = Field(
        1, description="1 decodes greedily, more (up to 16) by beam search; never sampled."
    )
    max_new_tokens: Annotated[Int, Field(ge=1)] = Field(
        128, description="The most tokens generated per prediction (≥ 1)."
    )
    batch_size: Annotated[Int, Field(ge=1)] = Field(
        16, description="Examples generated per batch in the eval job (≥ 1)."
    )
    db: str | None = Field(
        None,
        description="SQLite file the sql_exec metric runs queries against (read-only)",
    )
    sql_timeout_s: Annotated[Float, Field(gt=0)] = Field(
        SQL_TIMEOUT_S,
        description="`sql_exec`'s limit per query in seconds, fetching its rows included (> 0); `python -m eval score --sql-timeout-s` has the same default.",
    )
    # Left out of the spec (and so of its hash) at their defaults, as `split` below: evals finished before
    # these keys existed are not run again.
    bertscore_model: str | None = Field(
        None,
        description="the bertscore metric's model: a local folder or a hub id (fetched by preflight on the login node, or by the eval job with `hub_downloads: nodes`); required with `bertscore`",
        exclude_if=lambda model: model is None,
    )
    bertscore_rescale: bool = Field(
        False,
        description="rescale bertscore with bert-score's baseline for the model (hub ids it ships one for)",
        exclude_if=lambda rescale: rescale is False,
    )
    after_each_stage: bool = Field(
        False, description="Also evaluates every intermediate stage, each a report row `EXP @ STAGE`."
    )
    # The base model scored without an adapter on the same prompts, one shared job per base + eval data +
    # settings (slurm/planning/plan.py): the report's "base (no adapter)" row. Not the eval's identity.
    baseline: bool = Field(
        False,
        exclude=True,
        description="Also scores the base model without an adapter on the same prompts, metrics, generation settings and split: the report's `base (no adapter)` row and Δ columns. One shared job per base model + eval data + settings; not part of the identity. `true` in `base.yaml`; none with `model.added_tokens`.",
    )
    # On SLURM, a sweep's evals that load the same base with the same data and settings are one job that
    # loads it once and scores each adapter in turn (slurm/planning/shared_evals.py); false: a job each.
    # How it runs, not what it computes: not in the eval's identity.
    shared: bool = Field(
        True,
        exclude=True,
        description="On SLURM, a sweep's evals that load the same base model the same way, on the same examples and settings, run as one job scoring each adapter in turn after every training ended; `false`: a job each. Not part of the eval's identity.",
    )
    split: Literal[SPLITS] = Field(
        "eval",
        description="the data scored: data.eval, or `train` to knowingly score on the training data",
        # Left out of the spec (and so of its hash) at its default: evals finished before this key existed
        # keep their hash and are not run again.
        exclude_if=lambda split: split == "eval",
    )
    generation: GenerationSpec = Field(
        default_factory=GenerationSpec,
        # Left out of the spec (and so of its hash) at its default, as `split`: evals finished before this
        # key existed are not run again.
        exclude_if=lambda generation: generation == GenerationSpec(),
        description="The decoding settings besides `num_beams` and `max_new_tokens`; the base model's `generation_config.json` settings are overridden (only its bos, eos, pad and decoder-start ids are kept). At its defaults, not part of the eval's hash.",
    )
    # Scheduler business, not the job's identity: changing it does not make a finished eval run again.
    resources: EvalResources = Field(
        default_factory=EvalResources,
        exclude=True,
        description="The eval job's own allocation (the keys of `resources`); what it leaves out is the training job's. Not part of the eval's identity.",
    )
    limit: Annotated[Int, Field(ge=1)] | None = Field(
        None, description="score only the first N eval examples"
    )
    # A conversation of several exchanges: score its last assistant turn only (the prompt is everything
    # before it), or every assistant turn, each given the conversation before it as written (`all`). Left
    # out of the spec (and so of its hash) at its default, as `split`.
    turns: Literal["last", "all"] = Field(
        "last",
        exclude_if=lambda turns: turns == "last",
        description="Conversations (`messages`, `sharegpt`): `last` scores each conversation's last assistant turn, given everything before it; `all` scores every assistant turn, each given the conversation before it. `all` is refused for other formats and for `image-text`.",
    )

    @model_validator(mode="after")
    def _metrics_have_their_inputs(self):
        given = {"db": self.db, "bertscore_model": self.bertscore_model}
        for metric, name, what in missing_inputs(self.metrics, given):
            raise ValueError(f"metric {metric} needs eval.{name} ({what})")
        return self


class StageSpec(Section):
    """One training stage as written in YAML: a name plus changes to `data` and `train`."""

    name: str = Field(
        description="The stage's name, unique in the experiment: letters, digits, `-`, `_`, `.` (starting with a letter or digit, at most 64), and none the run folders reserve (e.g. `eval`, `export`, `eval-…`, `export-…`, `…-calibrate`). The job is `EXP/NAME`."
    )
    data: dict = Field(
        default_factory=dict,
        description="The stage's changes to the experiment's `data`, merged key by key over it. It does not inherit the experiment's keys its `format` does not read, nor `data.train`/`data.eval` when its `format` differs from the experiment's.",
    )
    train: dict = Field(
        default_factory=dict,
        description="The stage's changes to the experiment's `train`, merged key by key over it; the experiment's `train.dpo` and `train.grpo` reach only stages of that `method`.",
    )

    @field_validator("name")
    @classmethod
    def _safe(cls, value):
        return free_name(safe_name(value), layout.taken_stage_name(value), "stage")


# Where curves go besides metrics.jsonl (train/tracking.py); not part of a job's identity.
Tracker = Literal["tensorboard", "wandb"]


class Experiment(Section):
    name: str = Field(
        description="Letters, digits, `-`, `_`, `.` (starting with a letter or digit, at most 64 characters); it becomes `runs/NAME/` and the SLURM job name `NAME/STAGE`. Names the run and log folders use themselves (`report.md`, `packs`, …) are refused."
    )
    description: str = Field("", description="Free text, shown in the report.")
    task: str | None = Field(
        None,
        description="what the experiment is measured on (e.g. squad-qg); the report puts published baselines "
        "of the same task beside it, and only those",
    )
    model: ModelSpec = Field(description="The base model (`model:` section).")
    adapter: AdapterSpec = Field(AdapterSpec(), description="The LoRA or QLoRA adapter (`adapter:` section).")
    data: DataSpec = Field(
        description="The data and how examples become tokens (`data:` section); each stage merges its own `data` over it."
    )
    train: TrainSpec = Field(
        TrainSpec(),
        description="How each stage trains (`train:` section); each stage merges its own `train` over it.",
    )
    eval: EvalSpec = Field(
        EvalSpec(),
        description="The eval job: metrics, decoding, the split scored and its own resources (`eval:` section).",
    )
    resources: Resources = Field(
        Resources(), description="Each training job's SLURM allocation (`resources:` section)."
    )
    tracking: list[Tracker] = Field(
        default_factory=lambda: ["tensorboard"], description="tensorboard (RUN_DIR/tb), wandb (opt-in)"
    )
    stages: list[StageSpec] = Field(
        default_factory=lambda: [StageSpec(name="train")],
        description="Training stages in order, each `{name, data, train}`; stage N+1 starts from stage N's adapter (`afterok`). Left out: one stage named `train`. Not empty; names are unique.",
    )
    after: list[str] = Field(
        default_factory=list,
        description="experiments that must end first (ordering only)",
    )

    @field_validator("after", mode="before")
    @classmethod
    def _one_name_is_a_list_of_one(cls, value):
        return [value] if isinstance(value, str) else value  # `after: x` means what `after: [x]` does

    @field_validator("name")
    @classmethod
    def _safe(cls, value):
        return free_name(safe_name(value), layout.taken_experiment_name(value), "experiment")

    @model_validator(mode="after")
    def _images_match_the_model(self):
        images = self.model.kind == "image-text"
        if images and not self.data.image_field:
            raise ValueError(
                "model.kind image-text needs data.image_field: the field of each example that holds its "
                "image's path (relative to the data file), e.g. `image_field: image`"
            )
        if not images and (self.data.image_field or self.data.min_pixels or self.data.max_pixels):
            raise ValueError(
                f"data.image_field, min_pixels and max_pixels are for model.kind image-text; this model is "
                f"{self.model.kind}: remove them, or set model.kind: image-text"
            )
        if images and self.model.added_tokens:
            raise ValueError(
                "model.added_tokens is not supported for image-text models yet (their processor and "
                "vision placeholders would need resizing too); remove it"
            )
        remote = [s for s in (self.data.train, self.data.eval) if s and s.startswith("hf:")]
        if images and remote:
            raise ValueError(
                f"image-text data must be local files (JSONL/CSV/Parquet with image paths), not {remote[0]}"
            )
        if not images and self.adapter.train_vision:
            raise ValueError("adapter.train_vision is for model.kind image-text; remove it")
        return self

    @model_validator(mode="after")
    def _format_fits_the_model(self):
        if self.model.kind != "seq2seq" or self.data.format == "fields":
            return self
        if self.data.format in ("messages", "sharegpt"):
            raise ValueError(
                f"data.format {self.data.format} is rendered with a chat template, and seq2seq models (T5) "
                "have none: use format: alpaca (instruction and input → the encoder, output → the target) or "
                "format: fields"
            )
        if self.data.chat_template is not None or self.data.train_on != "assistant":
            raise ValueError(
                "data.chat_template and train_on are for causal and image-text models: a seq2seq model reads "
                "an alpaca example as input (instruction and input) and target (output); remove them"
            )
        return self

    @model_validator(mode="after")
    def _turns_of_a_conversation(self):
        if self.eval.turns == "all" and self.data.format not in ("messages", "sharegpt"):
            raise ValueError(
                f"eval.turns: all scores every assistant turn of a conversation, and data.format "
                f"{self.data.format} has one answer per example: remove it (or use messages or sharegpt data)"
            )
        if self.eval.turns == "all" and self.model.kind == "image-text":
            raise ValueError("eval.turns: all is not supported for image-text data yet: remove it")
        return self

    @field_validator("stages")
    @classmethod
    def _unique_stages(cls, stages):
        if not stages:
            raise ValueError("is empty; leave it out for a single stage named 'train'")
        if duplicates := repeats(s.name for s in stages):
            raise ValueError(f"stage names repeat: {duplicates}")
        return stages


class PruneSpec(Section):
    """A sweep's `prune:` block (asynchronous successive halving, core/pruning.py): at each rung (an epoch)
    a run records its in-training eval_loss and stops if it is above the `keep` quantile of every loss
    recorded at that rung so far, once there are `min_points` of them. The experiment-level checks (eval
    data, eval_every_epochs, rungs below epochs, one stage) are slurm/planning/sweeps.py check_prune's."""

    rungs: list[Annotated[Float, Field(gt=0)]] = Field(
        description="Epochs at which each run is judged on its in-training `eval_loss`: above 0, strictly rising, multiples of `train.eval_every_epochs` and below `train.epochs`. Required."
    )
    keep: Annotated[Float, Field(gt=0, lt=1)] = Field(
        description="In (0, 1): a run stops at a rung when its loss is above this quantile (linear interpolation) of every loss recorded there so far, its own included. Required."
    )
    min_points: Annotated[Int, Field(ge=1)] = Field(
        3, description="With fewer losses than this (≥ 1) recorded at a rung, every run goes on."
    )
    eval_pruned: bool = Field(
        True,
        description="Whether a pruned run's best checkpoint is still evaluated. Not part of the run's identity.",
    )  # a pruned run's best checkpoint is still evaluated

    @field_validator("rungs")
    @classmethod
    def _increasing(cls, value):
        if not value:
            raise ValueError("is empty: list the epochs at which runs are judged, e.g. rungs: [1, 2]")
        if any(later <= earlier for earlier, later in zip(value, value[1:], strict=False)):
            raise ValueError(f"must rise strictly, each rung judged once, e.g. [1, 2]; got {value}")
        return value


class PruneJob(PruneSpec):
    """What a training job of a pruned sweep needs: the block, and the sweep whose records it joins
    (RUN_ROOT/.rungs/SWEEP/, core/pruning.py)."""

    sweep: str
    # The sweep's definition (core/pruning.py definition_hash): its rung records count only rows measured
    # under the same one. Set by the plan; how it is judged, not what this run computes (HOW_IT_RUNS).
    measured_under: str = ""
    # The sweep's runs (points x seeds), set by the plan for its expected cost (core/pruning.py
    # expected_epochs); None: unknown (a job run by hand). How it is estimated, not what it computes.
    runs: Int | None = None


class TrainJob(Section):
    """What one training job needs, fully resolved: the trainer takes this and nothing else."""

    experiment: str
    stage: str
    model: ModelSpec
    adapter: AdapterSpec
    data: DataSpec
    train: TrainSpec
    init_adapter: str | None = Field(None, description="previous stage's adapter folder to continue from")
    run_dir: str
    tracking: list[Tracker] = Field(default_factory=lambda: ["tensorboard"])
    calibration: bool = Field(False, description="a --calibrate run: its speed-book row is `calibrated`")
    # A point of a pruned sweep (left out of the spec, and so of its hash, otherwise): part of what it
    # computes, since a run may stop at a rung.
    prune: PruneJob | None = Field(None, exclude_if=lambda value: value is None)
    # An elastic job's (`nodes: min-max`) ranks at its largest size, where its global batch is set: on fewer,
    # each rank accumulates more (core/split.py elastic_accumulation). None: the ranks it runs on. Left out
    # of its identity, which counts those ranks already (slurm/planning/plan.py make_job).
    global_ranks: Annotated[Int, Field(ge=1)] | None = Field(None, exclude_if=lambda value: value is None)
    # An elastic job's ranks at its smallest size (its fewest nodes): where each rank accumulates the most, so
    # where a GRPO stage's generation (a step's completions of a rank at once) is largest. Preflight judges
    # it there; None once the job runs (it knows its ranks) and for a job of one size. How it runs.
    fewest_ranks: Annotated[Int, Field(ge=1)] | None = Field(None, exclude_if=lambda value: value is None)
    # A GRPO stage with a user's reward function: the config's folder, which it is imported from. Where the
    # code is found, not what it computes (HOW_IT_RUNS); left out when unset.
    functions_from: str | None = Field(None, exclude_if=lambda value: value is None)

    @model_validator(mode="after")
    def _early_stopping_has_eval_data(self):
        # The launcher reports this with file and line before planning; this guards jobs run by hand.
        if self.train.early_stopping and not self.data.eval:
            raise ValueError("train.early_stopping needs data.eval: it stops on the eval loss")
        return self


# Keys that change how a stage runs, not what it computes: left out of its identity (slurm/planning/plan.py) and of
# the "changed config" comparisons, so changing them reruns nothing.
# prune.eval_pruned decides only whether a pruned run's eval runs (its eval job reads the run's PRUNED note).
HOW_IT_RUNS = {
    "tracking": True,
    "global_ranks": True,
    "fewest_ranks": True,
    "functions_from": True,
    "train": {"micro_batch"},
    "prune": {"measured_under", "runs", "eval_pruned"},
}


def what_it_computes(spec: dict) -> dict:
    """A resolved spec (a model_dump, or a config.yaml read back) without HOW_IT_RUNS's keys."""
    kept = {k: v for k, v in spec.items() if HOW_IT_RUNS.get(k) is not True}
    for section, keys in HOW_IT_RUNS.items():
        if isinstance(keys, set) and isinstance(kept.get(section), dict):
            kept[section] = {k: v for k, v in kept[section].items() if k not in keys}
    return kept


class EvalJob(Section):
    """What one evaluation job needs: the adapter to load, the data to generate on, and how to score."""

    experiment: str
    stage: str
    model: ModelSpec
    adapter: AdapterSpec  # QLoRA adapters are evaluated on the same 4-bit base they were trained on
    data: DataSpec
    eval: EvalSpec
    adapter_dir: (
        str | None
    )  # None: the base model alone, scored as the experiments' base row (slurm/planning/plan.py)
    out_dir: str
    # An earlier stage's eval in a curriculum with a preference stage: that stage's pairs, scored besides
    # this stage's own data, so its row has the preference figure the DPO and base rows have
    # (eval/preference.py). Left out at None: every other eval job keeps its identity.
    preference_pairs: DataSpec | None = Field(None, exclude_if=lambda value: value is None)

    @model_validator(mode="after")
    def _split_has_data(self):
        # The launcher reports this with file and line before planning; this guards jobs run by hand.
        if self.eval.split == "eval" and not self.data.eval:
            raise ValueError(
                "eval.split is 'eval' but data.eval is not set; add it, or set eval.split: train"
            )
        return self

    @property
    def source(self) -> str:
        """The data file scored: the split's file."""
        return self.data.eval if self.eval.split == "eval" else self.data.train

    @property
    def sharing_key(self) -> str:
        """What must be equal for eval jobs to share one process (eval/shared.py): the base model, how it
        is held (quantization, the adapter's method), the data scored, and the eval's settings (generation,
        metrics, split)."""
        adapter = self.adapter.model_dump(include={"method", "quant_type", "double_quant"})
        data = self.data.scored_only(self.source)  # a point's eval and its base row read the same examples
        parts = {"model": self.model.model_dump(), "adapter": adapter, "data": data.model_dump()}
        parts |= {"eval": self.eval.model_dump(), "pairs": self.preference_pairs is not None}
        return json.dumps(parts, sort_keys=True, default=str)


class ExportJob(Section):
    """What one export job needs (eval/export.py): the trained stage, where the merged model goes, and the
    eval jobs whose scores make its model card's table (the base-model eval's first)."""

    experiment: str
    stage: str
    stage_dir: str
    out_dir: str
    eval_configs: list[str] = Field(default_factory=list)  # their config.yaml; those not run yet are left out
    gguf: bool = False


def safe_name(value: str) -> str:
    if not SAFE_NAME.fullmatch(value):
        raise ValueError(
            f"{value!r} is not a safe name: use letters, digits, '-', '_' or '.', start with a letter or "
            "digit, at most 64 characters (it becomes a folder and a job name)"
        )
    return value


def free_name(value: str, taken_by: str | None, kind: str) -> str:
    """`value`, unless the run folders' layout (core/layout.py) already gives that name to `taken_by`:
    the two would write into one folder, and the run's last step or its evaluation would be lost."""
    if taken_by:
        raise ValueError(f"{value!r} is taken by {taken_by}; give the {kind} another name")
    return value


def placeholders(template: str) -> list[str]:
    """The `{field}` names a prompt template uses; raises ValueError on a malformed template."""
    import string

    try:
        return [field for _, field, _, _ in string.Formatter().parse(template) if field]
    except ValueError as exc:
        raise ValueError(
            f"prompt_template does not parse ({exc}); write literal braces as '{{{{' and '}}}}'"
        ) from None


def repeats(names) -> list[str]:
    """The names written more than once, sorted."""
    names = list(names)
    return sorted({name for name in names if names.count(name) > 1})


def are(keys: list[str]) -> str:
    return "is" if len(keys) == 1 else "are"
