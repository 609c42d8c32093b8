"""A trained stage shipped as one plain model: the base with the adapter merged in, loadable with
`AutoModel*.from_pretrained` and no peft, checked against the adapter it came from before it is kept.

    export_stage(Path("runs/EXP/STAGE"), Path("runs/EXP/export"), eval_spec=..., eval_rows=[...])
    python -m eval.export runs/EXP/STAGE runs/EXP/export [--gguf] [--eval-config runs/EXP/eval/config.yaml]
        [--eval-config runs/_base-MODEL-KEY/eval/config.yaml]      (each: a row of the card's eval table)

OUT_DIR, once done: config.json and model*.safetensors (the merged model), the tokenizer or processor
saved with the adapter (added tokens included), generation_config.json (the eval's decoding settings when
given, else the base model's), README.md (the model card), model.gguf when asked for and llama.cpp's
converter is found, and EXPORT_DONE, written last. Whatever else the folder holds (the launcher's
config.yaml and job.json) is left alone.

- dtype: LoRA merges in the dtype the stage held its base in (train/device.py's placement for the
  precision summary.json records). QLoRA loads the 4-bit base it trained on, dequantizes those weights
  into its compute dtype (16-bit on a GPU, fp32 on a CPU) and merges the adapter into them: the export
  computes what was trained and evaluated. Merging into the original 16-bit weights instead would add back
  the quantization error the adapter never saw (the tiny QLoRA model then agreed on 2 of 8 outputs with
  its own eval); merging into the 4-bit layers would re-quantize the merge. The card says so.
- self-check: greedy outputs of the merged model on the first eval prompts against the adapter on the
  base as the eval loads it (eval/generate.py; for QLoRA the 4-bit base), and the largest difference of
  the next-token logits of the prompts' first forward. For QLoRA also against the adapter on the
  dequantized base: the merge alone, held to LoRA's bound. Over a bound (`BOUNDS`, by method and dtype):
  ExportCheckFailed with the figures, and nothing is moved into OUT_DIR.
- idempotent: EXPORT_DONE holds the export's identity (the stage's DONE, the adapter's bytes, the
  settings); a matching one is skipped.
- atomic: everything is written into OUT_DIR/.export-partial-*, then moved in file by file under a marker
  that says "incomplete" and names every file in play; a killed export is redone, never taken for done.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from core.config import EvalJob, EvalSpec, TrainJob
from core.files import read_text, write_atomic
from core.hashing import content_hash
from core.pruning import decided_text
from core.rundir import RunDir, read_spec

log = logging.getLogger("eval.export")
# Bump when the export writes different files for the same stage: older exports are then redone.
EXPORT_FORMAT = 1
PARTIAL_PREFIX = ".export-partial-"
CONVERTER_NAMES = ("convert_hf_to_gguf.py", "convert-hf-to-gguf.py")
CONVERTER_PLACEHOLDER = "/path/to/llama.cpp/convert_hf_to_gguf.py"
GGUF_FILE = "model.gguf"
GGUF_MMPROJ_FILE = "mmproj.gguf"
GGUF_OUTTYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
DISAGREEMENTS_SHOWN = 3
AS_TRAINED = "the adapter on its base as trained"
UNQUANTIZED = "the adapter on the dequantized base (the merge alone)"
METHOD_NAMES = {"lora": "LoRA", "qlora": "QLoRA"}


class ExportError(RuntimeError):
    """The stage cannot be exported (no adapter, no spec, the GGUF converter failed); says what to do."""


class ExportCheckFailed(ExportError):
    """The merged model does not generate as the adapter on its base does, beyond the stated bound."""


@dataclass(frozen=True)
class Bound:
    """How close the merged model must come to the adapter on the base it trained on."""

    min_agreement: float  # share of check prompts whose greedy outputs are identical
    max_logit_diff: float | None  # largest absolute next-token logit difference; None: reported only
    why: str
    if_over: str = ""  # what to do when a check is over it


# Measured on the tiny models, 8 prompts x 16 tokens (tests/test_export.py): an fp32 merge agrees 8 of 8
# with max logit difference 2e-7 (causal), 2e-6 (T5), 7e-6 (image-text); a bug that loses the adapter
# moves it by 1.3. A 16-bit merge rounds W + BA once, where the adapter on the base adds BA·x in fp32 to
# a 16-bit W·x: logits move by units in the last place (bf16 on a CPU: 0.008 causal, 0.035 T5, 16 of 16
# agreeing) and a greedy near-tie may flip on a long output. QLoRA's merged base is its 4-bit weights
# dequantized (what the 4-bit layers compute with), so against the model as trained it differs by the
# 16-bit rounding of one merge, as a 16-bit LoRA merge does; its merge itself is held to LoRA's bound
# against the adapter on the dequantized base. (Merged into the original weights instead, the tiny models
# agreed 2 of 8 with their own eval, the image-text one 4 of 8 with logits 3.4 apart.)
ANYWAY = "to export it anyway, give a lower min_agreement (python -m eval.export ... --min-agreement X)"
BOUNDS = {
    ("lora", "fp32"): Bound(1.0, 1e-3, "fp32 merge: exact up to float rounding"),
    ("lora", "16-bit"): Bound(
        0.75,
        None,
        "16-bit merge: one rounding of W + BA; a near-tie may flip",
        f"if this is such a flip, {ANYWAY}",
    ),
    ("qlora", "fp32"): Bound(
        0.75,
        None,
        "QLoRA: merged into its 4-bit base's weights, dequantized; a near-tie may flip",
        f"the merged model answers unlike the one evaluated; {ANYWAY}",
    ),
}
BOUNDS[("qlora", "16-bit")] = BOUNDS[("qlora", "fp32")]


def bound_for(method: str, dtype: torch.dtype, min_agreement: float | None = None) -> Bound:
    """The bound for `method` merged in `dtype`; `min_agreement` replaces its agreement bound."""
    bound = BOUNDS[(method, "fp32" if dtype == torch.float32 else "16-bit")]
    if min_agreement is None:
        return bound
    return dataclasses.replace(
        bound, min_agreement=min_agreement, why=f"{bound.why} (agreement bound as asked)"
    )


@dataclass(frozen=True)
class Outputs:
    """Greedy outputs on the check prompts, and each prompt's next-token logits from the first forward
    (rows in generate()'s batch order, the same for every model given the same prompts)."""

    texts: list[str]
    first_logits: torch.Tensor


@dataclass(frozen=True)
class SelfCheck:
    """The merged model against a reference: the adapter on its base as trained, or (QLoRA) on the
    unquantized base."""

    against: str
    prompts: int
    agreeing: int
    max_logit_diff: float
    bound: Bound
    disagreements: tuple[tuple[str, str, str], ...] = ()  # (prompt, as trained, merged), the first few

    @property
    def agreement(self) -> float:
        return self.agreeing / self.prompts if self.prompts else 1.0

    def failures(self) -> list[str]:
        found = []
        if self.agreement < self.bound.min_agreement:
            found.append(f"agreement {self.agreement:.3f} is below {self.bound.min_agreement:g}")
        if self.bound.max_logit_diff is not None and not self.max_logit_diff <= self.bound.max_logit_diff:
            found.append(
                f"max logit difference {self.max_logit_diff:.3g} is above {self.bound.max_logit_diff:g}"
            )
        return found

    def figures(self) -> str:
        return (
            f"{self.agreeing} of {self.prompts} greedy outputs identical (agreement {self.agreement:.3f}), "
            f"max |logit difference| {self.max_logit_diff:.3g} on the first forward"
        )


@dataclass(frozen=True)
class ExportResult:
    out_dir: Path
    skipped: bool  # an export of the same stage and settings was already there
    dtype: str
    agreement: float
    max_logit_diff: float
    gguf: Path | None  # the GGUF file made, if any
    gguf_command: str  # the command that makes (or made) the GGUF file


# ---- the export, top to bottom ------------------------------------------------------------------------
def export_stage(
    stage_dir: Path,
    out_dir: Path,
    *,
    eval_spec: EvalSpec | None = None,
    eval_rows: list[dict] | None = None,
    check_prompts: int = 8,
    min_agreement: float | None = None,
    gguf: bool = False,
) -> ExportResult:
    """Merge the stage's adapter into its base and write the export into `out_dir` (module docstring).

    `eval_spec`: the experiment's eval settings (which split gives the check prompts; the decoding that
    generation_config.json records); without it the check decodes greedily up to EvalSpec's default
    length and the base model's generation_config is kept. `eval_rows`: the eval table for the card (e.g.
    the base row and the adapter row), rendered as given. `min_agreement`: replaces the bound's, for a
    QLoRA model known to drift from its 4-bit self (the card shows the bound used). Raises
    ExportCheckFailed over the bound."""
    stage_dir, out_dir = Path(stage_dir), Path(out_dir)
    job = check_job(stage_dir, out_dir, eval_spec, check_prompts)
    settings = {"eval_rows": eval_rows, "min_agreement": min_agreement, "gguf": gguf}
    identity = export_identity(stage_dir, job, eval_spec, settings)
    done = RunDir(out_dir).read_export_done()
    if done.get("identity") == identity and (kept := result_of(out_dir, done.get("result"), skipped=True)):
        log.info("%s: already exported from %s; skipped", out_dir, stage_dir)
        return kept
    out_dir.mkdir(parents=True, exist_ok=True)
    discard_partials(out_dir)
    partial = Path(tempfile.mkdtemp(prefix=PARTIAL_PREFIX, dir=out_dir))
    try:
        record = build_export(stage_dir, job, partial, out_dir, eval_spec, settings)
    except BaseException:
        remove(partial)  # a failed check or converter leaves nothing behind
        raise
    commit(partial, out_dir, identity, record, previous=export_files(done))
    log.info("exported %s into %s (%s)", stage_dir, out_dir, record["check"])
    return result_of(out_dir, record, skipped=False)  # a record it just made: never None


def build_export(stage_dir, job: EvalJob, partial: Path, out_dir: Path, eval_spec, settings: dict) -> dict:
    """Every file of the export in `partial`; the record EXPORT_DONE will keep."""
    from eval.generate import eval_placement, explicit_decoding

    placement = eval_placement(job.adapter_dir)
    merged, tokenizer, checks, dtype = merged_and_checked(job, placement, settings["min_agreement"])
    if eval_spec is not None:
        explicit_decoding(merged, eval_spec)  # generation_config.json: the eval's own decoding
    merged.save_pretrained(partial)
    tokenizer.save_pretrained(partial)  # the adapter's: its added tokens, its pad token
    del merged
    gc.collect()
    command, made = gguf_step(partial, out_dir, dtype, job.model.kind, settings["gguf"])
    card = model_card(stage_dir, job, checks, dtype, settings["eval_rows"] or [], command, made is not None)
    write_atomic(partial / "README.md", card)
    readable(partial)
    return {
        "dtype": dtype_name(dtype),
        "agreement": checks[0].agreement,  # against the model as trained
        "max_logit_diff": checks[0].max_logit_diff,
        "check": "; ".join(f"against {c.against}: {c.figures()}" for c in checks),
        "gguf": GGUF_FILE if made else None,
        "gguf_command": command,
    }


def merged_and_checked(job: EvalJob, placement, min_agreement: float | None = None):
    """(merged model, tokenizer, [SelfCheck], dtype): the adapter's outputs on its base as trained first
    (for QLoRA then on the dequantized base), the merge, its outputs; ExportCheckFailed over a bound."""
    from eval.generate import load_for_eval

    model, tokenizer = load_for_eval(job, placement)
    prompts, images = check_inputs(job, tokenizer)
    references = {AS_TRAINED: greedy_outputs(model, tokenizer, job, prompts, images)}
    if job.adapter.method == "qlora":
        del model  # before the dequantized copy is loaded: both may not fit
        free_memory(placement)
        model, tokenizer = load_dequantized(job, placement)
        references[UNQUANTIZED] = greedy_outputs(model, tokenizer, job, prompts, images)
    dtype = model.get_base_model().dtype
    merged = model.merge_and_unload(safe_merge=True)  # safe_merge: a NaN in the merge is an error
    outputs = greedy_outputs(merged, tokenizer, job, prompts, images)
    checks = [
        self_check(against, reference, outputs, bound_of(against, job, dtype, min_agreement), prompts)
        for against, reference in references.items()
    ]
    for check in checks:
        require_within_bound(check)
    return merged, tokenizer, checks, dtype


def bound_of(against: str, job: EvalJob, dtype: torch.dtype, min_agreement: float | None) -> Bound:
    """The model as trained: the method's bound. The dequantized base: the merge alone, as exact as LoRA's."""
    if against == UNQUANTIZED:
        return bound_for("lora", dtype)
    return bound_for(job.adapter.method, dtype, min_agreement)


def load_dequantized(job: EvalJob, placement):
    """QLoRA's adapter on the very 4-bit weights it trained on, dequantized into the dtype the 4-bit layers
    compute in (transformers' dequantize), in the order load_trained keeps: tokenizer, base, resize, adapter."""
    from peft import PeftModel

    from eval.generate import stop_at_end_of_turn
    from train.chat import text_tokenizer
    from train.model import load_base, load_tokenizer

    tokenizer = load_tokenizer(job.adapter_dir, job.model, job.data)
    base = load_base(job.model, job.adapter, placement).dequantize()
    vocabulary = len(text_tokenizer(tokenizer))
    if vocabulary > base.get_input_embeddings().weight.shape[0]:
        base.resize_token_embeddings(vocabulary)
    model = PeftModel.from_pretrained(base, job.adapter_dir).eval()
    stop_at_end_of_turn(job, model, tokenizer)
    return model, tokenizer


def readable(folder: Path) -> None:
    """Files as the umask makes them: atomic writes start private (mkstemp), and an export is shared."""
    umask = os.umask(0)
    os.umask(umask)
    for path in folder.iterdir():
        if path.is_file():
            path.chmod(0o666 & ~umask)


def free_memory(placement) -> None:
    gc.collect()
    if placement.cuda:
        torch.cuda.empty_cache()  # the 4-bit model's blocks, before the 16-bit one is loaded


# ---- what the check runs on ---------------------------------------------------------------------------
def check_job(stage_dir: Path, out_dir: Path, eval_spec: EvalSpec | None, check_prompts: int) -> EvalJob:
    """The eval job of the stage's adapter over its first `check_prompts` prompts: the check loads and
    generates through the eval's own code with it."""
    train_job = stage_spec(stage_dir)
    adapter = RunDir(stage_dir).adapter
    if not (adapter / "adapter_config.json").is_file():
        raise ExportError(f"{adapter}: no trained adapter (adapter_config.json); has the stage finished?")
    spec = eval_spec or EvalSpec(split="eval" if train_job.data.eval else "train")
    return EvalJob(
        experiment=train_job.experiment,
        stage=train_job.stage,
        model=train_job.model,
        adapter=train_job.adapter,
        data=train_job.data,
        eval=spec.model_copy(update={"limit": check_prompts}),
        adapter_dir=str(adapter),
        out_dir=str(out_dir),
    )


def stage_spec(stage_dir: Path) -> TrainJob:
    spec = read_spec(stage_dir)  # None: missing or unreadable (named in a warning)
    if spec is None:
        raise ExportError(
            f"{RunDir(stage_dir).config}: no readable stage spec; is {stage_dir} a stage folder?"
        )
    try:
        return TrainJob.model_validate(spec)
    except ValueError as exc:  # pydantic's ValidationError is one
        raise ExportError(f"{RunDir(stage_dir).config}: not a training stage's spec ({exc})") from None


def check_inputs(job: EvalJob, tokenizer) -> tuple[list[str], list[str] | None]:
    """The first eval prompts (and their images), made as the eval job makes them."""
    from eval.job import image_paths
    from train.data import prompts_and_targets

    prompts, _ = prompts_and_targets(job.source, job.data, tokenizer, job.model.kind, job.eval.limit)
    images = image_paths(job.source, job) if job.model.kind == "image-text" else None
    return prompts, images


class FirstLogits:
    """The next-token logits of the first forward the model's top module makes (generate's prefill)."""

    def __init__(self, module):
        self.logits: torch.Tensor | None = None
        self.handle = module.register_forward_hook(self.record)

    def record(self, module, args, output):
        if self.logits is None:
            self.logits = output.logits[:, -1].float().cpu()


def greedy_outputs(model, tokenizer, job: EvalJob, prompts: list[str], images: list[str] | None) -> Outputs:
    """Greedy outputs decoded by the eval's settings, all prompts in one batch (one generate call: one
    first forward to compare). The model's own generation_config is put back afterwards."""
    from eval.generate import explicit_decoding, generate
    from eval.job import generation_options

    top = model.get_base_model() if hasattr(model, "get_base_model") else model
    own, first = top.generation_config, FirstLogits(top)
    try:
        explicit_decoding(model, job.eval.model_copy(update={"num_beams": 1}))
        options = generation_options(job) | {"num_beams": 1}
        texts = generate(model, tokenizer, prompts, images=images, batch_size=len(prompts), **options)
    finally:
        first.handle.remove()
        top.generation_config = own
    return Outputs(texts, first.logits)


def self_check(
    against: str, trained: Outputs, merged: Outputs, bound: Bound, prompts: list[str]
) -> SelfCheck:
    """The figures of the merged model against `against`'s outputs `trained`."""
    pairs = list(zip(prompts, trained.texts, merged.texts, strict=True))
    differing = tuple(pair for pair in pairs if pair[1] != pair[2])
    return SelfCheck(
        against=against,
        prompts=len(pairs),
        agreeing=len(pairs) - len(differing),
        max_logit_diff=float((trained.first_logits - merged.first_logits).abs().max()),
        bound=bound,
        disagreements=differing[:DISAGREEMENTS_SHOWN],
    )


def require_within_bound(check: SelfCheck) -> None:
    failures = check.failures()
    if not failures:
        return
    shown = "".join(
        f"\n  prompt ...{prompt[-60:]!r}: {reference!r}, merged {merged!r}"
        for prompt, reference, merged in check.disagreements
    )
    then = f"; {check.bound.if_over}" if check.bound.if_over else ""
    raise ExportCheckFailed(
        f"the merged model does not generate as {check.against}: {'; '.join(failures)} "
        f"({check.figures()}; bound: {check.bound.why}){shown}\nNothing was exported{then}"
    )


# ---- identity and commit ------------------------------------------------------------------------------
def export_identity(stage_dir: Path, job: EvalJob, eval_spec: EvalSpec | None, settings: dict) -> str:
    """What the export's files depend on: the stage's DONE (its config hash), the adapter's bytes, and
    the export's own settings."""
    adapter = Path(job.adapter_dir)
    files = {p.name: file_sha256(p) for p in sorted(adapter.iterdir()) if p.is_file()}
    parts = {
        "format": EXPORT_FORMAT,
        "stage_done": read_text(RunDir(stage_dir).done),
        "adapter_files": files,
        "eval": eval_spec.model_dump() if eval_spec else None,
        "check_prompts": job.eval.limit,
        **settings,
        # A GGUF asked for while llama.cpp was missing is made once it is there.
        "converter": str(gguf_converter()) if settings["gguf"] else None,
    }
    return content_hash(parts)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def commit(partial: Path, out_dir: Path, identity: str, record: dict, previous: list[str]) -> None:
    """Move the export's files from `partial` into `out_dir`, replacing the previous export's. While
    they move, EXPORT_DONE says "incomplete" and names every file in play: a kill leaves an export that
    is redone, and whose stale files the next commit removes."""
    names = sorted(p.name for p in partial.iterdir())
    marker = RunDir(out_dir).export_done
    write_atomic(marker, json.dumps({"identity": None, "files": sorted({*previous, *names})}, indent=1))
    for name in sorted(set(previous) - set(names)):
        remove(out_dir / name)
    for name in names:
        remove(out_dir / name)
        os.replace(partial / name, out_dir / name)
    partial.rmdir()
    write_atomic(marker, json.dumps({"identity": identity, "files": names, "result": record}, indent=1))


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def discard_partials(out_dir: Path) -> None:
    """What killed exports left half written (never moved in, never taken for done)."""
    for path in out_dir.glob(f"{PARTIAL_PREFIX}*"):
        remove(path)


def export_files(done: dict) -> list[str]:
    """The files a previous export put into its folder, as its marker names them: plain names only (a
    hand-edited marker naming a path elsewhere removes nothing there)."""
    return [name for name in done.get("files", []) if isinstance(name, str) and name == Path(name).name]


def result_of(out_dir: Path, record: dict | None, skipped: bool) -> ExportResult | None:
    """The result a marker's record describes; None when it is not one (a hand edit: export again)."""
    try:
        return ExportResult(
            out_dir=out_dir,
            skipped=skipped,
            dtype=str(record["dtype"]),
            agreement=float(record["agreement"]),
            max_logit_diff=float(record["max_logit_diff"]),
            gguf=out_dir / record["gguf"] if record.get("gguf") else None,
            gguf_command=str(record["gguf_command"]),
        )
    except (KeyError, TypeError, ValueError):
        return None


# ---- GGUF ---------------------------------------------------------------------------------------------
def gguf_converter(env: dict | None = None) -> Path | None:
    """llama.cpp's convert_hf_to_gguf.py: in $LLAMA_CPP_DIR, else on PATH; None when neither has it."""
    env = os.environ if env is None else env
    folder = env.get("LLAMA_CPP_DIR")
    for name in CONVERTER_NAMES if folder else ():
        if (Path(folder) / name).is_file():
            return Path(folder) / name
    for name in CONVERTER_NAMES:
        found = shutil.which(name, path=env.get("PATH"))
        if found:
            return Path(found)
    return None


def gguf_runs(kind: str) -> list[tuple[str, list[str]]]:
    """(file, extra flags) of each conversion: an image-text model's vision tower and projector go into
    a file of their own (llama.cpp's --mmproj), which its multimodal tools load beside the model."""
    runs = [(GGUF_FILE, [])]
    return runs + [(GGUF_MMPROJ_FILE, ["--mmproj"])] if kind == "image-text" else runs


def gguf_arguments(converter, model_dir: Path, dtype: torch.dtype, kind: str) -> list[list[str]]:
    outtype = ["--outtype", GGUF_OUTTYPES[dtype]]
    return [
        [str(converter), str(model_dir), *flags, "--outfile", str(model_dir / name), *outtype]
        for name, flags in gguf_runs(kind)
    ]


def gguf_command(converter, out_dir: Path, dtype: torch.dtype, kind: str) -> str:
    """The command line that makes OUT_DIR/model.gguf from the export, for the card and the log."""
    return " && ".join(" ".join(["python", *run]) for run in gguf_arguments(converter, out_dir, dtype, kind))


def gguf_step(partial: Path, out_dir: Path, dtype: torch.dtype, kind: str, asked: bool):
    """(the command that makes OUT_DIR/model.gguf, the file made when asked and the converter is found)."""
    command = gguf_command(gguf_converter() or CONVERTER_PLACEHOLDER, out_dir, dtype, kind)
    made = make_gguf(partial, dtype, kind) if asked else None
    if asked and made is None:
        log.warning(
            "llama.cpp's converter was not found (LLAMA_CPP_DIR, PATH); to make the GGUF: %s", command
        )
    return command, made


def make_gguf(model_dir: Path, dtype: torch.dtype, kind: str) -> Path | None:
    """model_dir/model.gguf by llama.cpp's converter; None when it is not found; ExportError when it fails."""
    converter = gguf_converter()
    if converter is None:
        return None
    for arguments in gguf_arguments(converter, model_dir, dtype, kind):
        done = subprocess.run([sys.executable, *arguments], capture_output=True, text=True, check=False)
        if done.returncode != 0 or not Path(arguments[arguments.index("--outfile") + 1]).is_file():
            tail = "\n".join((done.stdout + done.stderr).splitlines()[-20:])
            raise ExportError(
                f"llama.cpp's converter failed (exit {done.returncode}): {' '.join(arguments)}\n{tail}"
            )
    return model_dir / GGUF_FILE


# ---- the model card -----------------------------------------------------------------------------------
def model_card(
    stage_dir, job: EvalJob, checks: list[SelfCheck], dtype, eval_rows, command: str, has_gguf: bool
) -> str:
    """README.md: what the model is, how it was trained, how it scores, and how the export checked itself."""
    train_job = stage_spec(stage_dir)
    sections = [
        front_matter(job),
        f"# {job.experiment} / {job.stage} (merged)\n",
        f"{job.model.name_or_path} fine-tuned with {METHOD_NAMES[job.adapter.method]}; the adapter is merged "
        f"into the base (`merge_and_unload`) and saved as safetensors in {dtype_name(dtype)}. "
        "Load it with the plain `transformers` Auto classes; no peft needed.\n",
        *([qlora_note(job, dtype)] if job.adapter.method == "qlora" else []),
        *pruned_note(stage_dir, train_job),
        prompting_note(job),
        "## Training\n",
        bullet_list(training_facts(train_job, RunDir(stage_dir).read_summary(), stage_dir)),
        "## Evaluation\n",
        markdown_table(eval_rows) if eval_rows else "No eval table was given to the export.\n",
        "## Export self-check\n",
        f"Greedy outputs of this merged model on the first {checks[0].prompts} eval prompts against:\n",
        *map(check_section, checks),
        "## GGUF\n",
        f"`{GGUF_FILE}` was made by llama.cpp's converter:\n\n    {command}\n"
        if has_gguf
        else f"Make a GGUF file with llama.cpp's converter:\n\n    {command}\n",
    ]
    return "\n".join(sections)


def pruned_note(stage_dir: Path, train_job: TrainJob) -> list[str]:
    """A pruned sweep's run stopped early (its PRUNED file): the card says so, where and why; before, a
    run cut at its first rung was published as if it had trained its epochs."""
    pruned = RunDir(stage_dir).read_pruned()
    if not pruned:
        return []
    sweep = train_job.prune.sweep if train_job.prune else "its sweep"
    return [
        f"**Pruned:** this run of the sweep {sweep} was stopped early by the sweep's pruning, at "
        f"{decided_text(pruned).removesuffix(': stop')}; it did not train its planned "
        f"{train_job.train.epochs:g} epochs, and the adapter merged here is its best checkpoint up to there.\n"
    ]


def front_matter(job: EvalJob) -> str:
    """The hub's metadata block; `base_model` only for a hub id (a local folder means nothing there)."""
    lines = ["---", "library_name: transformers", f"tags: [{job.adapter.method}, merged]"]
    if not Path(job.model.name_or_path).exists():
        lines.insert(1, f"base_model: {job.model.name_or_path}")
    return "\n".join([*lines, "---", ""])


def prompting_note(job: EvalJob) -> str:
    """How to prompt it as it was trained: through its chat template, or with the raw prompt."""
    from core.conversations import templated

    if templated(job.data, job.model.kind):
        return (
            f"Trained on conversations (`{job.data.format}`) rendered with its chat template, saved with it "
            "(`chat_template.jinja`): serve it through a chat endpoint (vLLM, TGI, Ollama) or "
            "`tokenizer.apply_chat_template(messages, add_generation_prompt=True)`; generation_config.json "
            "stops at the template's end-of-turn token.\n"
        )
    if job.model.kind == "image-text":
        return "Prompted through its processor's chat template, the image in the first user turn.\n"
    template = job.data.prompt_template or f"{{{job.data.input_field}}}"
    if job.data.format == "alpaca":  # a seq2seq model reads alpaca as one prompt
        template = "{instruction}, a blank line, {input}"
    return f"Trained on raw prompts, not a chat template: send `{template}` filled in, as plain text.\n"


def qlora_note(job: EvalJob, dtype) -> str:
    precision = "32-bit" if dtype == torch.float32 else "16-bit"  # 32-bit where the 4-bit base computed in it
    return (
        f"QLoRA: the adapter was trained on a 4-bit ({job.adapter.quant_type}) base. For this export those "
        f"4-bit weights were dequantized to {precision} precision ({dtype_name(dtype)}) and the adapter "
        "merged into them, so the model computes what was trained and evaluated (not the original "
        "unquantized weights, which the adapter never saw); the self-check below measures how closely.\n"
    )


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def training_facts(train_job: TrainJob, summary: dict, stage_dir: Path) -> dict[str, object]:
    adapter, data, train = train_job.adapter, train_job.data, train_job.train
    targets = json.loads((RunDir(stage_dir).adapter / "adapter_config.json").read_text()).get(
        "target_modules"
    )
    return {
        "base model": train_job.model.name_or_path
        + (f" (revision {train_job.model.revision})" if train_job.model.revision else ""),
        "kind": train_job.model.kind,
        "method": METHOD_NAMES[adapter.method]
        + (
            f" ({adapter.quant_type}, double quant {adapter.double_quant})"
            if adapter.method == "qlora"
            else ""
        ),
        "LoRA rank / alpha / dropout": f"{adapter.rank} / {adapter.alpha:g} / {adapter.dropout:g}",
        "target modules": ", ".join(sorted(targets)) if isinstance(targets, list) else adapter.target_modules,
        "added tokens": train_job.model.added_tokens or None,
        "training data": data.train,
        "eval data": data.eval,
        "started from adapter": train_job.init_adapter,
        "epochs / max steps / steps done": f"{train.epochs:g} / {train.max_steps} / {summary.get('global_step')}",
        "learning rate / scheduler / warmup": f"{train.learning_rate:g} / {train.scheduler} / {train.warmup_ratio:g}",
        "batch size x grad accum x ranks": f"{train.batch_size} x {train.grad_accum} x {summary.get('world_size', 1)}",
        "precision (asked / ran)": f"{train.precision} / {summary.get('precision')}",
        "seed": train.seed,
    }


def bullet_list(facts: dict[str, object]) -> str:
    return "".join(f"- {key}: {value}\n" for key, value in facts.items() if value is not None)


def markdown_table(rows: list[dict]) -> str:
    """The rows as given, one column per key in order of first appearance; numbers to 4 digits."""
    columns = list(dict.fromkeys(key for row in rows for key in row))
    lines = ["| " + " | ".join(map(cell, columns)) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(key)) for key in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def check_section(check: SelfCheck) -> str:
    logit_bound = (
        "reported only" if check.bound.max_logit_diff is None else f"at most {check.bound.max_logit_diff:g}"
    )
    return (
        f"- {check.against}:\n"
        f"  - agreement: {check.agreement:.3f} ({check.agreeing} of {check.prompts} outputs identical; "
        f"bound: at least {check.bound.min_agreement:g})\n"
        f"  - largest absolute logit difference, first forward: {check.max_logit_diff:.3g} "
        f"(bound: {logit_bound})\n"
        f"  - bound: {check.bound.why}\n"
    )


# ---- by hand ------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.export", description=__doc__.splitlines()[0])
    parser.add_argument("stage_dir", type=Path, help="runs/EXP/STAGE (config.yaml, adapter/, summary.json)")
    parser.add_argument("out_dir", type=Path, help="where the export goes, e.g. runs/EXP/export")
    parser.add_argument("--gguf", action="store_true", help="also make model.gguf (llama.cpp's converter)")
    parser.add_argument(
        "--eval-config",
        type=Path,
        action="append",
        default=[],
        help="an eval job's config.yaml (repeatable): the adapter's gives decoding and prompts; each its scores",
    )
    parser.add_argument("--check-prompts", type=int, default=8, help="prompts the self-check compares on")
    parser.add_argument(
        "--min-agreement", type=float, help="replace the self-check's agreement bound (0 to 1)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        eval_spec, rows = eval_inputs(args.eval_config)
        result = export_stage(
            args.stage_dir,
            args.out_dir,
            eval_spec=eval_spec,
            eval_rows=rows,
            check_prompts=args.check_prompts,
            min_agreement=args.min_agreement,
            gguf=args.gguf,
        )
    except ExportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(dataclasses.asdict(result), indent=1, default=str))
    return 0


def eval_inputs(configs: list[Path]) -> tuple[EvalSpec | None, list[dict]]:
    """The settings of the eval jobs' adapter eval (decoding, prompts) and, for those that have run,
    their scores as the card's rows: the base-model eval's (no adapter) as "base (no adapter)"."""
    jobs = [eval_job_at(config) for config in configs]
    rows = []
    for job in jobs:
        scores = {k: v for k, v in RunDir.of(job.out_dir).read_results().items() if isinstance(v, float)}
        label = f"{job.experiment}/{job.stage}" if job.adapter_dir else "base (no adapter)"
        rows += [{"model": label, **scores}] if scores else []
    with_adapter = [job.eval for job in jobs if job.adapter_dir]
    return (with_adapter or [None])[0], sorted(rows, key=lambda row: row["model"] != "base (no adapter)")


def eval_job_at(config: Path) -> EvalJob:
    try:
        return EvalJob.model_validate(yaml.safe_load(config.read_text(encoding="utf-8")))
    except (OSError, yaml.YAMLError, ValueError) as exc:
        raise ExportError(f"{config}: not an eval job's config.yaml ({exc})") from None


if __name__ == "__main__":
    sys.exit(main())
