"""Every mistake is reported with its file, line or key and a hint, exit code 2, and nothing is queued.

These run the real CLI against the real dev cluster: "nothing queued" is checked with squeue itself.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

import launch
from tests.conftest import squeue_ids, write_cluster_yaml

GOOD = """\
name: {name}
inherits: base.yaml
model: {{name_or_path: org/some-model, kind: causal}}
data: {{train: {data}, eval: {data}, input_field: question, target_field: sql}}
train: {{epochs: 1, learning_rate: 2.0e-4}}
eval: {{metrics: [exact_match]}}
resources: {{gpus: 1, cpus: 1, mem_gb: 1, time: "00:05:00"}}
"""


@pytest.fixture
def config_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "configs"
    folder.mkdir()
    write_cluster_yaml(folder, tmp_path)
    (folder / "base.yaml").write_text("adapter: {rank: 8, alpha: 16}\n")
    data = tmp_path / "train.jsonl"
    data.write_text('{"question": "q", "sql": "SELECT 1"}\n')
    (folder / "a.yaml").write_text(GOOD.format(name="a", data=data))
    (folder / "b.yaml").write_text(GOOD.format(name="b", data=data))
    return folder


def run_cli(config_dir: Path, capsys, *extra: str) -> tuple[int, str]:
    code = launch.main(["--all", "--config-dir", str(config_dir), "--backend", "slurm", *extra])
    return code, capsys.readouterr().err


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"test setup: {old!r} not in {path}"
    path.write_text(text.replace(old, new))


# (file to change, old text, new text, what the message must name)
CASES = {
    "yaml syntax": ("a.yaml", "train: {epochs", "train: {{epochs", ["a.yaml:5", "not valid YAML"]),
    "unknown key": (
        "a.yaml",
        "learning_rate:",
        "learnig_rate:",
        ["a.yaml:5", "train.learnig_rate", "learning_rate"],
    ),
    "misspelt section": (
        "a.yaml",
        "resources:",
        "resorces:",
        ["a.yaml:7", "resorces", "did you mean 'resources'"],
    ),
    "wrong type": ("a.yaml", "epochs: 1,", "epochs: many,", ["a.yaml:5", "train.epochs", "many"]),
    "missing required": ("a.yaml", "kind: causal", "revision: main", ["a.yaml:3", "model.kind", "required"]),
    "zero epochs": ("a.yaml", "epochs: 1,", "epochs: 0,", ["a.yaml:5", "train.epochs", "greater than 0"]),
    "zero patience": (
        "a.yaml",
        "learning_rate: 2.0e-4}",
        "learning_rate: 2.0e-4, early_stopping: {patience: 0}}",
        ["a.yaml:5", "train.early_stopping.patience", "greater than or equal to 1"],
    ),
    "lora learning rate": (
        "a.yaml",
        "2.0e-4",
        "0.1",
        ["a.yaml:5", "train.learning_rate", "too high for LoRA"],
    ),
    "warmup ratio": (
        "a.yaml",
        "learning_rate: 2.0e-4}",
        "learning_rate: 2.0e-4, warmup_ratio: 0.9}",
        ["train.warmup_ratio", "less than or equal to 0.5"],
    ),
    "missing data file": (
        "a.yaml",
        "train.jsonl",
        "nope.jsonl",
        ["a.yaml:4", "data.train", "file not found"],
    ),
    "unknown after": (
        "a.yaml",
        "name: a\n",
        "name: a\nafter: [bb]\n",
        ["a.yaml", "after", "'bb'", "did you mean 'b'"],
    ),
    "duplicate names": ("b.yaml", "name: b", "name: a", ["b.yaml", "name", "also the name in"]),
    "too many gpus": (
        "a.yaml",
        "gpus: 1",
        "gpus: 9",
        ["a.yaml:7", "resources.gpus", "node of this cluster has 4"],
    ),
    "eval on several nodes": (
        "a.yaml",
        "[exact_match]}",
        "[exact_match], resources: {nodes: 2}}",
        ["a.yaml:6", "eval.resources.nodes", "one process on one GPU of one node"],
    ),
    "eval on several gpus": (
        "a.yaml",
        "[exact_match]}",
        "[exact_match], resources: {gpus: 2}}",
        ["a.yaml:6", "eval.resources.gpus", "one process on one GPU", "use 0 or 1"],
    ),
    "full modules": (
        "base.yaml",
        "alpha: 16}",
        "alpha: 16, modules_to_save: [embed_tokens, lm_head]}",
        ["base.yaml:1", "adapter", "modules_to_save", "allow_full_modules"],
    ),
    "bad time": ("a.yaml", '"00:05:00"', '"5 minutes"', ["a.yaml:7", "resources.time", "HH:MM:SS"]),
    "unsafe name": ("a.yaml", "name: a", "name: ../x", ["a.yaml:1", "name", "not a safe name"]),
    "sql without db": ("a.yaml", "[exact_match]", "[sql_exec]", ["a.yaml:6", "eval", "eval.db"]),
    "secret in setup": (
        "cluster.yaml",
        "max_gpus_per_node: 4\n",
        "max_gpus_per_node: 4\nsetup:\n  - module load cuda\n  - export HF_TOKEN=hf_NotARealTokenButLong\n",
        ["cluster.yaml:6", "setup.1", "HF_TOKEN", "export HF_TOKEN in your shell"],
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_mistake_is_named_and_nothing_is_queued(case, config_dir, capsys, slurm_cluster):
    file, old, new, expected = CASES[case]
    edit(config_dir / file, old, new)
    before = squeue_ids(config_dir.parent)
    code, err = run_cli(config_dir, capsys)
    assert code == 2
    assert "Traceback" not in err
    for fragment in expected:
        assert fragment in err, f"{fragment!r} missing from:\n{err}"
    assert "nothing was submitted" in err
    assert squeue_ids(config_dir.parent) == before
    assert not (config_dir.parent / "runs").exists()


def test_secret_in_setup_is_not_repeated_in_the_error(config_dir, capsys):
    edit(
        config_dir / "cluster.yaml",
        "max_gpus_per_node: 4\n",
        "max_gpus_per_node: 4\nsetup: [WANDB_API_KEY='wb-0123456789']\n",
    )
    code, err = run_cli(config_dir, capsys, "--dry-run")
    assert code == 2 and "WANDB_API_KEY" in err
    assert "wb-0123456789" not in err


def test_cycle_in_after_is_shown_as_a_path(config_dir, capsys, slurm_cluster):
    edit(config_dir / "a.yaml", "name: a\n", "name: a\nafter: [b]\n")
    edit(config_dir / "b.yaml", "name: b\n", "name: b\nafter: [a]\n")
    code, err = run_cli(config_dir, capsys)
    assert code == 2
    assert "a -> b -> a" in err


def test_every_problem_in_every_file_is_reported_at_once(config_dir, capsys, slurm_cluster):
    edit(config_dir / "a.yaml", "epochs: 1,", "epochs: 0,")
    edit(config_dir / "b.yaml", "learning_rate: 2.0e-4", "learning_rate: 0.5")
    code, err = run_cli(config_dir, capsys)
    assert code == 2
    assert "a.yaml:5: train.epochs" in err and "b.yaml:5: train.learning_rate" in err
    assert "2 problem(s)" in err


def test_stage_override_errors_point_into_the_stage(config_dir, capsys, slurm_cluster):
    stages = textwrap.dedent(
        """\
        stages:
          - name: one
          - name: two
            train: {epochs: 0}
        """
    )
    (config_dir / "a.yaml").write_text((config_dir / "a.yaml").read_text() + stages)
    code, err = run_cli(config_dir, capsys)
    assert code == 2
    assert "a.yaml:11: stages.1.train.epochs" in err


def test_inherited_values_and_overrides_resolve(config_dir, capsys):
    code = launch.main(
        ["--exp", "a", "--config-dir", str(config_dir), "--dry-run", "--json", "train.epochs=4"]
    )
    out = capsys.readouterr().out
    assert code == 0
    import json

    plan = json.loads(out)
    train_job = next(j for j in plan["jobs"] if j["id"] == "a/train")
    assert train_job["spec"]["adapter"]["rank"] == 8  # from base.yaml
    assert train_job["spec"]["train"]["epochs"] == 4  # from the command line
    assert [j["id"] for j in plan["jobs"]] == ["a/train", "a/eval"]


def test_bad_override_is_a_clear_error(config_dir, capsys):
    code = launch.main(["--all", "--config-dir", str(config_dir), "--dry-run", "train.epochs"])
    assert code == 2
    assert "KEY.PATH=VALUE" in capsys.readouterr().err


# Values written into the job script's #SBATCH lines: a newline in one would start a line of shell there.
BLOCK_RESOURCES = """\
resources:
  gpus: 1
  cpus: 1
  mem_gb: 1
  time: "00:05:00"
  constraint: |
    a100
    #SBATCH --wrap=touch /tmp/injected
