"""eval/export.py on stages really trained on the tiny models: the merged export loads with the plain Auto
classes and generates as the adapter on its base did; QLoRA is merged into its dequantized 4-bit base; added
tokens travel; the card carries the self-check; a second export is skipped, a killed one redone, and a
merge that loses the adapter fails with the figures."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import peft
import pytest
import torch
from peft.tuners.tuners_utils import BaseTuner
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer

from core.config import AdapterSpec, DataSpec, EvalSpec, ModelSpec
from core.rundir import RunDir, mark_done, write_spec
from eval import export
from eval.export import ExportCheckFailed, ExportError, export_stage
from eval.generate import explicit_decoding, generate
from tests.train_helpers import make_job, model_spec, sql_data
from train.data import prompts_and_targets
from train.device import Hardware, decide
from train.model import load_trained
from train.recipe import run_stage

CPU = decide(Hardware(), "auto")
DATA = DataSpec(**sql_data("easy", eval_split="dev"))
CHECK = EvalSpec(metrics=["exact_match"], max_new_tokens=16, batch_size=8)
ROWS = [
    {"model": "base", "exact_match": 0.0, "rouge_l": 0.123456},
    {"model": "t/s", "exact_match": 0.25, "rouge_l": 0.5},
]
AUTO = {"causal": AutoModelForCausalLM, "seq2seq": AutoModelForSeq2SeqLM}
STAGES = {  # name: (kind, adapter, model extras)
    "causal-lora": ("causal", {}, {"added_tokens": ["<sql>"]}),
    "causal-qlora": ("causal", {"method": "qlora"}, {}),
    "seq2seq-lora": ("seq2seq", {}, {}),
}
LAUNCHER_FILES = {"config.yaml": "experiment: t\n", "job.json": '{"jobs": []}'}


def trained_stage(tiny, run_dir: Path, kind: str, adapter: dict, **model) -> Path:
    """A stage folder as a finished stage leaves it: 20 steps at a high rate, so the adapter matters."""
    job = make_job(
        tiny,
        run_dir,
        kind,
        model=model_spec(tiny, kind, **model),
        adapter=adapter,
        data=DATA,
        max_steps=20,
        learning_rate=5e-3,
    )
    assert run_stage(job) == "completed"
    write_spec(run_dir, job.model_dump())  # the launcher, at submission
    mark_done(run_dir, "0123456789abcdef")  # the wrapper, after "completed"
    return run_dir


def exported_to(stage_dir: Path, out_dir: Path, **options):
    return export_stage(stage_dir, out_dir, eval_spec=CHECK, eval_rows=ROWS, **options)


@pytest.fixture(scope="module")
def stage(tiny, tmp_path_factory):
    """stage(name) → (stage folder, export folder, ExportResult), trained and exported once per module;
    the export folder holds the launcher's own files from before the export."""
    made = {}

    def get(name: str):
        if name not in made:
            root = tmp_path_factory.mktemp(name)
            kind, adapter, model = STAGES[name]
            stage_dir = trained_stage(tiny, root / "stage", kind, adapter, **model)
            for file, text in LAUNCHER_FILES.items():
                (root / "export").mkdir(exist_ok=True)
                (root / "export" / file).write_text(text)
            made[name] = (stage_dir, root / "export", exported_to(stage_dir, root / "export"))
        return made[name]

    return get


def copied_export(out_dir: Path, tmp_path: Path) -> Path:
    """A copy of the module's finished export folder (its files, marker and launcher files) under tmp_path:
    what exported_to(stage_dir, a fresh folder) would have left there, without exporting again (the
    identity it is skipped by is the stage's and the settings', never the folder's path)."""
    copy = tmp_path / "export"
    shutil.copytree(out_dir, copy)
    return copy


def eval_prompts() -> list[str]:
    """The first 8 prompts of the stages' eval data, as the eval job makes them."""
    return prompts_and_targets(DATA.eval, DATA, None, "causal", 8)[0]


