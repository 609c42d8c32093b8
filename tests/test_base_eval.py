"""The base model scored without an adapter (eval.baseline): one real eval job shared by the experiments
that need the same one, run once, beside their own evals; its results are what the report's base row and
deltas read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import launch
from core.job_records import job_records
from core.rundir import RunDir, mark_done
from core.states import State
from slurm.cluster.profile import load_profile
from slurm.commands.cancel import without_shared_bases
from slurm.planning.experiments import load_experiments
from slurm.planning.plan import legacy_base_eval_job
from slurm.queueing.decisions import weigh
from slurm.watching.status import JobStatus
from tests.conftest import write_cluster_yaml
from tests.helpers import holding_sbatch, plan_for, start_launcher, tiny_sql_base

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


def test_cancelling_one_experiment_keeps_the_base_eval_another_still_needs_and_the_last_takes_it(
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
        assert launch.main(["--cancel", "--exp", "r8", "--config-dir", str(folder)]) == 0
        said = capsys.readouterr().out
        assert "r8/train" in said and base in said  # r8 was the last to use it (r4 was cancelled)
    finally:
        launch.main(["--cancel", "--all", "--config-dir", str(folder)])


@pytest.mark.parametrize(
    ("r8_state", "base_cancelled"),
    [(State.CANCELLED, True), (State.BLOCKED, True), (State.RUNNING, False), (State.COMPLETED, False)],
)
def test_a_shared_base_eval_is_cancelled_with_the_last_experiment_that_uses_it(
    tmp_path, repo_root, monkeypatch, r8_state, base_cancelled
):
    # Before: --cancel --exp r4 kept the base eval whenever any other experiment had it, even one
    # cancelled before (r8), so it was never cancelled unless both were named at once.
    monkeypatch.chdir(repo_root)
    everything = base_plan(tmp_path, repo_root, r4={}, r8={})
    base = everything.base_of["r4"]
    assert everything.base_of["r8"] == base
    r4 = everything.only({j.id for j in everything.jobs if j.experiment == "r4"} | {base})
    rows = [JobStatus(j, r8_state if j.experiment == "r8" else State.RUNNING) for j in everything.jobs]
    cancelled = {j.id for j in without_shared_bases(r4, everything, rows).jobs}
    assert (base in cancelled) is base_cancelled
    assert {j.id for j in r4.jobs if j.experiment == "r4"} <= cancelled


# Issue 31, rule 9: one base eval per base, exactly.
BASE_ONLY = """\
name: {name}
inherits: _tiny-sql.yaml
model: {{name_or_path: {model}}}
data: {{eval: {root}/data/demo/sql/dev.jsonl}}
train: {{epochs: 1}}
eval: {{metrics: [exact_match], max_new_tokens: {tokens}, baseline: true}}
"""


def base_plan(tmp_path: Path, repo_root: Path, **experiments: dict):
    folder = tmp_path / "configs"
    folder.mkdir(exist_ok=True)
    write_cluster_yaml(folder, tmp_path)
    tiny_sql_base(folder)
    for name, fields in experiments.items():
        fields = {"model": "./models/tiny-llama", "tokens": 16, "root": repo_root, **fields}
        (folder / f"{name}.yaml").write_text(BASE_ONLY.format(name=name, **fields))
    return plan_for(folder=folder)


def test_two_generation_settings_never_share_one_base_eval_folder(tmp_path, repo_root, monkeypatch):
    # Before: folders were named by 24 bits of the content's hash, and max_new_tokens 1261 and 3619
    # shared one, so one point's delta was measured against a base scored with other settings.
    monkeypatch.chdir(repo_root)
    plan = base_plan(tmp_path, repo_root, short={"tokens": 1261}, long={"tokens": 3619})
    short, long = plan.base_of["short"], plan.base_of["long"]
    assert short != long
    for job_id in (short, long):
        identity = job_id.split("/")[0].rsplit("-", 1)[1]
        assert len(identity) == 16 and int(identity, 16) >= 0  # the full identity, as a run's hash


def test_three_spellings_of_one_local_model_path_are_one_base_eval(tmp_path, repo_root, monkeypatch):
    monkeypatch.chdir(repo_root)
    spellings = {
        "dot": {"model": "./models/tiny-llama"},
        "slash": {"model": "models/tiny-llama/"},
        "absolute": {"model": repo_root / "models" / "tiny-llama"},
    }
    plan = base_plan(tmp_path, repo_root, **spellings)
    assert len(set(plan.base_of.values())) == 1
    (base,) = [j for j in plan.jobs if j.id == plan.base_of["dot"]]
    assert base.spec.model.name_or_path == "models/tiny-llama"  # relative: moving the repository is no change


def test_a_base_eval_finished_under_its_old_name_is_kept_and_another_contents_is_not_taken(
    tmp_path, repo_root, monkeypatch
):
    # Finished runs stay finished: a run root from before full-identity names has its base eval under
    # the old name (6 hex characters, the model path as written); it is recognised, not run again.
    monkeypatch.chdir(repo_root)
    plan = base_plan(tmp_path, repo_root, one={})
    new_id = plan.base_of["one"]
    profile, _ = load_profile(tmp_path / "configs")
    (loaded,) = load_experiments(tmp_path / "configs", profile)
    old = legacy_base_eval_job(loaded, profile)
    assert old.id != new_id and len(old.id.split("/")[0].rsplit("-", 1)[1]) == 6
    Path(old.run_dir).mkdir(parents=True)
    mark_done(Path(old.run_dir), "0123456789abcdef")  # another content's base eval shared the old name
    assert base_plan(tmp_path, repo_root, one={}).base_of["one"] == new_id  # not taken for this one
    mark_done(Path(old.run_dir), old.config_hash)  # this content's, finished before names were full
    RunDir(Path(old.run_dir)).results.write_text('{"exact_match": 0.5, "n": 1}')
    again = base_plan(tmp_path, repo_root, one={})
    assert again.base_of["one"] == old.id
    decisions, _ = weigh(again)
    assert {d.job.id: d.action for d in decisions}[old.id] == "done"
