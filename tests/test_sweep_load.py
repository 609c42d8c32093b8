"""A sweep is experiments: the loader expands a `sweep:` block into ordinary experiments that are validated,
selected and planned like any other, and a wrong value is blamed on the sweep's own line."""

from __future__ import annotations

import json
from pathlib import Path

import launch
from slurm.cluster.profile import load_profile
from slurm.planning.experiments import load_experiments
from tests.conftest import write_cluster_yaml
from tests.helpers import plan_for

SWEPT = """\
name: lr
model: {{name_or_path: org/model, kind: causal}}
data: {{train: {data}, input_field: q, target_field: a}}
eval: {{metrics: []}}
resources: {{mem_gb: 4, cpus: 1}}
sweep:
  grid:
    train.learning_rate: [1.0e-4, {second_lr}]
    adapter.rank: [4, 8]
  seeds: [1, 2, 3]
  select: {{metric: eval_loss, mode: min}}
"""
AFTER = """\
name: after-all
model: {{name_or_path: org/model, kind: causal}}
data: {{train: {data}, input_field: q, target_field: a}}
eval: {{metrics: []}}
resources: {{mem_gb: 4, cpus: 1}}
after: [lr]
"""


def folder_of(tmp_path: Path, second_lr: str = "3.0e-4", **more: str) -> Path:
    folder = tmp_path / "configs"
    folder.mkdir()
    write_cluster_yaml(folder, tmp_path)
    data = tmp_path / "d.jsonl"
    data.write_text('{"q": "x", "a": "y"}\n')
    (folder / "lr.yaml").write_text(SWEPT.format(data=data, second_lr=second_lr))
    for name, text in more.items():
        (folder / f"{name}.yaml").write_text(text.format(data=data))
    return folder


def test_a_sweep_of_two_rates_two_ranks_and_three_seeds_is_twelve_ordinary_experiments(tmp_path):
    folder = folder_of(tmp_path)
    profile, _ = load_profile(folder)
    loaded = load_experiments(folder, profile)
    assert len(loaded) == 12
    first = loaded[0]
    assert first.name == "lr-lr1e-04-r4-s1"
    assert (first.experiment.train.learning_rate, first.experiment.adapter.rank) == (1e-4, 4)
    assert first.experiment.train.seed == 1
    assert first.sweep.values == {"train.learning_rate": 1e-4, "adapter.rank": 4} and first.sweep.seed == 1
    points = {e.sweep.point for e in loaded}
    assert points == {"lr1e-04-r4", "lr1e-04-r8", "lr3e-04-r4", "lr3e-04-r8"}
    # The seed is a hyperparameter of the job: replicates are different configs, hence different hashes.
    assert len({(e.experiment.train.seed, e.sweep.point) for e in loaded}) == 12