def predictions(model, tokenizer, prompts: list[str], kind: str, spec: EvalSpec = CHECK, images=None):
    """Greedy outputs decoded by `spec`, as the eval job decodes them."""
    explicit_decoding(model, spec)
    options = {"num_beams": 1, "max_new_tokens": spec.max_new_tokens, "batch_size": 8}
    return generate(model, tokenizer, prompts, kind=kind, images=images, **options)


def adapter_on_base(tiny, stage_dir: Path, name: str):
    """The stage's adapter on its unquantized base (for QLoRA: not the 4-bit one it trained on)."""
    kind, _, extras = STAGES[name]
    spec = ModelSpec(**model_spec(tiny, kind, **extras))
    model, tokenizer = load_trained(spec, str(stage_dir / "adapter"), placement=CPU)
    return model.eval(), tokenizer


def reloaded(out_dir: Path, kind: str):
    """The export as anyone loads it: the Auto class, no peft."""
    return AUTO[kind].from_pretrained(out_dir).eval(), AutoTokenizer.from_pretrained(out_dir)


@pytest.mark.parametrize("name", ["causal-lora", "seq2seq-lora"])
@pytest.mark.slow
def test_the_export_loads_without_peft_and_generates_as_the_adapter_on_its_base(tiny, stage, name):
    stage_dir, out_dir, result = stage(name)
    kind = STAGES[name][0]
    prompts = eval_prompts()
    model, tokenizer = adapter_on_base(tiny, stage_dir, name)
    as_trained = predictions(model, tokenizer, prompts, kind)
    with model.disable_adapter():
        base_only = predictions(model, tokenizer, prompts, kind)
    merged, merged_tokenizer = reloaded(out_dir, kind)
    assert not isinstance(merged, peft.PeftModel) and not (out_dir / "adapter_config.json").exists()
    assert predictions(merged, merged_tokenizer, prompts, kind) == as_trained
    assert as_trained != base_only  # the adapter matters here: an export without it would be caught
    assert (out_dir / "model.safetensors").is_file() and merged.dtype == torch.float32
    assert (result.agreement, result.skipped) == (1.0, False) and result.max_logit_diff < 1e-5


@pytest.mark.slow
def test_a_qlora_export_is_merged_into_the_4bit_weights_it_trained_on_and_predicts_as_its_eval(tiny, stage):
    # Before: merged into the original unquantized weights, which the adapter never saw; a tiny QLoRA
    # model so exported agreed with its own eval on 2 of 8 prompts.
    stage_dir, out_dir, result = stage("causal-qlora")
    prompts = eval_prompts()
    spec = ModelSpec(**model_spec(tiny, "causal"))
    as_trained, tokenizer = load_trained(
        spec, str(stage_dir / "adapter"), quantize=AdapterSpec(method="qlora"), placement=CPU
    )
    merged, merged_tokenizer = reloaded(out_dir, "causal")
    assert predictions(merged, merged_tokenizer, prompts, "causal") == predictions(
        as_trained.eval(), tokenizer, prompts, "causal"
    )
    assert "quantization_config" not in json.loads((out_dir / "config.json").read_text())
    card = " ".join((out_dir / "README.md").read_text().split())
    assert (
        "4-bit weights were dequantized to 32-bit precision (float32) and the adapter merged into them"
        in card
    )
    assert f"- {export.UNQUANTIZED}: - agreement: 1.000 (8 of 8 outputs identical" in card
    assert (result.agreement, result.max_logit_diff < 1e-3) == (1.0, True)


