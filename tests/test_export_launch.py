"""launch.py --export as a user runs it: the experiments' missing jobs first, then one export job per
experiment (here with --backend local), a merged model that loads with the plain Auto class and predicts
what the adapter's own eval predicted, a model card whose table is the report's rows, and a second
--export that does nothing."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer

import launch
from core import chat_templates
from core.config import EvalJob
from core.job_records import job_records
from core.rundir import read_spec
from eval.generate import explicit_decoding, generate
from tests.conftest import write_cluster_yaml
from tests.helpers import demo_configs, tiny_sql_base
from train.data import prompts_and_targets

EXPERIMENT = """\
name: {name}
inherits: _tiny-sql.yaml
adapter: {{method: {method}, rank: 8, alpha: 16, max_trainable_percent: 40}}
data: {{eval: {root}/data/demo/sql/dev.jsonl}}
train: {{epochs: 2, batch_size: 8, learning_rate: 5.0e-3}}
eval: {{metrics: [exact_match, rouge_l], limit: 8, max_new_tokens: 16, baseline: true}}
resources: {{mem_gb: 2}}
"""


DEMO_EXPORTS = {  # the demo's LoRA, QLoRA and chat experiments: their kind, and their last stage's folder
    "sql-t5-lora": ("seq2seq", AutoModelForSeq2SeqLM),
    "sql-llama-qlora-curriculum": ("causal", AutoModelForCausalLM),
    "sql-llama-chat": ("causal", AutoModelForCausalLM),
}


def card_rows(card: str) -> dict[str, dict[str, str]]:
    """The model card's eval table: label → column → cell."""
    lines = [line for line in card.splitlines() if line.startswith("| ")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[1:]]
    return {row[0]: dict(zip(header[1:], row[1:], strict=True)) for row in rows}


@pytest.mark.slow
def test_the_demos_lora_and_qlora_exports_load_without_peft_and_predict_as_their_evals_did(
    repo_root, tmp_path, tiny, monkeypatch, capsys
):
    monkeypatch.chdir(repo_root)
    folder = demo_configs(repo_root, tmp_path)
    write_cluster_yaml(folder.parent, tmp_path, local_parallel_jobs=2)
    # One epoch and 8 eval prompts: the test compares 8 predictions, and what the tiny models learn in the
    # demo's epochs is not what it asserts (the same overrides reach --report, so the hashes agree).
    smaller = ["train.epochs=1", "eval.limit=8"]
    argv = ["--export", "--exp", *DEMO_EXPORTS, "--config-dir", str(folder), "--backend", "local", *smaller]
    # Nothing trained yet: --export runs the trainings, evals and base evals first, then the exports.
    assert launch.main(argv) == 0
    assert "Exported: " in capsys.readouterr().out
    assert launch.main(["--report", "--config-dir", str(folder), *smaller]) == 0
    report = {row["experiment"]: row for row in csv.DictReader((tmp_path / "runs" / "report.csv").open())}
    for name, (kind, auto) in DEMO_EXPORTS.items():
        out = tmp_path / "runs" / name / "export"
        eval_job = EvalJob.model_validate(read_spec(tmp_path / "runs" / name / "eval"))
        merged = auto.from_pretrained(out).eval()  # no peft: a plain model
        tokenizer = AutoTokenizer.from_pretrained(out)
        prompts = prompts_and_targets(eval_job.source, eval_job.data, tokenizer, kind, 8)[0]
        explicit_decoding(merged, eval_job.eval)
        templated = eval_job.data.format == "messages"
        if templated:  # the chat template and its end-of-turn travel with the model, for vLLM and Ollama
            assert tokenizer.chat_template == chat_templates.CHATML
            assert tokenizer.convert_tokens_to_ids("<|im_end|>") in merged.generation_config.eos_token_id
            assert prompts[0].endswith("<|im_start|>assistant\n")
        options = {"num_beams": 1, "max_new_tokens": eval_job.eval.max_new_tokens, "batch_size": 8}
        options["templated"] = templated
        ours = generate(merged, tokenizer, prompts, kind=kind, **options)
        rows = (tmp_path / "runs" / name / "eval" / "predictions.jsonl").read_text().splitlines()
        assert ours == [json.loads(row)["prediction"] for row in rows][:8], name
        # The card's table is the report's: the adapter's row and the base row, score by score.
        table = card_rows((out / "README.md").read_text())
        ours_row = next(row for label, row in table.items() if label.startswith(f"{name}/"))
        scores = [c for c in ours_row if report[name].get(c)]
        assert scores and all(ours_row[c] == f"{float(report[name][c]):.4g}" for c in scores), name
        # A base row where there is one: the chat experiment's base has no embeddings for its added tokens.
        assert ("base (no adapter)" in table) == (name != "sql-llama-chat"), name
    assert (
        "dequantized"
        in (tmp_path / "runs" / "sql-llama-qlora-curriculum" / "export" / "README.md").read_text()
    )
    records = {name: job_records(tmp_path / "runs" / name / "export") for name in DEMO_EXPORTS}
    assert launch.main(argv) == 0
    assert "Nothing to submit" in capsys.readouterr().out
    assert records == {name: job_records(tmp_path / "runs" / name / "export") for name in DEMO_EXPORTS}


