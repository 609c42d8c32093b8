"""The base model scored without an adapter (eval.baseline): one real eval job shared by the experiments
that need the same one, run once, beside their own evals; its results are what the report's base row and
deltas read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import launch
from core.rundir import RunDir, job_records
from tests.conftest import write_cluster_yaml
from tests.helpers import holding_sbatch, start_launcher, tiny_sql_base

EXPERIMENT = """\
name: {name}
inherits: _tiny-sql.yaml
adapter: {{rank: {rank}, max_trainable_percent: 40}}
data: {{eval: {root}/data/demo/sql/dev.jsonl}}
train: {{epochs: 1, batch_size: 16, learning_rate: 3.0e-3}}
eval: {{metrics: [exact_match, rouge_l], limit: 8, max_new_tokens: 16, baseline: true}}
"""


@pytest.mark.slow
def test_one_base_eval_runs_for_the_experiments_that_share_it_and_scores_the_base_alone(
    repo_root, tmp_path, tiny, monkeypatch, capsys
):
    monkeypatch.chdir(repo_root)
    folder = tmp_path / "configs"
    folder.mkdir()
    write_cluster_yaml(folder, tmp_path, local_parallel_jobs=2)
    tiny_sql_base(folder)
    for name, rank in (("r4", 4), ("r8", 8)):  # same base, same eval data and settings: one base job
        (folder / f"{name}.yaml").write_text(EXPERIMENT.format(name=name, root=repo_root, rank=rank))
    assert launch.main(["--all", "--dry-run", "--json", "--config-dir", str(folder)]) == 0
    plan = json.loads(capsys.readouterr().out)
    bases = [j["id"] for j in plan["jobs"] if j["id"].startswith("_base-")]
    assert len(bases) == 1 and len(plan["jobs"]) == 5  # 2 trainings, 2 evals, 1 base eval
    assert launch.main(["--all", "--config-dir", str(folder), "--backend", "local"]) == 0
    capsys.readouterr()
    base_dir = tmp_path / "runs" / bases[0]
    results = RunDir(base_dir).read_results()
    assert results["adapter_dir"] is None and "exact_match" in results and "rouge_l" in results
    assert len(job_records(base_dir)) == 1  # ran once
    # The adapters' evals scored the same prompts: the same number of predictions, the same references.
    ours = (tmp_path / "runs" / "r4" / "eval" / "predictions.jsonl").read_text().splitlines()
    base = (base_dir / "predictions.jsonl").read_text().splitlines()
    assert [json.loads(r)["reference"] for r in ours] == [json.loads(r)["reference"] for r in base]
    assert launch.main(["--all", "--config-dir", str(folder), "--backend", "local"]) == 0
    assert "Nothing to submit" in capsys.readouterr().out and len(job_records(base_dir)) == 1
    report = (tmp_path / "runs" / "report.md").read_text()
    assert "base (no adapter)" in report
    assert Path(tmp_path / "runs" / "report.csv").read_text().count("base (no adapter)") >= 1


def test_cancelling_one_experiment_keeps_the_base_eval_another_still_needs(
    repo_root, tmp_path, tiny, slurm_cluster, monkeypatch, capsys
):
    from tests.conftest import squeue_ids

    monkeypatch.chdir(repo_root)
    folder = tmp_path / "configs"
    folder.mkdir()
    write_cluster_yaml(folder, tmp_path)
    tiny_sql_base(folder)
    for name, rank in (("r4", 4), ("r8", 8)):
        (folder / f"{name}.yaml").write_text(EXPERIMENT.format(name=name, root=repo_root, rank=rank))
    first = start_launcher(
        folder, tmp_path / "first.log", "--backend", "slurm", env=holding_sbatch(tmp_path / "hold")
    )
    assert first.wait(timeout=300) == 0, (tmp_path / "first.log").read_text()
    try:
        (base,) = [p.parent.name for p in (tmp_path / "runs").glob("_base-*/eval")]
        base_job = job_records(tmp_path / "runs" / base / "eval")[-1].job_id
        assert launch.main(["--cancel", "--exp", "r4", "--config-dir", str(folder)]) == 0
        said = capsys.readouterr().out
        assert "r4/train" in said and base not in said  # r8's base row still needs it
        assert base_job in squeue_ids(under=tmp_path)
    finally:
        launch.main(["--cancel", "--all", "--config-dir", str(folder)])