def test_added_tokens_and_their_trained_rows_travel_with_the_export(stage):
    stage_dir, out_dir, _ = stage("causal-lora")
    merged, tokenizer = reloaded(out_dir, "causal")
    (sql_id,) = tokenizer.convert_tokens_to_ids(["<sql>"])
    assert sql_id == len(tokenizer) - 1 == merged.get_input_embeddings().weight.shape[0] - 1
    trained = load_file(stage_dir / "adapter" / "adapter_model.safetensors")
    delta = "model.embed_tokens.token_adapter.trainable_tokens_delta"
    head = "lm_head.token_adapter.trainable_tokens_delta"
    rows = {name: tensor for name, tensor in trained.items() if name.endswith((delta, head))}
    assert len(rows) == 2  # the input and the (untied) output rows were trained
    for name, row in rows.items():
        layer = merged.get_input_embeddings() if name.endswith(delta) else merged.get_output_embeddings()
        assert torch.equal(layer.weight[sql_id], row[0])


def test_the_card_holds_the_self_check_figures_training_settings_and_the_eval_table(stage):
    _, out_dir, result = stage("causal-lora")
    card = (out_dir / "README.md").read_text()
    assert (
        "against:\n\n- the adapter on its base as trained:\n  - agreement: 1.000 (8 of 8 outputs identical"
        in card
    )
    assert f"largest absolute logit difference, first forward: {result.max_logit_diff:.3g}" in card
    for fact in ("LoRA rank / alpha / dropout: 8 / 16 / 0", "learning rate / scheduler / warmup: 0.005"):
        assert fact in card
    assert "added tokens: ['<sql>']" in card and "sql/easy.jsonl" in card and "sql/dev.jsonl" in card
    assert (
        "| model | exact_match | rouge_l |\n|---|---|---|\n| base | 0 | 0.1235 |\n| t/s | 0.25 | 0.5 |"
        in card
    )
    assert "python /path/to/llama.cpp/convert_hf_to_gguf.py" in card  # no converter here: the command
    generation = json.loads((out_dir / "generation_config.json").read_text())
    assert (generation["max_new_tokens"], generation["num_beams"], generation["do_sample"]) == (16, 1, False)


def test_a_second_export_is_skipped_and_the_job_folders_own_files_are_left_alone(stage, tmp_path):
    stage_dir, out_dir, first = stage("seq2seq-lora")
    weights = (out_dir / "model.safetensors").stat().st_mtime_ns
    again = exported_to(stage_dir, out_dir)
    assert again.skipped and (again.agreement, again.max_logit_diff) == (
        first.agreement,
        first.max_logit_diff,
    )
    assert (out_dir / "model.safetensors").stat().st_mtime_ns == weights
    assert {name: (out_dir / name).read_text() for name in LAUNCHER_FILES} == LAUNCHER_FILES
    # Other settings: exported again, the job folder's own files still left alone. On a copy of the
    # folder, so the module's export stays the one every other test reads.
    other = copied_export(out_dir, tmp_path)
    assert not exported_to(stage_dir, other, check_prompts=4).skipped
    assert {name: (other / name).read_text() for name in LAUNCHER_FILES} == LAUNCHER_FILES


def test_a_killed_export_is_redone_and_its_stale_files_removed_never_taken_for_done(stage, tmp_path):
    stage_dir, module_export, _ = stage("seq2seq-lora")
    out_dir = copied_export(module_export, tmp_path)  # a finished export, as exported_to leaves it
    done = json.loads(RunDir(out_dir).export_done.read_text())
    # Killed while moving a new export in (one that had a GGUF file), and once while still writing one.
    (out_dir / "model.gguf").write_text("half")
    RunDir(out_dir).export_done.write_text(
        json.dumps({"identity": None, "files": [*done["files"], "model.gguf"]})
    )
    (out_dir / f"{export.PARTIAL_PREFIX}killed").mkdir()
    (out_dir / f"{export.PARTIAL_PREFIX}killed" / "model.safetensors").write_text("half")
    assert not exported_to(stage_dir, out_dir).skipped
    assert not (out_dir / "model.gguf").exists() and not list(out_dir.glob(f"{export.PARTIAL_PREFIX}*"))
    assert RunDir(out_dir).read_export_done()["identity"] == done["identity"]
    assert exported_to(stage_dir, out_dir).skipped


