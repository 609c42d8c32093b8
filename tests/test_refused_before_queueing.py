"""Issue 31, rule 10: what can never work is refused before anything is queued, at its file and line, with
what to write instead; never a traceback, never a job that fails on the node or a report that waits for
ever. The real loader through `launch.py --dry-run` (a refusal needs no cluster)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import dry_run, experiment_folder


def folder_with(tmp_path: Path, model: str = "org/some-model", kind: str = "causal", sweep: str = "") -> Path:
    return experiment_folder(tmp_path, model, kind, more=sweep)


@pytest.mark.parametrize(
    "model, kind, right",
    [
        ("tiny-llama", "seq2seq", "causal"),
        ("tiny-t5", "causal", "seq2seq"),
        ("tiny-qwen-vl", "causal", "image-text"),
    ],
)
def test_a_model_kind_its_config_contradicts_is_refused_at_model_kind(
    tiny, tmp_path, capsys, model, kind, right
):
    """Before: seq2seq on a Llama passed validation and failed on the node (its base eval too)."""
    configs = folder_with(tmp_path, model=str(tiny[model]), kind=kind)
    code, err = dry_run(configs, capsys)
    assert code == 2
    assert f"a.yaml:2: model.kind: is {kind}, but this model" in err and f"use model.kind: {right}" in err
    assert "Traceback" not in err


def test_the_right_kind_passes(tiny, tmp_path, capsys):
    assert dry_run(folder_with(tmp_path, model=str(tiny["tiny-t5"]), kind="seq2seq"), capsys)[0] == 0


def test_a_select_metric_the_eval_does_not_compute_is_refused_naming_the_ones_it_does(tmp_path, capsys):
    """Before: the report said "none yet" for ever."""
    sweep = (
        "sweep:\n  grid: {train.learning_rate: [1.0e-4, 2.0e-4]}\n  select: {metric: rouge_l, mode: max}\n"
    )
    code, err = dry_run(folder_with(tmp_path, sweep=sweep), capsys)
    assert code == 2
    assert "a.yaml:10: sweep.select.metric: 'rouge_l' is not a score this sweep's eval computes" in err
    assert "exact_match, sql_exec_accuracy, sql_record_f1, sql_error_rate" in err
    assert err.count("is not a score") == 1  # once for the sweep, not once per point


@pytest.mark.parametrize("metric", ["eval_loss", "sql_exec_accuracy", "exact_match"])
def test_a_select_metric_the_eval_computes_passes(tmp_path, capsys, metric):
    sweep = f"sweep:\n  grid: {{train.learning_rate: [1.0e-4, 2.0e-4]}}\n  select: {{metric: {metric}, mode: max}}\n"
    assert dry_run(folder_with(tmp_path, sweep=sweep), capsys)[0] == 0


def test_a_swept_key_into_a_list_is_refused_at_the_sweeps_line(tmp_path, capsys):
    sweep = "sweep:\n  grid: {stages.0.train.learning_rate: [1.0e-4, 2.0e-4]}\n"
    code, err = dry_run(folder_with(tmp_path, sweep=sweep), capsys)
    assert code == 2
    assert "sweep.grid.stages.0.train.learning_rate" in err and "list items cannot be swept" in err


def test_a_whole_section_swept_with_seeds_is_an_error_at_its_line_not_a_traceback(tmp_path, capsys):
    sweep = "sweep:\n  grid: {train: [1, 2]}\n  seeds: [1, 2]\n"
    code, err = dry_run(folder_with(tmp_path, sweep=sweep), capsys)
    assert code == 2
    assert "train is swept whole, and seeds sets train.seed inside it" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "grid",
    [
        "{train.learning_rate: [1.0e-4, 1e-4]}",  # YAML reads 1e-4 as text; validated, it is 1.0e-4
        "{adapter.rank: [8, 8.0]}",
    ],
)
def test_two_points_that_are_one_run_once_validated_are_refused_naming_both(tmp_path, capsys, grid):
    """Issue 31, rule 5 (its first half). Before: these grids trained the same run twice under two names."""
    code, err = dry_run(folder_with(tmp_path, sweep=f"sweep:\n  grid: {grid}\n"), capsys)
    assert code == 2
    assert "are the same run once their values are read" in err
    assert err.count("a-") >= 2  # both points named


def test_the_dry_run_shows_refused_what_the_local_launch_refuses_not_planned(tmp_path, capsys):
    """L2: `--dry-run resources.nodes=2` on the local backend showed PLANNED, exit 0, and the launch then
    refused it (the README: the dry run shows what a relaunch would decide)."""
    import launch

    configs = folder_with(tmp_path)
    args = ["--all", "--config-dir", str(configs), "--dry-run", "--backend", "local", "resources.nodes=2"]
    assert launch.main(args) == 0
    captured = capsys.readouterr()
    assert "a/train" in captured.out and "REFUSED (see below)" in captured.out
    assert (
        "a launch would refuse:" in captured.err
        and "resources.nodes: asks for 2 nodes x 1 GPU" in captured.err
    )


CHATS = '{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "SELECT 1"}]}\n'
TEXT_PAIR = '{"prompt": "q", "chosen": "SELECT 1", "rejected": "SELECT 2"}\n'
TURNS_PAIR = '{"prompt": [{"role": "user", "content": "q"}], "chosen": "SELECT 1", "rejected": "SELECT 2"}\n'


def sft_then_dpo(
    tmp_path: Path,
    sft_data: str | None,
    pairs: str,
    sft_template: str | None = None,
    dpo_template: str | None = None,
) -> Path:
    """a.yaml as two stages: SFT on its own data (`sft_data`, chats; None: the fields of a.yaml), then DPO
    on pairs.jsonl holding `pairs`; each with its data.chat_template where one is given."""
    (tmp_path / "pairs.jsonl").write_text(pairs * 2)
    sft = ""
    if sft_data is not None:
        (tmp_path / "chats.jsonl").write_text(sft_data * 2)
        template = f", chat_template: {sft_template}" if sft_template else ""
        sft = f"    data: {{train: {tmp_path / 'chats.jsonl'}, eval: null, format: messages{template}}}\n"
    pairs_file = tmp_path / "pairs.jsonl"
    template = f", chat_template: {dpo_template}" if dpo_template else ""
    dpo = f"    data: {{train: {pairs_file}, eval: {pairs_file}, format: preference{template}}}\n"
    stages = f"stages:\n  - name: sft\n{sft}  - name: dpo\n    train: {{method: dpo}}\n{dpo}"
    return experiment_folder(tmp_path, more=stages)


@pytest.mark.parametrize(
    "sft_data, pairs, sft_template, dpo_template, warned",
    [
        (
            CHATS,
            TEXT_PAIR,
            None,
            None,
            "reaches the model as raw prompts (as `fields` are rendered), but stage "
            "'sft' trained it on the model's own chat template",
        ),
        (
            None,
            TURNS_PAIR,
            None,
            None,
            "reaches the model as the model's own chat template, but stage 'sft' trained it on raw prompts",
        ),
        (
            CHATS,
            TURNS_PAIR,
            "chatml",
            None,
            "reaches the model as the model's own chat template, but stage "
            "'sft' trained it on chat template 'chatml'",
        ),
        (CHATS, TEXT_PAIR, "chatml", "chatml", None),
        (CHATS, TURNS_PAIR, None, None, None),
        (None, TEXT_PAIR, None, None, None),
    ],
)
def test_dpo_pairs_rendered_unlike_the_sft_stage_before_them_are_warned_not_silent(
    tmp_path, capsys, sft_data, pairs, sft_template, dpo_template, warned
):
    folder = sft_then_dpo(tmp_path, sft_data, pairs, sft_template, dpo_template)
    code, err = dry_run(folder, capsys)
    text = " ".join(err.split())
    assert code == 0, err
    if warned:
        assert f"pairs.jsonl:1: prompt: stage 'dpo': this pair's prompt {warned}" in text
        if sft_template:
            assert "set data.chat_template: chatml in this stage, as that stage has it" in text
    else:
        assert "stage 'dpo':" not in text


def test_a_second_dpo_stage_is_held_to_the_sft_stage_that_taught_the_format_not_skipped(tmp_path, capsys):
    """sft (chats) -> dpo (turns) -> dpo (text prompts): the third renders raw what two stages learned
    through the template. Before, a DPO stage after a DPO stage was not checked."""
    folder = sft_then_dpo(tmp_path, CHATS, TURNS_PAIR)
    (tmp_path / "text-pairs.jsonl").write_text(TEXT_PAIR * 2)
    text_pairs = tmp_path / "text-pairs.jsonl"
    third = f"  - name: dpo2\n    train: {{method: dpo}}\n    data: {{train: {text_pairs}, eval: {text_pairs}, format: preference}}\n"
    (folder / "a.yaml").write_text((folder / "a.yaml").read_text() + third)
    code, err = dry_run(folder, capsys)
    text = " ".join(err.split())
    assert (
        code == 0
        and "text-pairs.jsonl:1: prompt: stage 'dpo2': this pair's prompt reaches the model as raw" in text
    )
    assert "stage 'dpo':" not in text
