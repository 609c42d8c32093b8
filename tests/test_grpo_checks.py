"""Issue 49: a GRPO stage is checked before anything is queued, and its rewards are the eval's own scores.

- A reward's mean over a set of completions equals the score results.json gives the same predictions (the
  eval's scoring code, eval/score.py, on the same texts): a reward of 1 means what the report's 1 means.
- What cannot be a reward, a loss whose step depends on the split, a GRPO stage on a model or data it cannot
  train, a first stage without SFT: each refused (or warned) at its file and line, through the real loader
  (`launch.py --dry-run`, no cluster).
- K, the steps without reward variance after which a stage stops, from its formula by hand.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from core.config import RewardSpec
from core.grpo import no_variance_chance, zero_variance_steps
from eval.rewards import ScoreReward
from eval.score import score
from tests.helpers import ROOT, dry_run, experiment_folder

DB = ROOT / "data" / "demo" / "shop.db"
GOLD = [
    "SELECT name FROM customers WHERE city = 'Nice' ORDER BY age DESC LIMIT 1",
    "SELECT name FROM customers ORDER BY age LIMIT 2",
    "SELECT COUNT(*) FROM products",
    "SELECT name, price FROM products WHERE price > 50",
]
# Completions of every kind: right, right with other formatting, partly right (record F1), runs but wrong,
# does not run, empty, and the same rows in another order where the gold orders them.
COMPLETIONS = [
    "select name from customers where city = 'Nice' order by age desc limit 1",
    "SELECT name FROM customers ORDER BY age DESC LIMIT 2",
    "SELECT COUNT(*) FROM products",
    "SELECT name, price FROM products WHERE price > 10",
    "SELEC name FROM nowhere",
    "",
    "SELECT price, name FROM products WHERE price > 50",
    "SELECT name FROM customers ORDER BY age LIMIT 2",
]
REFERENCES = [GOLD[0], GOLD[1], GOLD[2], GOLD[3], GOLD[0], GOLD[1], GOLD[3], GOLD[1]]


def rewards_of(key: str) -> list[float]:
    return ScoreReward(RewardSpec(score=key), str(DB)).each(COMPLETIONS, REFERENCES)


@pytest.mark.parametrize("key", ["exact_match", "rouge_1", "rouge_2", "rouge_l"])
def test_a_text_rewards_mean_is_the_score_results_json_gives_the_same_predictions(key):
    results = score(COMPLETIONS, REFERENCES, ["exact_match", "rouge"])
    rewards = rewards_of(key)
    assert len(rewards) == len(COMPLETIONS) and 0.0 < sum(rewards) < len(rewards)  # some right, some not
    assert sum(rewards) / len(rewards) == pytest.approx(results[key], abs=1e-12)


@pytest.mark.parametrize("key", ["sql_exec_accuracy", "sql_record_f1", "sql_executes"])
def test_an_sql_rewards_mean_is_the_score_results_json_gives_the_same_predictions(key):
    results = score(COMPLETIONS, REFERENCES, ["sql_exec"], db=str(DB))
    rewards = rewards_of(key)
    assert 0.0 < sum(rewards) < len(rewards)
    expected = 1 - results["sql_error_rate"] if key == "sql_executes" else results[key]
    assert sum(rewards) / len(rewards) == pytest.approx(expected, abs=1e-12)


def test_an_sql_reward_runs_each_gold_query_once_per_job():
    reward = ScoreReward(RewardSpec(score="sql_exec_accuracy"), str(DB))
    reward.each(COMPLETIONS, REFERENCES)
    assert sorted(reward.golds) == sorted(set(REFERENCES))
    kept = dict(reward.golds)
    reward.each(COMPLETIONS, REFERENCES)
    assert all(reward.golds[q] is kept[q] for q in kept)  # the same results, not run again


def test_k_is_the_fewest_steps_whose_false_stop_chance_is_below_one_percent_by_hand():
    q = 0.05**4 + 0.95**4  # 0.8145125: a group of 4 of a model right 5 % of the time has no variance
    assert no_variance_chance(4) == pytest.approx(q)
    assert zero_variance_steps(4, 1) == 23  # q^22 = 1.10 %, q^23 = 0.89 %
    assert q**22 > 0.01 > q**23
    assert zero_variance_steps(4, 2) == 12 and zero_variance_steps(4, 4) == 6
    for groups in (1, 2, 3, 8):
        k = zero_variance_steps(8, groups)
        assert q_of(8) ** (groups * k) < 0.01 <= q_of(8) ** (groups * (k - 1))


def q_of(generations: int) -> float:
    return 0.05**generations + 0.95**generations


# -- refused before queueing, at the line --------------------------------------------------------------
def grpo_stage(grpo: str, first: str = "  - name: sft\n", stage_train: str = "") -> str:
    """A stages block: `first` (an SFT stage), then a GRPO stage with `grpo` as its block (line 13 on)."""
    return f"stages:\n{first}  - name: rl\n    train:\n      method: grpo\n{stage_train}      grpo:\n{grpo}"


REWARD = "        rewards:\n          - {score: sql_exec_accuracy}\n"


@pytest.mark.parametrize(
    "block, line, expected",
    [
        ("        rewards:\n          - {score: bleu}\n", 15, "bleu cannot be a reward: corpus BLEU"),
        ("        rewards:\n          - {score: bertscore_f1}\n", 15, "a second model into the training job"),
        ("        rewards:\n          - {score: sql_error_rate}\n", 15, "use sql_executes (1 - error)"),
        ("        loss_type: bnpo\n" + REWARD, 14, "bnpo is refused: it normalises by each micro-batch"),
        (
            "        loss_type: cispo\n" + REWARD,
            14,
            "not a GRPO loss run here; use one of dapo, grpo, dr_grpo",
        ),
        ("        num_generations: 1\n" + REWARD, 14, "greater than or equal to 2"),
        ("        rewards: []\n", 14, "is empty: a GRPO stage learns from rewards"),
        ("        rewards:\n          - {function: rewards}\n", 15, "is not module:name"),
    ],
)
def test_a_grpo_block_mistake_is_refused_at_its_key(tmp_path, capsys, block, line, expected):
    code, err = dry_run(experiment_folder(tmp_path, more=grpo_stage(block)), capsys)
    assert code == 2 and "Traceback" not in err
    assert f"a.yaml:{line}: stages.1.train.grpo" in err and expected in err


def test_a_grpo_stage_on_a_seq2seq_model_is_refused_at_its_method(tiny, tmp_path, capsys):
    configs = experiment_folder(tmp_path, model=str(tiny["tiny-t5"]), kind="seq2seq", more=grpo_stage(REWARD))
    code, err = dry_run(configs, capsys)
    assert code == 2 and "a.yaml:12: stages.1.train.method: is grpo, but model.kind is seq2seq" in err


def test_grpo_without_rewards_is_refused_at_its_method(tmp_path, capsys):
    more = "stages:\n  - name: sft\n  - name: rl\n    train: {method: grpo}\n"
    code, err = dry_run(experiment_folder(tmp_path, more=more), capsys)
    assert (
        code == 2 and "a.yaml:11: stages.1.train.method: is grpo in stage 'rl', which has no rewards" in err
    )


def test_a_grpo_block_on_an_sft_stage_is_refused(tmp_path, capsys):
    more = "stages:\n  - name: sft\n    train:\n      grpo: {rewards: [{score: exact_match}]}\n"
    code, err = dry_run(experiment_folder(tmp_path, more=more), capsys)
    assert code == 2 and "a.yaml:11: stages.0.train.grpo: is a GRPO stage's block, but this stage is" in err


def test_a_first_grpo_stage_is_warned_unless_it_says_it_starts_from_the_base_knowingly(tmp_path, capsys):
    warned = experiment_folder(tmp_path, more=grpo_stage(REWARD, first=""))
    code, err = dry_run(warned, capsys)
    assert (
        code == 0 and "stages.0.train.method: is grpo in the first stage 'rl': a base model that never" in err
    )
    (tmp_path / "b").mkdir()
    quiet = experiment_folder(tmp_path / "b", more=grpo_stage(REWARD + "        from_base: true\n", first=""))
    code, err = dry_run(quiet, capsys)
    assert code == 0 and "is grpo in the first stage" not in err


def test_reference_previous_on_a_first_grpo_stage_is_refused(tmp_path, capsys):
    block = "        reference: previous\n        beta: 0.04\n" + REWARD
    code, err = dry_run(experiment_folder(tmp_path, more=grpo_stage(block, first="")), capsys)
    assert (
        code == 2
        and "a.yaml:13: stages.0.train.grpo.reference: is previous, but stage 'rl' is the first" in err
    )


def test_an_sql_reward_without_any_database_is_refused_at_the_reward(tmp_path, capsys):
    configs = experiment_folder(tmp_path, more=grpo_stage(REWARD))
    text = (configs / "a.yaml").read_text().replace("eval: {metrics: [exact_match, sql_exec], db: ", "#")
    (configs / "a.yaml").write_text(text.replace("#", "eval: {metrics: [exact_match]}\n#", 1))
    code, err = dry_run(configs, capsys)
    assert code == 2
    assert "stages.1.train.grpo.rewards.0.score: sql_exec_accuracy runs each completion on a database" in err


def test_a_sql_reward_takes_eval_db_as_its_database_in_the_plan(tmp_path, capsys):
    import json

    import launch

    configs = experiment_folder(tmp_path, more=grpo_stage(REWARD))
    assert launch.main(["--all", "--config-dir", str(configs), "--dry-run", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    rl = next(job for job in plan["jobs"] if job["id"] == "a/rl")
    assert rl["spec"]["train"]["grpo"]["rewards"] == [
        {"score": "sql_exec_accuracy", "weight": 1.0, "db": str(DB)}
    ]


def test_prune_on_a_grpo_stage_is_refused_with_the_reason(tmp_path, capsys):
    more = (
        "stages:\n  - name: rl\n    train:\n      method: grpo\n      grpo:\n        from_base: true\n"
        + REWARD
        + "sweep:\n  grid: {train.learning_rate: [1.0e-4, 2.0e-4]}\n  prune: {rungs: [1], keep: 0.5}\n"
    )
    code, err = dry_run(experiment_folder(tmp_path, more=more), capsys)
    assert code == 2 and "prune: is not for GRPO stages yet" in err


def test_the_demo_grpo_experiment_plans(repo_root, capsys, monkeypatch):
    monkeypatch.chdir(repo_root)
    import launch

    assert launch.main(["--exp", "sql-llama-sft-grpo", "--config-dir", "configs/demo", "--dry-run"]) == 0
    assert "sql-llama-sft-grpo/grpo" in capsys.readouterr().out


# -- the rewards run on the training references, in a bounded child, before queueing ---------------------
def with_training_rows(configs: Path, rows: list[str]) -> None:
    (configs.parent / "train.jsonl").write_text("".join(row + "\n" for row in rows))


def test_a_gold_query_that_fails_on_the_database_is_refused_at_the_reward(tmp_path, capsys):
    configs = experiment_folder(tmp_path, more=grpo_stage(REWARD))
    with_training_rows(
        configs,
        ['{"question": "q", "sql": "SELECT 1"}', '{"question": "r", "sql": "SELECT nope FROM nowhere"}'],
    )
    code, err = dry_run(configs, capsys)
    assert code == 2
    assert (
        "a.yaml:15: stages.1.train.grpo.rewards.0.score: in stage 'rl': 1 of the training data's gold queries"
        in err
    )
    assert "'SELECT nope FROM nowhere': no such table: nowhere" in err


def test_a_reference_that_does_not_earn_one_on_its_score_is_refused(tmp_path, capsys):
    block = "        rewards:\n          - {score: rouge_l}\n"
    configs = experiment_folder(tmp_path, more=grpo_stage(block))
    with_training_rows(configs, ['{"question": "q", "sql": "SELECT 1"}', '{"question": "r", "sql": "--"}'])
    code, err = dry_run(configs, capsys)
    assert code == 2
    assert (
        "rewards.0.score: in stage 'rl': the training references themselves earn less than 1.0 on rouge_l"
        in err
    )
    assert "'--': 0)" in err


@pytest.mark.parametrize(
    "body, expected",
    [
        ("    raise KeyError('reference')\n", "rewards:tiered failed on the training references: KeyError"),
        ("    return [float('nan')] * len(completions)\n", "not a finite number"),
        ("    return [1.0] * len(completions)\n", "no more than empty completions"),
        ("    return [0.0]\n", "returned 1 values for 1"),
        ("    return [len(c) > 0 for c in completions]\n", None),
    ],
)
def test_a_users_reward_function_is_run_on_the_references_before_queueing(tmp_path, capsys, body, expected):
    block = "        rewards:\n          - {function: rewards:tiered}\n"
    configs = experiment_folder(tmp_path, more=grpo_stage(block))
    (configs / "rewards.py").write_text(f"def tiered(completions, reference, **kwargs):\n{body}")
    if body.startswith("    return [0.0]"):
        with_training_rows(
            configs, ['{"question": "q", "sql": "SELECT 1"}', '{"question": "r", "sql": "SELECT 2"}']
        )
        expected = "returned 1 values for 2 completions"
    code, err = dry_run(configs, capsys)
    if expected is None:
        assert code == 0, err
        return
    assert code == 2 and "a.yaml:15: stages.1.train.grpo.rewards.0.function: in stage 'rl': " in err
    assert expected in err


@pytest.mark.slow  # waits out the bound
def test_a_reward_function_that_runs_forever_is_stopped_by_the_child_bound(tmp_path, capsys, monkeypatch):
    import eval.reward_check

    monkeypatch.setattr(eval.reward_check, "TIME_S", 3.0)
    block = "        rewards:\n          - {function: rewards:forever}\n"
    configs = experiment_folder(tmp_path, more=grpo_stage(block))
    (configs / "rewards.py").write_text(
        "def forever(completions, **kwargs):\n    while True:\n        pass\n"
    )
    code, err = dry_run(configs, capsys)
    assert code == 2 and "stages.1.train.grpo.rewards: in stage 'rl': checking the rewards" in err
    assert "ran past 3 s" in err


@pytest.mark.slow  # imports the trainer (torch)
def test_status_names_why_a_grpo_stage_stopped_itself_from_its_logs_last_attempt():
    """On SLURM a stage that raised is FAILED with only its exit code; --status reads why from its log."""
    import traceback

    from slurm.watching.status import stage_stop
    from train.grpo import NoRewardVariance  # noqa: F401 (the class whose line the log holds)

    def attempt(message: str) -> str:
        try:
            raise NoRewardVariance(message)
        except NoRewardVariance:
            return "submitit INFO - Starting with JobEnvironment(job_id=7)\n" + traceback.format_exc()

    first, second = (
        attempt("no completion group had reward variance in 12 steps: old"),
        attempt("in 23 steps: new"),
    )
    assert stage_stop(first) == "no completion group had reward variance in 12 steps: old"
    assert stage_stop(first + second) == "in 23 steps: new"  # the last attempt's, not a requeued one's
    assert stage_stop(first + "submitit INFO - Starting with JobEnvironment(job_id=7)\nstep 3\n") == ""


def test_sft_then_dpo_then_grpo_plans_a_chain_whose_grpo_stage_reads_the_sft_data(tmp_path, capsys):
    """The one rule for inherited keys: the DPO stage reads its pairs, the GRPO stage the experiment's own
    fields data (its prompts and references) and neither the DPO block nor the pairs; each stage continues the
    adapter of the stage before it."""
    import json

    import launch

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text('{"prompt": "q", "chosen": "SELECT 1", "rejected": "SELECT 2"}\n')
    more = (
        "stages:\n  - name: sft\n  - name: dpo\n"
        f"    data: {{train: {pairs}, format: preference}}\n"
        "    train: {method: dpo, eval_every_epochs: null}\n"
        "  - name: rl\n    train:\n      method: grpo\n      grpo:\n" + REWARD
    )
    configs = experiment_folder(tmp_path, more=more)
    text = (
        (configs / "a.yaml")
        .read_text()
        .replace("eval: {metrics: [exact_match, sql_exec], db:", "eval: {metrics: [], db:")
    )
    (configs / "a.yaml").write_text(text)
    assert launch.main(["--all", "--config-dir", str(configs), "--dry-run", "--json"]) == 0
    jobs = {job["id"]: job for job in json.loads(capsys.readouterr().out)["jobs"]}
    dpo, rl = jobs["a/dpo"]["spec"], jobs["a/rl"]["spec"]
    assert dpo["data"]["format"] == "preference" and dpo["init_adapter"].endswith("a/sft/adapter")
    assert rl["init_adapter"].endswith("a/dpo/adapter") and rl["data"]["train"] == str(
        tmp_path / "train.jsonl"
    )
    assert rl["data"]["target_field"] == "sql" and "dpo" not in rl["train"]
    assert rl["train"]["method"] == "grpo" and jobs["a/rl"]["depends_on"] == [
        {"job": "a/dpo", "kind": "afterok"}
    ]


def test_a_dpo_block_written_in_a_grpo_stage_is_refused_not_silently_dropped(tmp_path, capsys):
    more = grpo_stage(REWARD, stage_train="      dpo: {beta: 0.5}\n")
    code, err = dry_run(experiment_folder(tmp_path, more=more), capsys)
    text = " ".join(err.split())
    assert code == 2 and "a.yaml:13: stages.1.train.dpo: is the preference objective's block" in text
    assert "this stage is train.method: grpo" in text