"""
INJECTIONS = {
    "partition with an escaped newline": (
        "a.yaml",
        'time: "00:05:00"}',
        'time: "00:05:00", partition: "gpu\\n#SBATCH --wrap=touch /tmp/injected"}',
        ["a.yaml:7", "resources.partition", "not a SLURM name", "#SBATCH lines"],
    ),
    "constraint in a block scalar": (
        "a.yaml",
        'resources: {gpus: 1, cpus: 1, mem_gb: 1, time: "00:05:00"}\n',
        BLOCK_RESOURCES,
        ["a.yaml:12", "resources.constraint", "not a SLURM feature expression"],
    ),
    "eval qos with a semicolon": (
        "a.yaml",
        "eval: {metrics: [exact_match]}",
        'eval: {metrics: [exact_match], resources: {qos: "normal;touch /tmp/injected"}}',
        ["a.yaml:6", "eval.resources.qos", "not a SLURM name"],
    ),
    "cluster account with a newline": (
        "cluster.yaml",
        "max_gpus_per_node: 4\n",
        'max_gpus_per_node: 4\naccount: "lab\\ntouch /tmp/injected"\n',
        ["cluster.yaml:4", "account", "not a SLURM name"],
    ),
    "cluster log_dir in a block scalar": (
        "cluster.yaml",
        "log_dir: ",
        "log_dir: |\n  logs\n  #SBATCH --wrap=touch /tmp/injected\n# was: ",
        ["cluster.yaml:2", "log_dir", "control character"],
    ),
    "cluster mail_user with a newline": (
        "cluster.yaml",
        "max_gpus_per_node: 4\n",
        'max_gpus_per_node: 4\nmail_user: "ada@uni.example\ntouch /tmp/injected"\n',
        ["cluster.yaml:4", "mail_user", "not one plain mail address"],
    ),
    "mail type sbatch does not know": (
        "a.yaml",
        'time: "00:05:00"}',
        'time: "00:05:00", mail: [END, DONE]}',
        ["a.yaml:7", "resources.mail", "END", "FAIL"],
    ),
    "name with a trailing newline": (
        "a.yaml",
        "name: a\n",
        'name: "a\\n"\n',
        ["a.yaml:1", "name", "not a safe name"],
    ),
}


@pytest.mark.parametrize("case", sorted(INJECTIONS))
def test_values_that_reach_sbatch_lines_are_checked(case, config_dir, capsys, slurm_cluster):
    file, old, new, expected = INJECTIONS[case]
    edit(config_dir / file, old, new)
    before = squeue_ids(config_dir.parent)
    code, err = run_cli(config_dir, capsys)
    assert code == 2, err
    assert "Traceback" not in err
    for fragment in expected:
        assert fragment in err, f"{fragment!r} missing from:\n{err}"
    assert squeue_ids(config_dir.parent) == before


def test_slurm_name_lists_and_feature_expressions_are_accepted(config_dir, capsys):
    edit(
        config_dir / "a.yaml",
        'time: "00:05:00"}',
        'time: "00:05:00", partition: "gpu,debug", qos: high-prio.v2, constraint: "[rack1|rack2]&a100*2"}',
    )
    code = launch.main(["--exp", "a", "--config-dir", str(config_dir), "--dry-run", "--json"])
    assert code == 0
    import json

    resources = json.loads(capsys.readouterr().out)["jobs"][0]["resources"]
    assert (resources["partition"], resources["qos"]) == ("gpu,debug", "high-prio.v2")
    assert resources["constraint"] == "[rack1|rack2]&a100*2"


def test_override_mistakes_are_reported_from_the_command_line(config_dir, capsys):
    argv = ["--all", "--config-dir", str(config_dir), "--dry-run", "train.learning_rate=0.5", "train.epoch=2"]
    code = launch.main(argv)
    err = capsys.readouterr().err
    assert code == 2
    assert "command line: train.learning_rate: 0.5 is far too high for LoRA" in err
    assert "command line: train.epoch: unknown key (did you mean 'epochs'?)" in err
    assert "a.yaml" not in err and "b.yaml" not in err  # a.yaml:5 writes learning_rate, but is not at fault
    assert err.count("error:") == 2  # said once, not once per experiment file


def test_a_yaml_mistake_is_still_the_yamls_when_overrides_are_given(config_dir, capsys):
    edit(config_dir / "a.yaml", "epochs: 1,", "epochs: 0,")
    code = launch.main(["--all", "--config-dir", str(config_dir), "--dry-run", "train.seed=3"])
    err = capsys.readouterr().err
    assert code == 2
    assert "a.yaml:5: train.epochs" in err and "command line" not in err


def without_eval_data(config_dir: Path, evaluation: str, stages: str = "") -> None:
    """a.yaml with data.train only (its data: line is line 4), the given eval section, and stages."""
    data = config_dir.parent / "train.jsonl"
    text = GOOD.format(name="a", data=data).replace(f"eval: {data}, ", "")
    text = text.replace("eval: {metrics: [exact_match]}", f"eval: {evaluation}")
    (config_dir / "a.yaml").write_text(text + stages)


def test_scoring_without_eval_data_is_refused(config_dir, capsys, slurm_cluster):
    # Today's eval job would score on the training data and report it as eval scores.
    without_eval_data(config_dir, "{metrics: [exact_match]}")
    before = squeue_ids(config_dir.parent)
    code, err = run_cli(config_dir, capsys)
    assert code == 2, err
    assert "a.yaml:4: data.eval: the eval job scores stage(s) ['train'], which have no data.eval" in err
    assert "add data.eval, or set `eval.split: train`" in err
    assert "b.yaml" not in err and err.count("error:") == 1
    assert squeue_ids(config_dir.parent) == before


def test_each_evaluated_stage_needs_eval_data(config_dir, capsys):
    # Stage one has eval data of its own; stage two, the one the eval job scores, has none.
    data = config_dir.parent / "train.jsonl"
    stages = f"stages:\n  - name: one\n    data: {{eval: {data}}}\n  - name: two\n"
    without_eval_data(config_dir, "{metrics: [exact_match]}", stages)
    code, err = run_cli(config_dir, capsys, "--dry-run")
    assert code == 2 and "stage(s) ['two']" in err, err
    without_eval_data(config_dir, "{metrics: [exact_match], after_each_stage: true}", stages)
    code, err = run_cli(config_dir, capsys, "--dry-run")
    assert code == 2 and "stage(s) ['two']" in err, err
    stages = f"stages:\n  - name: one\n  - name: two\n    data: {{eval: {data}}}\n"
    without_eval_data(config_dir, "{metrics: [exact_match], after_each_stage: true}", stages)
    code, err = run_cli(config_dir, capsys, "--dry-run")
    assert code == 2 and "stage(s) ['one']" in err, err


@pytest.mark.parametrize("evaluation", ["{metrics: [exact_match], split: train}", "{metrics: []}"])
def test_training_data_is_scored_only_when_asked(evaluation, config_dir, capsys):
    without_eval_data(config_dir, evaluation)
    code, err = run_cli(config_dir, capsys, "--dry-run")
    assert code == 0, err


def test_the_split_is_checked(config_dir, capsys):
    edit(
        config_dir / "a.yaml", "eval: {metrics: [exact_match]}", "eval: {metrics: [exact_match], split: dev}"
    )
    code, err = run_cli(config_dir, capsys, "--dry-run")
    assert code == 2 and "a.yaml:6: eval.split" in err and "'eval' or 'train'" in err, err


def test_an_eval_job_run_by_hand_scores_the_split_it_names(tmp_path):
    from pydantic import ValidationError

    from core.config import EvalJob

    job = {
        "experiment": "a",
        "stage": "train",
        "model": {"name_or_path": "org/m", "kind": "causal"},
        "adapter": {},
        "data": {"train": "train.jsonl"},
        "eval": {"metrics": ["exact_match"]},
        "adapter_dir": "adapter",
        "out_dir": "eval",
    }
    # Today this job scores train.jsonl and calls it eval.
    with pytest.raises(ValidationError, match="data.eval is not set; add it, or set eval.split: train"):
        EvalJob.model_validate(job)
    assert EvalJob.model_validate(job | {"eval": {"split": "train"}}).source == "train.jsonl"
    held_out = job | {"data": {"train": "train.jsonl", "eval": "dev.jsonl"}}
    assert EvalJob.model_validate(held_out).source == "dev.jsonl"


def test_the_default_split_leaves_the_eval_hash_alone():
    from core.config import EvalSpec

    # An eval that finished before `split` existed keeps its hash (it hashes the dumped spec): not rerun.
    assert "split" not in EvalSpec().model_dump()
    assert EvalSpec(split="train").model_dump()["split"] == "train"  # scoring on train is a new config


def test_bertscore_needs_its_model_named_with_file_and_line(config_dir, capsys):
    edit(config_dir / "a.yaml", "[exact_match]}", "[bertscore]}")
    code, err = run_cli(config_dir, capsys, "--dry-run")
    assert code == 2 and "a.yaml:6: eval: metric bertscore needs eval.bertscore_model" in err
    assert "roberta-large" in err  # the hint names a model that works
    edit(config_dir / "a.yaml", "[bertscore]}", "[bertscore], bertscore_model: ./no-such-bert}")
    code, err = run_cli(config_dir, capsys, "--dry-run")
    assert code == 2 and "a.yaml:6: eval.bertscore_model: local model folder not found: ./no-such-bert" in err


# An experiment's folders are RUN_ROOT/NAME and LOG_DIR/NAME: named like a file of the run root, its folder
# took that file's place, and every training stage of the run root failed at its very end (speeds.jsonl).
@pytest.mark.parametrize(
    "name",
    [
        "speeds.jsonl",
        "preflight-tokens.json",
        "report.md",
        "report.csv",
        "loss_curves.png",
        "packs",
        "arrays",
        "Report.md",
    ],
)
def test_an_experiment_named_like_a_file_of_the_run_root_is_refused_at_its_line(name, config_dir, capsys):
    edit(config_dir / "a.yaml", "name: a\n", f"name: {name}\n")
    code, err = run_cli(config_dir, capsys, "--dry-run")
    assert code == 2, err
    assert f"a.yaml:1: name: '{name}' is taken by " in err and "give the experiment another name" in err
    assert err.count("error:") == 1, err


# A stage's folders are RUN_ROOT/EXP/STAGE and LOG_DIR/EXP/STAGE, beside the eval jobs' (eval, eval-STAGE),
# --calibrate's (STAGE-calibrate), the archives (STAGE.old-DATE), the export and the report's plot.
TAKEN_STAGE_NAMES = {
    "eval": "the eval job's folder",
    "Eval": "the eval job's folder",
    "eval-one": "the eval after a stage 'one'",  # was: the plan's eval of stage one silently dropped
    "one-calibrate": "a --calibrate run of a stage 'one'",
    "one.old-20261125-120000": "the archives of run folders",
    "export": "the export job's folder",
    "loss.png": "the report's loss plot",
}


@pytest.mark.parametrize("name", sorted(TAKEN_STAGE_NAMES))
def test_a_stage_named_like_a_folder_the_pipeline_makes_is_refused_at_its_line(name, config_dir, capsys):
    evaluation = "eval: {metrics: [exact_match], after_each_stage: true}"
    edit(config_dir / "a.yaml", "eval: {metrics: [exact_match]}", evaluation)
    stages = f"stages:\n  - name: one\n  - name: {name}\n"  # lines 8 to 10
    (config_dir / "a.yaml").write_text((config_dir / "a.yaml").read_text() + stages)
    code, err = run_cli(config_dir, capsys, "--dry-run")
    assert code == 2, err
    assert f"a.yaml:10: stages.1.name: '{name}' is taken by " in err, err
    assert TAKEN_STAGE_NAMES[name] in err and "give the stage another name" in err
    assert err.count("error:") == 1, err


def test_names_that_only_resemble_the_layouts_are_accepted(config_dir, capsys):
    edit(config_dir / "a.yaml", "name: a\n", "name: speeds\n")
    stages = "stages:\n  - name: evaluate\n  - name: calibrate\n  - name: old\n  - name: report.md\n"
    (config_dir / "a.yaml").write_text((config_dir / "a.yaml").read_text() + stages)
    code, err = run_cli(config_dir, capsys, "--dry-run")
    assert code == 0, err


# ---- data and cluster values sbatch or preflight would choke on (issue 23, defect 9) ----------------------
def write_data(config_dir: Path, lines: list[bytes], name: str = "train.jsonl") -> Path:
    """The data file both experiments train and evaluate on, rewritten line by line."""
    data = config_dir.parent / name
    data.write_bytes(b"".join(line + b"\n" for line in lines))
    return data


def test_an_example_over_a_megabyte_is_refused_at_its_line_before_preflight_reads_it(config_dir, capsys):
    huge = b'{"question": "' + b"q" * 1_500_000 + b'", "sql": "SELECT 1"}'
    data = write_data(config_dir, [b'{"question": "q", "sql": "SELECT 1"}', huge])
    code, err = run_cli(config_dir, capsys, "--dry-run")
    assert code == 2, err
    assert f"{data}:2: this line is longer than 1,000,000 bytes" in err, err
    assert err.count("error:") == 1 and "Traceback" not in err, err


def test_a_csv_example_over_a_megabyte_is_refused_and_one_under_it_over_csvs_own_limit_accepted(
    config_dir, capsys
):
    for name in ("a", "b"):  # csv's own field limit, 128 KB, raised csv.Error: a traceback
        edit(config_dir / f"{name}.yaml", "train.jsonl", "train.csv")
    write_data(config_dir, [b"question,sql", b"q," + b"S" * 300_000], "train.csv")
    code, err = run_cli(config_dir, capsys, "--dry-run")
    assert code == 0, err
    data = write_data(
        config_dir, [b"question,sql", b"q,SELECT 1", b'q,"' + b"S\n" * 600_000 + b'"'], "train.csv"
    )
    code, err = run_cli(config_dir, capsys, "--dry-run")
    assert code == 2, err
    assert f"{data}:500003: a field longer than 1,000,000 characters" in err and "Traceback" not in err, err


def test_a_null_field_in_an_example_is_called_null_not_missing(config_dir, capsys):
    data = write_data(
        config_dir, [b'{"question": "q", "sql": "SELECT 1"}', b'{"question": null, "sql": "x"}']
    )
    code, err = run_cli(config_dir, capsys, "--dry-run")
    assert code == 2, err
    assert f"{data}:2: field ['question'] is null: null is not allowed here" in err, err
    assert "no field" not in err, err


def test_data_that_is_not_utf8_is_named_at_its_line(config_dir, capsys):
    data = write_data(
        config_dir, [b'{"question": "q", "sql": "SELECT 1"}', b'{"question": "caf\xe9", "sql": "x"}']
    )
    code, err = run_cli(config_dir, capsys, "--dry-run")
    assert code == 2, err
    assert f"{data}:2: not UTF-8 text (byte 18 of the line)" in err and "Traceback" not in err, err


@pytest.mark.parametrize(
    ("file", "old", "new", "expected"),
    [
        (
            "cluster.yaml",
            "max_gpus_per_node: 4\n",
            'max_gpus_per_node: 4\nmail_user: "ada@uni.example\\n"\n',
            ["cluster.yaml:4", "mail_user", "'ada@uni.example\\n' is not one plain mail address"],
        ),
        ("a.yaml", '"00:05:00"', '"00:05:00\\n"', ["a.yaml:7", "resources.time", "HH:MM:SS"]),
    ],
    ids=["mail_user", "time"],
)
def test_a_value_with_a_trailing_newline_is_refused_before_sbatch_sees_it(
    file, old, new, expected, config_dir, capsys
):
    edit(config_dir / file, old, new)
    code, err = run_cli(config_dir, capsys, "--dry-run")
    assert code == 2, err
    for fragment in expected:
        assert fragment in err, f"{fragment!r} missing from:\n{err}"


def dry_run_json(config_dir: Path, capsys, *extra: str) -> tuple[int, dict | str]:
    import json

    which = [] if "--exp" in extra else ["--all"]
    code = launch.main([*which, "--dry-run", "--json", "--config-dir", str(config_dir), *extra])
    out, err = capsys.readouterr()
    return code, json.loads(out) if code == 0 else err


def test_an_unquoted_time_is_one_duration_in_an_experiment_an_override_cluster_yaml_and_budget(
    config_dir, capsys
):
    # YAML 1.1 reads an unquoted 6:00:00 as 21600 (base-60). Before: cluster.yaml's max_time took it, an
    # experiment's resources.time failed with "Input should be a valid string (got 21600)".
    edit(config_dir / "a.yaml", 'time: "00:05:00"', "time: 6:00:00")
    with (config_dir / "cluster.yaml").open("a") as cluster:
        cluster.write("max_time: 12:00:00\npack: 2\n")
    code, plan = dry_run_json(config_dir, capsys, "--no-preflight", "resources.time=1:30:00", "--exp", "b")
    assert code == 0, plan
    assert [job["resources"]["time"] for job in plan["jobs"] if job["kind"] == "train"] == ["01:30:00"]
    code, plan = dry_run_json(config_dir, capsys, "--no-preflight", "--budget", "3:00:00")
    assert code == 0, plan
    times = {job["id"]: job["resources"]["time"] for job in plan["jobs"] if job["kind"] == "train"}
    assert times["a/train"] == "06:00:00" and times["b/train"] == "00:05:00"


@pytest.mark.parametrize(
    ("where", "value"),
    [("a.yaml", "time: 90 minutes"), ("a.yaml", "time: true"), ("--budget", "ninety")],
)
def test_a_time_that_is_no_duration_is_refused_the_same_way_everywhere(where, value, config_dir, capsys):
    if where == "--budget":
        extra = ["--pack", "2", "--budget", value]
    else:
        edit(config_dir / where, 'time: "00:05:00"', value)
        extra = []
    code, err = dry_run_json(config_dir, capsys, "--no-preflight", *extra)
    assert code == 2 and "must look like HH:MM:SS or D-HH:MM:SS" in err, err
    assert (where if where == "--budget" else "a.yaml:7") in err, err


def test_after_one_name_is_after_a_list_of_it(config_dir, capsys):
    # Before: "after: a" was refused (a list was expected) with no hint; it means after: [a].
    edit(config_dir / "b.yaml", "name: b\n", "name: b\nafter: a\n")
    code, plan = dry_run_json(config_dir, capsys, "--no-preflight")
    assert code == 0, plan
    assert {"from": "a/eval", "to": "b/train", "kind": "afterany"} in plan["edges"]


def test_init_from_says_that_stages_start_from_the_stage_before(config_dir, capsys):
    edit(config_dir / "a.yaml", "train: {epochs", "init_from: runs/x/adapter\ntrain: {epochs")
    code, err = dry_run_json(config_dir, capsys, "--no-preflight")
    assert code == 2 and "a.yaml:5: init_from: unknown key: a stage always starts from the adapter" in err, (
        err
    )


def test_a_bad_override_is_one_problem_not_also_an_unknown_experiment(config_dir, capsys):
    # Before: a second, bogus error "--exp: no experiment named 'a'" (a did not load, for the override).
    code, err = dry_run_json(config_dir, capsys, "train.epochs=0", "--exp", "a")
    assert code == 2 and "train.epochs" in err and "no experiment named" not in err, err


def test_a_read_only_command_does_not_say_nothing_was_submitted(config_dir, capsys):
    edit(config_dir / "a.yaml", "epochs: 1,", "epochs: 0,")
    code, err = dry_run_json(config_dir, capsys, "--no-preflight")
    assert code == 2 and err.rstrip().endswith("1 problem(s).") and "submitted" not in err, err


def test_a_budget_shorter_than_the_stop_signal_says_so_without_a_negative_time(config_dir, capsys):
    code, err = dry_run_json(config_dir, capsys, "--no-preflight", "--pack", "1", "--budget", "00:01:00")
    assert code == 2 and "00:01:00 leaves no time to work" in err and "-1-" not in err, err


def test_help_shows_cancel_with_the_flag_that_names_experiments():
    import launch as entry

    text = entry.__doc__
    assert "--cancel [--exp NAME ...]" in text and "--cancel [EXP" not in text