def test_a_merge_that_loses_the_adapter_fails_the_export_with_the_figures_and_writes_nothing(
    stage, tmp_path, monkeypatch
):
    stage_dir, _, _ = stage("causal-lora")
    # peft's merge, broken: the LoRA layers are taken off and never added into the weights.
    monkeypatch.setattr(BaseTuner, "merge_and_unload", lambda self, **_: self.unload())
    out_dir = tmp_path / "export"
    with pytest.raises(ExportCheckFailed) as failed:
        exported_to(stage_dir, out_dir)
    message = str(failed.value)
    assert "greedy outputs identical (agreement" in message and "max logit difference" in message
    assert "is above 0.001" in message and "prompt " in message  # the figures, and what differed
    assert sorted(p.name for p in out_dir.iterdir()) == []  # no model, no marker, no partial folder


def test_comparing_the_adapter_with_its_own_base_fails_the_check_with_the_figures(tiny, stage):
    stage_dir, _, _ = stage("causal-lora")
    model, tokenizer = adapter_on_base(tiny, stage_dir, "causal-lora")
    job = export.check_job(stage_dir, stage_dir / "unused", CHECK, check_prompts=8)
    prompts, _ = export.check_inputs(job, tokenizer)
    with_adapter = export.greedy_outputs(model, tokenizer, job, prompts, None)
    with model.disable_adapter():
        without = export.greedy_outputs(model, tokenizer, job, prompts, None)
    check = export.self_check(
        "its base", with_adapter, without, export.bound_for("lora", torch.float32), prompts
    )
    assert check.agreement < 1.0 and check.max_logit_diff > 0.01
    with pytest.raises(ExportCheckFailed, match=r"agreement .* is below 1.*max logit difference .* is above"):
        export.require_within_bound(check)
    # The same outputs on both sides pass, with figures that say so.
    same = export.self_check(
        "itself", with_adapter, with_adapter, export.bound_for("lora", torch.float32), prompts
    )
    assert same.failures() == [] and same.figures().startswith("8 of 8 greedy outputs identical")


FAKE_CONVERTER = """import sys
from pathlib import Path
args = sys.argv[1:]
Path(args[args.index("--outfile") + 1]).write_text("GGUF " + " ".join(args))
"""


def fake_llama_cpp(tmp_path: Path) -> Path:
    """A llama.cpp folder whose converter writes its argv into the file it is asked for."""
    folder = tmp_path / "llama.cpp"
    folder.mkdir()
    (folder / "convert_hf_to_gguf.py").write_text(FAKE_CONVERTER)
    return folder