def test_a_bad_swept_value_is_blamed_on_the_sweeps_line_and_names_the_point(tmp_path, capsys):
    folder = folder_of(tmp_path, second_lr="0.5")  # a learning rate that diverges: refused by validation
    assert launch.main(["--all", "--dry-run", "--config-dir", str(folder)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "lr.yaml:8: train.learning_rate:" in err  # line 8: the grid's learning_rate list
    assert "(sweep point lr-lr0.5-r4)" in err and "(sweep point lr-lr0.5-r8)" in err
    assert "lr1e-04" not in err  # the good points are not blamed


def test_a_malformed_sweep_is_refused_at_its_key_before_anything_is_planned(tmp_path, capsys):
    folder = folder_of(tmp_path)
    text = (folder / "lr.yaml").read_text().replace("seeds: [1, 2, 3]", "seeds: [1, 1]")
    (folder / "lr.yaml").write_text(text)
    assert launch.main(["--all", "--dry-run", "--config-dir", str(folder)]) == 2
    assert "lr.yaml:10: sweep.seeds:" in capsys.readouterr().err


def test_a_typo_in_a_sweeps_keys_is_shown_at_its_line_with_the_key_meant_like_any_blocks(tmp_path, capsys):
    folder = folder_of(tmp_path)
    text = (folder / "lr.yaml").read_text()
    text = text.replace("  grid:", "  gird:").replace("mode: min}", "mode: min, metrc: x}")
    (folder / "lr.yaml").write_text(text)
    assert launch.main(["--all", "--dry-run", "--config-dir", str(folder)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "lr.yaml:7: sweep.gird: unknown key (did you mean 'grid'?)" in err
    assert "lr.yaml:11: sweep.select.metrc: unknown key (did you mean 'metric'?)" in err


def test_a_bad_swept_key_is_shown_at_that_key_and_line_not_at_pydantics_key_marker(tmp_path, capsys):
    folder = folder_of(tmp_path)
    text = (folder / "lr.yaml").read_text().replace("    adapter.rank: [4, 8]", "    name: [a, b]")
    (folder / "lr.yaml").write_text(text)
    assert launch.main(["--all", "--dry-run", "--config-dir", str(folder)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "lr.yaml:9: sweep.grid.name: name cannot be swept" in err
    assert "[key]" not in err


def test_exp_names_a_whole_sweep_or_one_point_and_after_a_sweep_waits_for_every_point(tmp_path, capsys):
    folder = folder_of(tmp_path, **{"after-all": AFTER})
    assert launch.main(["--exp", "lr", "--dry-run", "--json", "--config-dir", str(folder)]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert len(plan["jobs"]) == 12 and {j["sweep"] for j in plan["jobs"]} == {"lr"}
    assert plan["sweeps"]["lr"]["points"] == 12
    assert launch.main(["--exp", "lr-lr1e-04-r8-s2", "--dry-run", "--json", "--config-dir", str(folder)]) == 0
    assert [j["id"] for j in json.loads(capsys.readouterr().out)["jobs"]] == ["lr-lr1e-04-r8-s2/train"]
    assert launch.main(["--all", "--dry-run", "--json", "--config-dir", str(folder)]) == 0
    waits = next(j for j in json.loads(capsys.readouterr().out)["jobs"] if j["id"] == "after-all/train")
    assert len(waits["depends_on"]) == 12  # every point's last job, not a dangling name


def test_a_dry_run_for_slurm_says_a_sweep_is_one_job_array_and_what_waits_on_it(tmp_path, capsys):
    folder = folder_of(tmp_path, **{"after-all": AFTER})
    argv = ["--all", "--dry-run", "--backend", "slurm", "--config-dir", str(folder)]
    assert launch.main(argv) == 0
    said = " ".join(capsys.readouterr().out.split())
    assert "On SLURM, 2 submission(s): job array lr/train-array: 12 points of sweep lr" in said
    assert "1 other job(s), one sbatch each" in said
    assert launch.main([*argv, "--json"]) == 0
    (array,) = json.loads(capsys.readouterr().out)["job_arrays"]
    assert len(array["tasks"]) == 12 and array["after_task_of"] is None and array["waits_on"] == []


def test_a_dry_run_shows_a_sweep_as_one_line_and_its_points_when_exp_names_it(tmp_path, capsys):
    """Hundreds of points at a glance (issue 50): `--all --dry-run` and `--status` showed a row per job, and
    the dry run a line per dependency edge (1,200 rows and 600 edge lines for 600 points). A sweep is one row
    now (its points, jobs by state, GPU-hours) and its edges one count; an edge to another experiment is
    counted under the sweep's name; `--exp SWEEP` lists every job and edge; the JSON keeps everything."""
    folder = folder_of(tmp_path, **{"after-all": AFTER})
    assert launch.main(["--all", "--dry-run", "--config-dir", str(folder)]) == 0
    shown = capsys.readouterr().out
    assert "sweep lr: 12 points" in shown and "12 PLANNED" in shown
    assert "lr-lr1e-04-r4-s1" not in shown.split("Makespan")[0]  # no point's own row in the table
    edges = shown.split("Dependency edges:")[1]
    assert "lr-lr1e-04-r4-s1/train" not in edges
    assert "sweep lr --afterany--> after-all/train (12 edge(s))" in edges
    assert "after-all/train" in shown.split("Makespan")[0]  # an experiment of its own keeps its row
    assert launch.main(["--exp", "lr", "--dry-run", "--config-dir", str(folder)]) == 0
    asked = capsys.readouterr().out
    assert "sweep lr:" not in asked.split("Makespan")[0]
    assert all(f"lr-lr1e-04-r{rank}-s{seed}/train" in asked for rank in (4, 8) for seed in (1, 2, 3))
    assert launch.main(["--all", "--dry-run", "--json", "--config-dir", str(folder)]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert len(plan["jobs"]) == 13 and len(plan["edges"]) == 12
    assert launch.main(["--status", "--config-dir", str(folder)]) == 0
    status = capsys.readouterr().out
    assert "sweep lr: 12 points" in status and "12 PLANNED" in status and "lr-lr1e-04" not in status
    assert launch.main(["--status", "--exp", "lr", "--config-dir", str(folder)]) == 0
    assert "lr-lr1e-04-r4-s1/train" in capsys.readouterr().out


DPO_SWEPT = """\
name: beta
model: {{name_or_path: org/model, kind: causal}}
data: {{train: {pairs}, format: preference}}
train:
  method: dpo
  dpo: {{beta: 0.1, loss_type: sigmoid, reference: base}}
eval: {{metrics: []}}
resources: {{mem_gb: 4, cpus: 1}}
sweep:
  grid:
    train.dpo.beta: [{betas}]
  seeds: [1, 2]
"""


def dpo_folder(tmp_path: Path, betas: str = "0.05, 0.1, 0.5") -> Path:
    folder = tmp_path / "configs"
    folder.mkdir()
    write_cluster_yaml(folder, tmp_path)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text('{"prompt": "x", "chosen": "y", "rejected": "z"}\n')
    (folder / "beta.yaml").write_text(DPO_SWEPT.format(pairs=pairs, betas=betas))
    return folder


def test_a_beta_sweep_of_a_dpo_stage_plans_a_job_per_point_with_that_beta_and_its_own_hash(tmp_path):
    """Issue 41: `train.dpo.beta` (a key inside the DPO block) is swept like any key. Caught: a point whose
    job lost the swept beta (the block's written 0.1) or its DPO settings, or two points sharing a hash (one
    run folder: the second would be taken for done)."""
    folder = dpo_folder(tmp_path)
    profile, _ = load_profile(folder)
    loaded = load_experiments(folder, profile)
    names = [e.name for e in loaded]
    assert names == [f"beta-beta{b}-s{s}" for b in ("0.05", "0.1", "0.5") for s in (1, 2)]
    for point in loaded:
        beta, seed = point.sweep.values["train.dpo.beta"], point.sweep.seed
        assert point.experiment.train.dpo.beta == beta and point.experiment.train.seed == seed
    jobs = [job for job in plan_for(folder=folder).jobs if job.kind == "train"]
    assert [job.experiment for job in jobs] == names
    for job, point in zip(jobs, loaded, strict=True):
        train = job.spec.train
        assert (train.method, train.preference.beta, train.seed) == (
            "dpo",
            point.sweep.values["train.dpo.beta"],
            point.sweep.seed,
        )
        assert (train.preference.loss_type, train.preference.reference) == ("sigmoid", "base")
        assert job.spec.data.format == "preference"
    assert len({job.config_hash for job in jobs}) == 6


def test_a_bad_beta_in_a_dpo_sweep_is_refused_at_the_grids_line_naming_only_its_point(tmp_path, capsys):
    """A beta of 0 (no preference signal: TRL would train on a constant loss) is refused by the DPO block's
    own validation, per point, at the sweep's line; the good points are not blamed."""
    folder = dpo_folder(tmp_path, betas="0.1, 0")
    assert launch.main(["--all", "--dry-run", "--config-dir", str(folder)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "beta.yaml:11: train.dpo.beta: Input should be greater than 0 (got 0)" in err
    assert "(sweep point beta-beta0)" in err and "beta0.1" not in err


CURRICULUM_SWEPT = """\
name: chain
model: {{name_or_path: org/model, kind: causal}}
data: {{train: {sft}}}
train:
  dpo: {{beta: 0.1, reference: previous}}
eval: {{metrics: []}}
resources: {{mem_gb: 4, cpus: 1}}
stages:
  - name: sft
    data: {{train: {sft}, input_field: q, target_field: a}}
  - name: dpo
    data: {{train: {pairs}, format: preference}}
    train: {{method: dpo}}
sweep:
  grid:
    train.dpo.beta: [{betas}]
"""


def curriculum_folder(tmp_path: Path, betas: str) -> Path:
    folder = dpo_folder(tmp_path)
    (folder / "beta.yaml").unlink()
    (tmp_path / "sft.jsonl").write_text('{"q": "x", "a": "y"}\n')
    text = CURRICULUM_SWEPT.format(sft=tmp_path / "sft.jsonl", pairs=tmp_path / "pairs.jsonl", betas=betas)
    (folder / "chain.yaml").write_text(text)
    return folder


def test_a_beta_sweep_reaches_the_dpo_stage_of_an_sft_then_dpo_curriculum_and_leaves_its_sft_stage_alone(
    tmp_path,
):
    """Before: with stages sft then dpo, `train.dpo.beta` (the experiment's, as a sweep's keys are) was
    inherited by the SFT stage and the whole experiment refused, with no line and advice that would have
    turned the SFT stage into DPO: a beta sweep could not reach a curriculum's DPO stage at all."""
    folder = curriculum_folder(tmp_path, "0.05, 0.5")
    jobs = [job for job in plan_for(folder=folder).jobs if job.kind == "train"]
    by_stage = {(job.experiment, job.stage): job.spec.train for job in jobs}
    for beta in (0.05, 0.5):
        sft, dpo = by_stage[(f"chain-beta{beta}", "sft")], by_stage[(f"chain-beta{beta}", "dpo")]
        assert (sft.method, sft.dpo) == ("sft", None)
        assert (dpo.method, dpo.preference.beta, dpo.preference.reference) == ("dpo", beta, "previous")


def test_a_bad_beta_swept_over_a_curriculum_is_refused_once_at_the_grids_line(tmp_path, capsys):
    folder = curriculum_folder(tmp_path, "0.1, 0")
    assert launch.main(["--all", "--dry-run", "--config-dir", str(folder)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert err.count("train.dpo.beta: Input should be greater than 0 (got 0)") == 1, err
    assert "chain.yaml:16: train.dpo.beta" in err and "(sweep point chain-beta0)" in err


def test_train_dpo_on_an_experiment_with_no_dpo_stage_is_still_refused(tmp_path, capsys):
    folder = curriculum_folder(tmp_path, "0.1")
    text = (folder / "chain.yaml").read_text().replace("    train: {method: dpo}\n", "")
    (folder / "chain.yaml").write_text(
        text.replace("format: preference", "input_field: prompt, target_field: chosen")
    )
    assert launch.main(["--all", "--dry-run", "--config-dir", str(folder)]) == 2
    assert "is the preference objective's block" in " ".join(capsys.readouterr().err.split())


def test_a_dpo_sweep_may_select_on_the_preference_scores_its_eval_writes(tmp_path, capsys):
    """Before: `select: {metric: preference_accuracy}` was refused as "not a score this sweep's eval computes",
    though the eval of a DPO stage's pairs writes it; a sweep could not pick its best beta by it. An SFT
    sweep still cannot (its eval writes none)."""
    folder = dpo_folder(tmp_path)
    text = (folder / "beta.yaml").read_text()
    selecting = text + "  select: {metric: preference_accuracy, mode: max}\n"
    (folder / "beta.yaml").write_text(selecting)
    assert launch.main(["--all", "--dry-run", "--config-dir", str(folder)]) == 0
    capsys.readouterr()
    sft = selecting.replace("  method: dpo\n", "").replace(
        "  dpo: {beta: 0.1, loss_type: sigmoid, reference: base}\n", ""
    )
    sft = sft.replace("train.dpo.beta", "train.learning_rate").replace(
        "format: preference", "input_field: prompt, target_field: chosen"
    )
    (folder / "beta.yaml").write_text(sft.replace("[0.05, 0.1, 0.5]", "[1.0e-4, 2.0e-4]"))
    assert launch.main(["--all", "--dry-run", "--config-dir", str(folder)]) == 2
    assert "'preference_accuracy' is not a score this sweep's eval computes" in " ".join(
        capsys.readouterr().err.split()
    )


def test_a_sweeps_name_taken_by_another_experiment_is_refused(tmp_path, capsys):
    # Before: --exp lr and after: [lr] meant the experiment and every point of the sweep at once.
    folder = folder_of(
        tmp_path, plain=AFTER.replace("name: after-all", "name: lr").replace("after: [lr]\n", "")
    )
    assert launch.main(["--all", "--dry-run", "--config-dir", str(folder)]) == 2
    assert "plain.yaml: name: 'lr' is also a sweep's name" in " ".join(capsys.readouterr().err.split())


def test_export_of_a_sweep_exports_each_of_its_points_not_a_missing_experiment(tmp_path):
    # Before: --export lr (a sweep) looked for an experiment named lr: an IndexError traceback.
    from slurm.commands.export import export_targets
    from slurm.planning.plan import build_plan, with_exports

    folder = folder_of(tmp_path)
    profile, _ = load_profile(folder)
    loaded = load_experiments(folder, profile, None, ["lr"])
    targets = export_targets([("lr", None)], loaded)
    assert len(targets) == 12 and targets[0] == ("lr-lr1e-04-r4-s1", None)
    plan = with_exports(build_plan(loaded, profile), targets, gguf=False)
    assert sum(j.kind == "export" for j in plan.jobs) == 12


# Issue 31, rule 5: one configuration trains once; names are stable.
TEMPLATES = (
    SWEPT.split("sweep:")[0].replace("name: lr", "name: tpl")
    + """\
sweep:
  grid:
    data.prompt_template: ["Q: {{q}} ->", "{{q}} | SQL:"]
"""
)


def test_a_point_launched_under_its_old_name_keeps_it_and_a_new_point_gets_a_stable_one(tmp_path):
    from core.rundir import record_origin

    folder = folder_of(tmp_path, tpl=TEMPLATES)
    profile, _ = load_profile(folder)
    fresh = {e.sweep.point: e.name for e in load_experiments(folder, profile) if e.name.startswith("tpl-")}
    assert all(len(name.rsplit("_", 1)[1]) == 4 for name in fresh.values())  # the template's own hash
    # A run root from before stable names: the first point ran as tpl-prompt_templateQ___q____ (the old slug).
    old = "tpl-prompt_templateQ___q____"
    record_origin(tmp_path / "runs" / old, folder / "tpl.yaml", folder)
    again = {e.sweep.point: e.name for e in load_experiments(folder, profile) if e.name.startswith("tpl-")}
    first, second = list(fresh)
    assert again[first] == old and again[second] == fresh[second]


def test_two_files_defining_one_sweep_name_are_refused(tmp_path, capsys):
    # Before: both files' points were planned as one sweep: --exp lr and the report mixed them.
    other = SWEPT.replace("train.learning_rate: [1.0e-4, {second_lr}]", "train.learning_rate: [5.0e-4]")
    folder = folder_of(tmp_path, twin=other.replace("{second_lr}", "1"))
    assert launch.main(["--all", "--dry-run", "--config-dir", str(folder)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "twin.yaml: name: the sweep 'lr' is also defined in" in err and "lr.yaml" in err


def test_a_sweep_named_as_an_experiment_of_another_folder_in_the_run_root_is_refused(tmp_path, capsys):
    from core.rundir import record_origin

    folder = folder_of(tmp_path)
    elsewhere = tmp_path / "other-configs"
    elsewhere.mkdir()
    (elsewhere / "lr.yaml").write_text("name: lr\n")
    record_origin(tmp_path / "runs" / "lr", elsewhere / "lr.yaml", elsewhere)
    assert launch.main(["--all", "--dry-run", "--config-dir", str(folder)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "lr.yaml: name: the sweep 'lr' has the name of an experiment" in err and "other-configs" in err


# Issue 33: sweep.prune, checked with the experiment it prunes.
PRUNED = """\
name: pr
model: {{name_or_path: org/model, kind: causal}}
data: {{train: {data}, eval: {data}, input_field: q, target_field: a}}
train: {{epochs: 3, eval_every_epochs: 1}}
eval: {{metrics: []}}
resources: {{mem_gb: 4, cpus: 1}}
sweep:
  grid:
    train.learning_rate: [1.0e-4, 3.0e-4]
  prune:
    rungs: [1, 2]
    keep: 0.5
"""


def pruned_folder(tmp_path: Path, text: str) -> Path:
    folder = folder_of(tmp_path)
    (folder / "lr.yaml").unlink()
    (folder / "pr.yaml").write_text(text.format(data=tmp_path / "d.jsonl"))
    return folder


def test_a_pruned_sweeps_points_carry_the_block_and_their_sweep_into_their_training_job(tmp_path, capsys):
    folder = pruned_folder(tmp_path, PRUNED)
    assert launch.main(["--all", "--dry-run", "--json", "--config-dir", str(folder)]) == 0
    jobs = json.loads(capsys.readouterr().out)["jobs"]
    prune = {j["id"]: j["spec"].get("prune") for j in jobs if j["kind"] == "train"}
    assert len(prune) == 2
    expected = {"rungs": [1.0, 2.0], "keep": 0.5, "min_points": 3, "eval_pruned": True, "sweep": "pr"}
    planned = {"measured_under", "runs"}  # what the plan adds: the sweep's definition and size (issue 38)
    assert all({k: v for k, v in block.items() if k not in planned} == expected for block in prune.values())
    assert all(block["runs"] == 2 for block in prune.values())


def measured_under(folder: Path, capsys) -> set[str]:
    assert launch.main(["--all", "--dry-run", "--json", "--config-dir", str(folder)]) == 0
    jobs = json.loads(capsys.readouterr().out)["jobs"]
    return {j["spec"]["prune"]["measured_under"] for j in jobs if j["kind"] == "train"}


def test_rung_records_of_an_edited_sweep_are_told_apart_and_an_added_point_keeps_the_old_ones(
    tmp_path, capsys
):
    # Issue 38: an edited sweep (another eval set) was judged by the old one's rung records. Its points
    # share one definition; editing what they share changes it; adding a point to the grid does not.
    folder = pruned_folder(tmp_path, PRUNED)
    (first,) = measured_under(folder, capsys)
    other = tmp_path / "other.jsonl"
    other.write_text('{"q": "z", "a": "w"}\n')
    text = PRUNED.replace("eval: {data}, input", f"eval: {other}, input")
    (folder / "pr.yaml").write_text(text.format(data=tmp_path / "d.jsonl"))
    (edited,) = measured_under(folder, capsys)
    (folder / "pr.yaml").write_text(
        PRUNED.replace("3.0e-4]", "3.0e-4, 1.0e-3]").format(data=tmp_path / "d.jsonl")
    )
    (grown,) = measured_under(folder, capsys)
    assert edited != first and grown == first


def test_force_archives_a_pruned_points_rung_records_with_its_run_folder(tmp_path):
    from core.config import PruneJob
    from core.pruning import judged, rung_records
    from core.rundir import mark_done
    from slurm.queueing.decisions import archive_stale

    folder = pruned_folder(tmp_path, PRUNED)
    plan = plan_for(folder=folder)
    job = next(j for j in plan.jobs if j.kind == "train")
    run_root, run_dir = Path(plan.run_root), Path(job.run_dir)
    mark_done(run_dir, "0" * 16)  # finished under another config: --force archives it
    prune = PruneJob(rungs=[1], keep=0.5, sweep="pr", measured_under="m")
    for run in ("pr-other", job.experiment):
        judged(run_root, "pr", run, "h", 1, 1.0, prune)
    assert archive_stale(job) is not None
    assert [r.run for r in rung_records(run_root, "pr", 1)] == ["pr-other"]


def test_a_prune_block_without_eval_data_or_evals_is_refused_at_its_line(tmp_path, capsys):
    text = PRUNED.replace(" eval: {data},", "").replace("eval_every_epochs: 1", "eval_every_epochs: null")
    folder = pruned_folder(tmp_path, text)
    assert launch.main(["--all", "--dry-run", "--config-dir", str(folder)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "pr.yaml:10: sweep.prune: needs data.eval" in err
    assert "pr.yaml:10: sweep.prune: needs train.eval_every_epochs" in err


def test_rungs_off_the_eval_epochs_or_not_below_the_last_epoch_are_refused_at_the_rungs_line(
    tmp_path, capsys
):
    text = PRUNED.replace("eval_every_epochs: 1", "eval_every_epochs: 0.5").replace("[1, 2]", "[0.75, 3]")
    folder = pruned_folder(tmp_path, text)
    assert launch.main(["--all", "--dry-run", "--config-dir", str(folder)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "pr.yaml:11: sweep.prune.rungs: rung 0.75 is not a multiple of train.eval_every_epochs 0.5" in err
    assert "pr.yaml:11: sweep.prune.rungs: rung 3 is not below train.epochs 3" in err


def test_a_keep_outside_zero_and_one_and_falling_rungs_are_refused_at_their_keys(tmp_path, capsys):
    folder = pruned_folder(tmp_path, PRUNED.replace("keep: 0.5", "keep: 1.0").replace("[1, 2]", "[2, 1]"))
    assert launch.main(["--all", "--dry-run", "--config-dir", str(folder)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "pr.yaml:11: sweep.prune.rungs: must rise strictly" in err
    assert "pr.yaml:12: sweep.prune.keep:" in err and "less than 1" in err


def test_a_multi_stage_pruned_sweep_is_refused_with_the_reason(tmp_path, capsys):
    text = PRUNED.replace("sweep:", "stages: [{{name: one}}, {{name: two}}]\nsweep:")
    folder = pruned_folder(tmp_path, text)
    assert launch.main(["--all", "--dry-run", "--config-dir", str(folder)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "sweep.prune: prunes single-stage sweeps only for now; this one has stages one, two" in err


def test_flipping_eval_pruned_leaves_every_training_stage_unchanged(tmp_path, capsys):
    # Issue 38: prune.eval_pruned decides only whether a pruned run's eval runs; flipping it made every
    # finished training stage of the sweep a changed config (refused, or rerun with --force).
    folder = pruned_folder(tmp_path, PRUNED)

    def train_hashes() -> dict[str, str]:
        assert launch.main(["--all", "--dry-run", "--json", "--config-dir", str(folder)]) == 0
        jobs = json.loads(capsys.readouterr().out)["jobs"]
        return {j["id"]: j["config_hash"] for j in jobs if j["kind"] == "train"}

    before = train_hashes()
    text = PRUNED.replace("keep: 0.5", "keep: 0.5\n    eval_pruned: false")
    (folder / "pr.yaml").write_text(text.format(data=tmp_path / "d.jsonl"))
    assert train_hashes() == before and len(before) == 2


def test_a_folded_sweeps_own_edges_are_one_counted_line(tmp_path, capsys):
    """Each point's eval waits on its training: 4 points, 4 afterok edges inside the sweep, said in one line
    that names how to list them, none per point."""
    folder = tmp_path / "configs"
    folder.mkdir()
    write_cluster_yaml(folder, tmp_path)
    data = tmp_path / "d.jsonl"
    data.write_text('{"q": "x", "a": "y"}\n')
    swept = SWEPT.format(data=data, second_lr="3.0e-4").replace("  seeds: [1, 2, 3]\n", "")
    swept = swept.replace("eval: {metrics: []}", "eval: {metrics: [exact_match]}")
    swept = swept.replace(f"data: {{train: {data},", f"data: {{train: {data}, eval: {data},")
    (folder / "lr.yaml").write_text(swept)
    assert launch.main(["--all", "--dry-run", "--config-dir", str(folder)]) == 0
    edges = capsys.readouterr().out.split("Dependency edges:")[1]
    assert "sweep lr: 4 afterok edge(s) between its points' own jobs (--exp lr lists them)" in edges
    assert "/train --afterok-->" not in edges