def test_export_runs_as_a_slurm_job_after_the_training_it_needs(
    repo_root, tmp_path, tiny, slurm_cluster, monkeypatch, capsys
):
    monkeypatch.chdir(repo_root)
    folder = tmp_path / "configs"
    folder.mkdir()
    write_cluster_yaml(folder, tmp_path)
    tiny_sql_base(folder)
    (folder / "lora.yaml").write_text(EXPERIMENT.format(name="lora", root=repo_root, method="lora"))
    argv = ["--export", "lora", "--config-dir", str(folder), "--backend", "slurm", "--no-preflight"]
    assert launch.main([*argv, "--wait"]) == 0
    out = tmp_path / "runs" / "lora" / "export"
    assert (out / "model.safetensors").is_file() and (out / "DONE").is_file()
    (record,) = job_records(out)
    assert record.backend == "slurm"  # a job of its own, queued after lora/train (afterok)
    assert AutoModelForCausalLM.from_pretrained(out) is not None


def test_a_finished_export_asked_again_in_another_format_is_redone_in_place_not_refused(repo_root, tmp_path):
    # Before: --export-format gguf after a safetensors export was "already finished: rerun with --force",
    # and --force archived the whole export folder (gigabytes for a 7B) before making it again.
    from core.rundir import mark_done, write_spec
    from slurm.cluster.profile import load_profile
    from slurm.planning.experiments import load_experiments
    from slurm.planning.plan import build_plan, with_exports
    from slurm.queueing.decisions import archive_stale, weigh

    folder = tmp_path / "configs"
    folder.mkdir()
    write_cluster_yaml(folder, tmp_path)
    tiny_sql_base(folder)
    (folder / "lora.yaml").write_text(EXPERIMENT.format(name="lora", root=repo_root, method="lora"))
    profile, _ = load_profile(folder)
    plan = build_plan(load_experiments(folder, profile), profile)
    first = with_exports(plan, [("lora", None)], gguf=False)
    again = with_exports(plan, [("lora", None)], gguf=True)
    export, asked = first.job("lora/export"), again.job("lora/export")
    assert export.config_hash != asked.config_hash
    write_spec(Path(export.run_dir), export.spec.model_dump())
    mark_done(Path(export.run_dir), export.config_hash)
    (Path(export.run_dir) / "model.safetensors").write_text("the earlier export")
    decisions, refusals = weigh(again)
    assert {d.job.id: d.action for d in decisions}["lora/export"] == "submit" and refusals == []
    assert archive_stale(asked) is None and (Path(export.run_dir) / "model.safetensors").is_file()