@pytest.mark.slow
def test_gguf_runs_the_converter_in_llama_cpp_dir_by_hand_and_names_the_command_without_one(
    stage, tmp_path, monkeypatch, capsys
):
    stage_dir, _, _ = stage("seq2seq-lora")
    out_dir = tmp_path / "export"
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.delenv("LLAMA_CPP_DIR", raising=False)
    # Asked for, no converter yet. The check decodes as CHECK (16 tokens), not EvalSpec's default 128 (this
    # test is about the converter: the same export, 8 times fewer decoding steps); so does main, below.
    missing = export_stage(stage_dir, out_dir, eval_spec=CHECK, check_prompts=4, gguf=True)
    assert missing.gguf is None and missing.gguf_command.startswith(f"python {export.CONVERTER_PLACEHOLDER} ")
    monkeypatch.setenv("LLAMA_CPP_DIR", str(fake_llama_cpp(tmp_path)))
    eval_job = export.check_job(stage_dir, tmp_path / "eval", CHECK, check_prompts=8)  # the eval job's spec
    write_spec(tmp_path / "eval", eval_job.model_dump())
    capsys.readouterr()  # what training printed, when this test trained the stage
    by_hand = [str(stage_dir), str(out_dir), "--gguf", "--check-prompts", "4"]
    assert export.main([*by_hand, "--eval-config", str(RunDir(tmp_path / "eval").config)]) == 0
    converted = (out_dir / "model.gguf").read_text()
    assert converted.startswith("GGUF ") and "--outtype f32" in converted
    assert "`model.gguf` was made by llama.cpp's converter" in (out_dir / "README.md").read_text()
    printed = capsys.readouterr().out
    assert json.loads(printed)["gguf"] == str(out_dir / "model.gguf"), printed
    # Without a converter: the exact command, never a failure.
    assert export.gguf_converter({"PATH": str(tmp_path / "empty")}) is None
    command = export.gguf_command(
        export.CONVERTER_PLACEHOLDER, Path("/runs/e/export"), torch.bfloat16, "causal"
    )
    assert command == (
        "python /path/to/llama.cpp/convert_hf_to_gguf.py /runs/e/export --outfile /runs/e/export/model.gguf "
        "--outtype bf16"
    )
    vision = export.gguf_command("convert_hf_to_gguf.py", Path("/x"), torch.float16, "image-text")
    assert vision.endswith(
        " && python convert_hf_to_gguf.py /x --mmproj --outfile /x/mmproj.gguf --outtype f16"
    )
    on_path = tmp_path / "bin"
    on_path.mkdir()
    (on_path / "convert-hf-to-gguf.py").write_text(FAKE_CONVERTER)
    (on_path / "convert-hf-to-gguf.py").chmod(0o755)
    assert export.gguf_converter({"PATH": str(on_path)}) == on_path / "convert-hf-to-gguf.py"


def test_an_export_of_a_stage_without_its_adapter_says_which_folder_lacks_it(tiny, tmp_path):
    job = make_job(tiny, tmp_path / "stage")
    write_spec(tmp_path / "stage", job.model_dump())
    with pytest.raises(ExportError, match=r"stage/adapter: no trained adapter"):
        export_stage(tmp_path / "stage", tmp_path / "export")
    with pytest.raises(ExportError, match="no readable stage spec"):
        export_stage(tmp_path / "nowhere", tmp_path / "export")


def test_the_eval_table_renders_whatever_columns_its_rows_have():
    rows = [{"model": "base", "rouge_l": 0.123456}, {"model": "a|b", "exact_match": 1.0, "note": None}]
    assert export.markdown_table(rows) == (
        "| model | rouge_l | exact_match | note |\n|---|---|---|---|\n"
        "| base | 0.1235 |  |  |\n| a\\|b |  | 1 |  |\n"
    )


@pytest.mark.slow
def test_an_image_text_export_loads_with_auto_classes_and_generates_as_the_adapter(
    tiny, tmp_path, monkeypatch
):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from eval.generate import eval_placement, load_for_eval

    shapes = Path(__file__).resolve().parent.parent / "data" / "demo" / "shapes"
    job = make_job(
        tiny,
        tmp_path / "stage",
        model={"name_or_path": str(tiny["tiny-qwen-vl"]), "kind": "image-text"},
        adapter={"max_trainable_percent": 25},
        data={
            "train": str(shapes / "easy.jsonl"),
            "eval": str(shapes / "dev.jsonl"),
            "image_field": "image",
            "input_field": "question",
            "target_field": "answer",
            "max_pixels": 3136,
        },
        max_steps=10,
        learning_rate=5e-3,
    )
    assert run_stage(job) == "completed"
    write_spec(tmp_path / "stage", job.model_dump())
    spec = EvalSpec(metrics=["exact_match"], max_new_tokens=4)
    monkeypatch.setenv("LLAMA_CPP_DIR", str(fake_llama_cpp(tmp_path)))
    result = export_stage(tmp_path / "stage", tmp_path / "export", eval_spec=spec, gguf=True)
    assert result.agreement == 1.0 and result.max_logit_diff < 1e-4
    assert "--mmproj" in (tmp_path / "export" / "mmproj.gguf").read_text()  # the vision part, on its own
    check = export.check_job(tmp_path / "stage", tmp_path / "unused", spec, check_prompts=8)
    model, processor = load_for_eval(check, eval_placement(check.adapter_dir))
    prompts, images = export.check_inputs(check, processor)
    as_trained = predictions(model, processor, prompts, "image-text", spec, images)
    merged = AutoModelForImageTextToText.from_pretrained(tmp_path / "export").eval()
    processor = AutoProcessor.from_pretrained(tmp_path / "export")
    assert predictions(merged, processor, prompts, "image-text", spec, images) == as_trained
    assert (tmp_path / "export" / "processor_config.json").is_file()


