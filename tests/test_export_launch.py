"""launch.py --export as a user runs it: the experiments' missing jobs first, then one export job per
experiment (here with --backend local), a merged model that loads with the plain Auto class and predicts
what the adapter's own eval predicted, a model card whose table is the report's rows, and a second
--export that does nothing."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

import launch
from eval.generate import explicit_decoding, generate
from spec.config import EvalJob
from spec.rundir import job_records, read_spec
from tests.conftest import write_cluster_yaml
from train.data import prompts_and_targets

EXPERIMENT = """\
name: {name}
model: {{name_or_path: {root}/models/tiny-llama, kind: causal}}
adapter: {{method: {method}, rank: 8, alpha: 16, dropout: 0.0, max_trainable_percent: 40}}
data:
  train: {root}/data/demo/sql/easy.jsonl
  eval: {root}/data/demo/sql/dev.jsonl
  input_field: question
  target_field: sql
  prompt_template: "{{schema}} | {{question}} | SQL: "
train: {{epochs: 2, batch_size: 8, eval_every_epochs: null, learning_rate: 5.0e-3}}
eval: {{metrics: [exact_match, rouge_l], limit: 8, max_new_tokens: 16, baseline: true}}
resources: {{gpus: 0, cpus: 1, mem_gb: 2, time: "00:15:00"}}
"""


@pytest.mark.slow
def test_export_merges_each_adapter_into_a_model_that_predicts_as_its_eval_did(
    repo_root, tmp_path, tiny, monkeypatch, capsys
):
    monkeypatch.chdir(repo_root)
    folder = tmp_path / "configs"
    folder.mkdir()
    write_cluster_yaml(folder, tmp_path, local_parallel_jobs=2)
    for name, method in (("lora", "lora"), ("qlora", "qlora")):
        (folder / f"{name}.yaml").write_text(EXPERIMENT.format(name=name, root=repo_root, method=method))
    # Nothing trained yet: --export runs the trainings, evals and base evals first, then the exports.
    assert launch.main(["--export", "--all", "--config-dir", str(folder), "--backend", "local"]) == 0
    assert "Exported: " in capsys.readouterr().out
    assert launch.main(["--report", "--config-dir", str(folder)]) == 0
    report = {row["experiment"]: row for row in csv.DictReader((tmp_path / "runs" / "report.csv").open())}
    for name in ("lora", "qlora"):
        out = tmp_path / "runs" / name / "export"
        eval_job = EvalJob.model_validate(read_spec(tmp_path / "runs" / name / "eval"))
        prompts = prompts_and_targets(eval_job.source, eval_job.data, limit=8)[0]
        merged = AutoModelForCausalLM.from_pretrained(out).eval()  # no peft: a plain model
        tokenizer = AutoTokenizer.from_pretrained(out)
        explicit_decoding(merged, eval_job.eval)
        options = {"num_beams": 1, "max_new_tokens": eval_job.eval.max_new_tokens, "batch_size": 8}
        ours = generate(merged, tokenizer, prompts, kind="causal", **options)
        rows = (tmp_path / "runs" / name / "eval" / "predictions.jsonl").read_text().splitlines()
        assert ours == [json.loads(row)["prediction"] for row in rows][:8], name
        card = (out / "README.md").read_text()
        scores = f"{float(report[name]['rouge_l']):.4g}"
        assert scores in card and "base (no adapter)" in card, card
        if name == "qlora":
            assert "dequantized" in card  # merged into the 4-bit weights it trained on
    records = {name: job_records(tmp_path / "runs" / name / "export") for name in ("lora", "qlora")}
    assert launch.main(["--export", "--all", "--config-dir", str(folder), "--backend", "local"]) == 0
    assert "Nothing to submit" in capsys.readouterr().out
    assert records == {name: job_records(tmp_path / "runs" / name / "export") for name in ("lora", "qlora")}


def test_export_runs_as_a_slurm_job_after_the_training_it_needs(
    repo_root, tmp_path, tiny, slurm_cluster, monkeypatch, capsys
):
    monkeypatch.chdir(repo_root)
    folder = tmp_path / "configs"
    folder.mkdir()
    write_cluster_yaml(folder, tmp_path)
    (folder / "lora.yaml").write_text(EXPERIMENT.format(name="lora", root=repo_root, method="lora"))
    argv = ["--export", "lora", "--config-dir", str(folder), "--backend", "slurm", "--no-preflight"]
    assert launch.main([*argv, "--wait"]) == 0
    out = tmp_path / "runs" / "lora" / "export"
    assert (out / "model.safetensors").is_file() and (out / "DONE").is_file()
    (record,) = job_records(out)
    assert record["backend"] == "slurm"  # a job of its own, queued after lora/train (afterok)
    assert AutoModelForCausalLM.from_pretrained(out) is not None


def test_a_finished_export_asked_again_in_another_format_is_redone_in_place_not_refused(repo_root, tmp_path):
    # Before: --export-format gguf after a safetensors export was "already finished: rerun with --force",
    # and --force archived the whole export folder (gigabytes for a 7B) before making it again.
    from slurm.experiments import load_experiments
    from slurm.launcher import archive_stale, weigh
    from slurm.plan import build_plan, with_exports
    from slurm.profile import load_profile
    from spec.rundir import mark_done, write_spec

    folder = tmp_path / "configs"
    folder.mkdir()
    write_cluster_yaml(folder, tmp_path)
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