def test_by_hand_the_eval_configs_give_the_decoding_and_the_table_with_the_base_row_first(tiny, tmp_path):
    from core.config import EvalJob

    def eval_folder(name: str, adapter_dir: str | None, scores: dict) -> Path:
        job = EvalJob(
            experiment="t",
            stage="s",
            model=model_spec(tiny),
            adapter={},
            data=DATA,
            eval=CHECK,
            adapter_dir=adapter_dir,
            out_dir=str(tmp_path / name),
        )
        write_spec(tmp_path / name, job.model_dump())
        (tmp_path / name / "results.json").write_text(json.dumps(scores | {"split": "eval"}))
        return RunDir(tmp_path / name).config

    adapter = eval_folder("eval", str(tmp_path / "stage" / "adapter"), {"exact_match": 0.5})
    base = eval_folder("base-eval", None, {"exact_match": 0.125})
    spec, rows = export.eval_inputs([adapter, base])
    assert spec == CHECK
    assert rows == [
        {"model": "base (no adapter)", "exact_match": 0.125},
        {"model": "t/s", "exact_match": 0.5},
    ]
    with pytest.raises(ExportError, match="not an eval job's config.yaml"):
        export.eval_inputs([tmp_path / "missing.yaml"])


def test_the_card_of_a_pruned_run_says_it_was_stopped_early_and_where(tiny, tmp_path):
    """Before: a sweep's run pruned at its first rung was published as if it had trained its epochs."""
    from core.pruning import RungRecord, mark_pruned

    run_dir = tmp_path / "stage"
    run_dir.mkdir()
    job = make_job(tiny, run_dir, "causal", max_steps=None, epochs=3)
    assert export.pruned_note(run_dir, job) == []  # not pruned: nothing said
    mark_pruned(run_dir, RungRecord("t-r8-s1", "h", "def-a", 1.0, 3.21, True, 1.15, 4))
    (note,) = export.pruned_note(run_dir, job)
    assert "**Pruned:**" in note and "rung 1: eval_loss 3.21 > cutoff 1.15 of 4 runs" in note
    assert "did not train its planned 3 epochs" in note


def test_a_gguf_export_without_llama_cpp_is_named_as_holding_no_gguf(tmp_path):
    """Before: `--export --export-format gguf` without a converter exited 0, saying "Exported:"; only a
    warning in the job's log said no GGUF was made. The markers are what export.commit writes."""
    from slurm.commands.export import without_gguf

    made, missing = tmp_path / "made", tmp_path / "missing"
    for out_dir, gguf in ((made, "model.gguf"), (missing, None)):
        partial = out_dir / ".partial"
        partial.mkdir(parents=True)
        (partial / "README.md").write_text("card")
        command = f"python /path/to/llama.cpp/convert_hf_to_gguf.py {out_dir} --outfile {out_dir}/model.gguf"
        export.commit(partial, out_dir, "id", {"gguf": gguf, "gguf_command": command}, previous=[])
    (line,) = without_gguf([made, missing])
    assert line.startswith(f"no GGUF was made in {missing}/") and "LLAMA_CPP_DIR" in line
    assert f"convert_hf_to_gguf.py {missing} --outfile" in line
