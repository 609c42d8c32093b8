"""A sweep block expands into the points written, named readably, uniquely and within SAFE_NAME, and
every mistake in it is reported at once with the key it sits under (core/sweep.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from core.config import SAFE_NAME
from core.sweep import MAX_POINTS, SweepError, SweepSelect, expand, float_text, nested
from core.yamlfile import YamlFile
from slurm.planning.validation import to_problem

LR_BY_RANK = {"grid": {"train.learning_rate": [1.0e-4, 3.0e-4], "adapter.rank": [8, 16]}}
RANDOM = {
    "random": {
        "train.dropout_x": {"uniform": [0.0, 0.2]},
        "train.learning_rate": {"loguniform": [1.0e-5, 1.0e-3]},
        "adapter.rank": {"choice": [4, 8, 16]},
        "train.epochs": {"int": [1, 3]},
    },
    "samples": 40,
}


def problems_of(block, name="exp") -> list[tuple[tuple, str]]:
    """(where in the block, the message the loader shows there) for each problem, in the order shown."""
    with pytest.raises(SweepError) as raised:
        expand(block, name)
    chain = [YamlFile(Path("exp.yaml"), {"sweep": block}, {})]
    return [(error["loc"], to_problem(error, chain, ("sweep",)).message) for error in raised.value.errors]


def paths_of(block, name="exp") -> list[tuple]:
    return [path for path, _ in problems_of(block, name)]


def message_at(block, path: tuple) -> str:
    messages = [message for where, message in problems_of(block) if where == path]
    assert messages, f"no problem at {path}"
    return messages[0]


def point_parts(suffix: str) -> list[str]:
    # Exponents carry a '-' too: glue "1.9e" back to "05".
    parts: list[str] = []
    for part in suffix.split("-"):
        if parts and parts[-1].endswith("e"):
            parts[-1] += "-" + part
        else:
            parts.append(part)
    return parts


# Grid and zip


def test_grid_is_the_product_in_written_order_not_a_zip():
    sweep = expand(LR_BY_RANK, "exp")
    assert [p.suffix for p in sweep.points] == ["lr1e-04-r8", "lr1e-04-r16", "lr3e-04-r8", "lr3e-04-r16"]
    assert [p.values for p in sweep.points] == [
        {"train.learning_rate": 1e-4, "adapter.rank": 8},
        {"train.learning_rate": 1e-4, "adapter.rank": 16},
        {"train.learning_rate": 3e-4, "adapter.rank": 8},
        {"train.learning_rate": 3e-4, "adapter.rank": 16},
    ]
    assert [list(p.values) for p in sweep.points] == [["train.learning_rate", "adapter.rank"]] * 4
    assert sweep.swept == ("train.learning_rate", "adapter.rank")
    assert all(p.seed is None and p.point == p.suffix for p in sweep.points)
    assert sweep.select is None


def test_zip_lists_change_together_not_as_a_product():
    block = {"zip": [{"train.warmup_ratio": [0.0, 0.1], "train.weight_decay": [0.0, 0.01]}]}
    sweep = expand(block, "exp")
    assert [p.values for p in sweep.points] == [
        {"train.warmup_ratio": 0.0, "train.weight_decay": 0.0},
        {"train.warmup_ratio": 0.1, "train.weight_decay": 0.01},
    ]
    assert [p.suffix for p in sweep.points] == ["wu0.0-wd0.0", "wu0.1-wd0.01"]


def test_zip_lists_of_unequal_lengths_are_refused_naming_the_lengths():
    block = {"zip": [{"train.warmup_ratio": [0.0, 0.1], "train.weight_decay": [0.0, 0.01, 0.1]}]}
    message = message_at(block, ("zip", 0))
    assert "train.warmup_ratio has 2" in message and "train.weight_decay has 3" in message


def test_zip_groups_multiply_each_other_and_the_grid_with_grid_keys_first():
    block = {
        "grid": {"adapter.rank": [8, 16]},
        "zip": [{"train.warmup_ratio": [0.0, 0.1]}, {"train.epochs": [1, 2, 3]}],
    }
    sweep = expand(block, "exp")
    assert len(sweep.points) == 2 * 2 * 3
    assert sweep.points[0].suffix == "r8-wu0.0-ep1"
    assert sweep.points[1].suffix == "r8-wu0.0-ep2"
    assert sweep.points[3].suffix == "r8-wu0.1-ep1"
    assert sweep.points[-1].values == {"adapter.rank": 16, "train.warmup_ratio": 0.1, "train.epochs": 3}
    assert sweep.swept == ("adapter.rank", "train.warmup_ratio", "train.epochs")


def test_values_keep_grid_then_zip_then_random_then_seed_order():
    block = {
        "random": {"adapter.alpha": {"choice": [16, 32]}},
        "samples": 1,
        "zip": [{"train.epochs": [1, 2]}],
        "grid": {"adapter.rank": [8]},
        "seeds": [7],
    }
    point = expand(block, "exp").points[0]
    assert list(point.values) == ["adapter.rank", "train.epochs", "adapter.alpha", "train.seed"]


# Random


def test_random_draws_are_the_same_for_the_same_seed_and_differ_for_another():
    first, again = expand(RANDOM, "exp"), expand(RANDOM, "exp")
    other = expand({**RANDOM, "seed": 1}, "exp")
    assert [p.values for p in first.points] == [p.values for p in again.points]
    assert [p.values for p in first.points] != [p.values for p in other.points]
    assert [p.suffix for p in first.points] == [p.suffix for p in again.points]


def test_random_draws_stay_within_their_bounds_and_int_includes_both_ends():
    points = expand(RANDOM, "exp").points
    assert len(points) == 40
    dropouts = [p.values["train.dropout_x"] for p in points]
    rates = [p.values["train.learning_rate"] for p in points]
    epochs = {p.values["train.epochs"] for p in points}
    assert all(0.0 <= d <= 0.2 for d in dropouts)
    assert all(1e-5 <= r <= 1e-3 for r in rates)
    assert epochs == {1, 2, 3}  # 40 draws of three values: both ends come up
    assert {p.values["adapter.rank"] for p in points} <= {4, 8, 16}
    assert all(
        type(p.values["adapter.rank"]) is int and type(p.values["train.epochs"]) is int for p in points
    )


def test_loguniform_draws_spread_over_decades_not_bunched_at_the_top():
    # A uniform draw over [1e-5, 1e-3] lands below 1e-4 about 9% of the time; a log-uniform one, half.
    rates = [p.values["train.learning_rate"] for p in expand(RANDOM, "exp").points]
    assert sum(rate < 1e-4 for rate in rates) >= 10


def test_random_floats_are_rounded_to_3_significant_digits_and_the_name_shows_that_value():
    for point in expand(RANDOM, "exp").points:
        for key, label in (("train.dropout_x", "dropout_x"), ("train.learning_rate", "lr")):
            value = point.values[key]
            assert value == float(f"{value:.2e}")
            shown = next(part[len(label) :] for part in point_parts(point.suffix) if part.startswith(label))
            assert float(shown) == value


def test_random_without_samples_and_samples_without_random_are_both_refused():
    assert paths_of({"random": {"adapter.rank": {"choice": [4, 8]}}}) == [("random",)]
    assert ("samples",) in paths_of({"grid": {"adapter.rank": [4, 8]}, "samples": 3})
    assert paths_of({**RANDOM, "samples": 0}) == [("samples",)]
    assert paths_of({**RANDOM, "samples": True}) == [("samples",)]


def test_a_draws_seed_without_random_is_refused_pointing_at_seeds():
    message = message_at({"grid": {"adapter.rank": [4, 8]}, "seed": 3}, ("seed",))
    assert "seeds" in message


def test_each_bad_distribution_is_reported_at_its_key():
    block = {
        "random": {
            "a.normal": {"normal": [0.0, 1.0]},
            "a.backwards": {"uniform": [0.2, 0.1]},
            "a.log_from_zero": {"loguniform": [0.0, 1.0e-3]},
            "a.int_of_floats": {"int": [1.5, 3]},
            "a.empty_choice": {"choice": []},
            "a.one_bound": {"uniform": [0.1]},
            "a.two_kinds": {"uniform": [0.0, 1.0], "int": [1, 2]},
            "a.text_bound": {"loguniform": ["1e-5", 1.0e-3]},
        },
        "samples": 2,
    }
    problems = dict(problems_of(block))
    assert set(problems) == {("random", key) for key in block["random"]}
    assert all(
        kind in problems[("random", "a.normal")] for kind in ("uniform", "loguniform", "choice", "int")
    )
    assert "below" in problems[("random", "a.backwards")]
    assert "above 0" in problems[("random", "a.log_from_zero")]
    assert "whole numbers" in problems[("random", "a.int_of_floats")]
    assert "non-empty" in problems[("random", "a.empty_choice")]
    assert "1.0e-5" in problems[("random", "a.text_bound")]  # YAML read 1e-5 as text: the hint says so


# Seeds


def test_seeds_replicate_every_point_and_the_replicates_share_their_point():
    sweep = expand({**LR_BY_RANK, "seeds": [1, 2, 3]}, "exp")
    assert len(sweep.points) == 12
    assert sweep.points[0].suffix == "lr1e-04-r8-s1"
    assert [p.suffix for p in sweep.points[:3]] == ["lr1e-04-r8-s1", "lr1e-04-r8-s2", "lr1e-04-r8-s3"]
    by_point: dict[str, list[int]] = {}
    for p in sweep.points:
        by_point.setdefault(p.point, []).append(p.seed)
        assert p.values["train.seed"] == p.seed
        assert p.suffix == f"{p.point}-s{p.seed}"
    assert by_point == {
        point: [1, 2, 3] for point in ("lr1e-04-r8", "lr1e-04-r16", "lr3e-04-r8", "lr3e-04-r16")
    }
    assert sweep.swept == ("train.learning_rate", "adapter.rank")  # train.seed is not a report column


def test_seeds_alone_make_a_sweep_of_replicates():
    sweep = expand({"seeds": [1, 2]}, "exp")
    assert [(p.suffix, p.point, p.values) for p in sweep.points] == [
        ("s1", "", {"train.seed": 1}),
        ("s2", "", {"train.seed": 2}),
    ]


def test_sweeping_train_seed_directly_beside_seeds_is_refused():
    message = message_at({"grid": {"train.seed": [1, 2]}, "seeds": [3, 4]}, ("grid", "train.seed"))
    assert "seeds" in message


def test_seeds_must_be_distinct_whole_numbers():
    assert paths_of({"seeds": [1, 1]}) == [("seeds",)]
    assert paths_of({"seeds": [1, 2.5]}) == [("seeds",)]
    assert paths_of({"seeds": []}) == [("seeds",)]
    assert paths_of({"seeds": 3}) == [("seeds",)]


# Names


def test_floats_are_named_by_the_shorter_exact_form():
    assert float_text(1e-4) == "1e-04"
    assert float_text(3e-4) == "3e-04"
    assert float_text(2.5e-5) == "2.5e-05"
    assert float_text(0.01) == "0.01"
    assert float_text(0.001) == "0.001"  # a tie: the decimal one
    assert float_text(0.1) == "0.1"
    assert float_text(0.0) == "0.0"
    assert float_text(1e6) == "1e06"  # no '+': it is not a name character
    for value in (1e-4, 3e-4, 2.5e-5, 0.1 + 0.2, 1e6, 1.0e-12, 123456.789):
        assert float(float_text(value)) == value


def test_text_values_are_named_by_their_last_part_with_unsafe_characters_replaced():
    block = {"grid": {"model.name_or_path": ["Qwen/Qwen2.5-0.5B", "google/flan-t5-small"]}}
    suffixes = [p.suffix for p in expand(block, "exp").points]
    # What the last part loses (the organisation, '-') is told by 4 characters of the value's own hash.
    assert [re.sub(r"_[0-9a-f]{4}$", "", s) for s in suffixes] == ["mQwen2.5_0.5B", "mflan_t5_small"]
    assert all(re.search(r"_[0-9a-f]{4}$", s) for s in suffixes)
    block = {"grid": {"train.gradient_checkpointing": [True, False], "adapter.rank": [8]}}
    assert [p.suffix for p in expand(block, "exp").points] == ["gctrue-r8", "gcfalse-r8"]


def test_keys_with_the_same_label_get_longer_labels_that_differ():
    block = {"grid": {"adapter.rank": [8, 16], "other.r": [1, 2]}}
    assert expand(block, "exp").points[0].suffix == "rank8-r1"
    block = {"grid": {"a.rank": [8, 16], "b.rank": [1, 2]}}
    assert expand(block, "exp").points[0].suffix == "a_rank8-b_rank1"


def test_names_are_safe_unique_and_the_same_every_time():
    grid = {"grid": {"adapter.alpha": [16, 32], "train.batch_size": [4, 8]}}
    block = {**grid, "zip": [{"train.warmup_ratio": [0.0, 0.1]}], **RANDOM, "seeds": [1, 2]}
    sweep = expand(block, "exp")
    names = [f"exp-{p.suffix}" for p in sweep.points]
    assert len(names) == 4 * 2 * 40 * 2
    assert all(SAFE_NAME.fullmatch(name) for name in names)
    assert len({name.casefold() for name in names}) == len(names)
    assert names == [f"exp-{p.suffix}" for p in expand(block, "exp").points]


def test_a_points_name_comes_from_its_own_values_never_from_its_neighbours():
    # Before: repeats got _2, _3 in order of appearance, so inserting a value earlier renamed the finished
    # points after it (their runs refused, their old configs planned again).
    block = {"grid": {"model.name_or_path": ["org1/m", "org2/m", "M"]}}
    names = {p.values["model.name_or_path"]: p.suffix for p in expand(block, "exp").points}
    assert len(set(names.values())) == 3 and names["M"] == "mM"
    inserted = {"grid": {"model.name_or_path": ["org0/m", "org2/m", "M", "org1/m"]}}
    again = {p.values["model.name_or_path"]: p.suffix for p in expand(inserted, "exp").points}
    assert {k: again[k] for k in names} == names
    alone = {v: expand({"grid": {"model.name_or_path": [v]}}, "exp").points[0].suffix for v in names}
    assert alone == names


def test_equal_random_draws_are_one_run_and_refused_not_numbered():
    # Before: r8, r8_2, r8_3... identical runs under three names.
    block = {"random": {"adapter.rank": {"choice": [4, 8]}}, "samples": 6}
    with pytest.raises(SweepError) as refused:
        expand(block, "exp")
    assert "are the same values" in str(refused.value.errors)


def test_only_the_points_whose_names_would_be_too_long_drop_their_labels():
    name = "e" * 50  # leaves 13 characters: 'lr1e-04-r8-s1' fits, 'lr1e-04-r16-s1' does not
    sweep = expand({**LR_BY_RANK, "seeds": [1]}, name)
    assert [p.suffix for p in sweep.points] == [
        "lr1e-04-r8-s1",
        "1e-04-16-s1",
        "lr3e-04-r8-s1",
        "3e-04-16-s1",
    ]
    assert [p.point for p in sweep.points] == ["lr1e-04-r8", "1e-04-16", "lr3e-04-r8", "3e-04-16"]


def test_names_too_long_even_without_labels_are_their_values_hash_whatever_the_order():
    files = [f"/data/a_rather_long_training_file_name_v{n}.jsonl" for n in range(12)]
    name = "e" * 40
    sweep = expand({"grid": {"data.train": files}, "seeds": [1, 2]}, name)
    names = [f"{name}-{p.suffix}" for p in sweep.points]
    assert all(SAFE_NAME.fullmatch(n) for n in names)
    assert len(set(names)) == 24
    assert re.fullmatch(r"h[0-9a-f]{6}-s1", sweep.points[0].suffix)
    assert sweep.points[0].point == sweep.points[1].point
    backwards = expand({"grid": {"data.train": files[::-1]}, "seeds": [1, 2]}, name)
    assert {p.suffix for p in backwards.points} == {p.suffix for p in sweep.points}


def test_an_experiment_name_with_no_room_left_is_reported_with_the_length_to_cut_to():
    ((path, message),) = problems_of({**LR_BY_RANK, "seeds": [1]}, "e" * 60)
    assert path == ()
    assert "shorten" in message and "60 characters" in message


# Problems


def test_a_block_that_is_not_a_mapping_is_refused():
    assert paths_of([1, 2]) == [()]


def test_an_empty_sweep_is_refused_as_varying_nothing():
    assert paths_of({}) == [()]
    assert paths_of({"select": {"metric": "eval_loss", "mode": "min"}}) == [()]


def test_an_unknown_key_suggests_the_one_meant():
    message = message_at({**LR_BY_RANK, "sed": [1, 2]}, ("sed",))
    assert "did you mean 'seed'" in message


def test_grid_values_must_be_non_empty_lists_of_plain_values():
    block = {"grid": {"adapter.rank": 8, "adapter.alpha": [], "adapter.dropout": [{"a": 1}]}}
    problems = dict(problems_of(block))
    assert set(problems) == {("grid", "adapter.rank"), ("grid", "adapter.alpha"), ("grid", "adapter.dropout")}
    assert "[8]" in problems[("grid", "adapter.rank")]


def test_a_value_listed_twice_is_refused_but_1_and_1_0_are_different_settings():
    assert paths_of({"grid": {"adapter.rank": [8, 8]}}) == [("grid", "adapter.rank")]
    assert len(expand({"grid": {"train.epochs": [1, 1.0]}}, "exp").points) == 2


def test_zip_must_be_a_list_of_mappings():
    assert paths_of({"zip": {"train.epochs": [1, 2]}}) == [("zip",)]
    assert paths_of({"zip": [{"train.epochs": [1, 2]}, [1, 2]]}) == [("zip", 1)]


def test_a_key_swept_in_two_places_is_reported_where_it_repeats():
    block = {
        "grid": {"train.learning_rate": [1e-4, 3e-4]},
        "zip": [{"train.epochs": [1, 2]}, {"train.epochs": [3, 4]}],
        "random": {"train.learning_rate": {"loguniform": [1e-5, 1e-3]}},
        "samples": 2,
    }
    assert paths_of(block) == [("zip", 1, "train.epochs"), ("random", "train.learning_rate")]


def test_a_key_inside_another_swept_key_is_refused():
    block = {"grid": {"train": ["x", "y"], "train.epochs": [1, 2]}}
    assert paths_of(block) == [("grid", "train.epochs")]


def test_malformed_dotted_keys_are_refused():
    block = {"grid": {"train..epochs": [1, 2], ".rank": [1, 2], "alpha.": [1, 2], "name": ["a", "b"]}}
    assert paths_of(block) == [("grid", key) for key in block["grid"]]


def test_select_is_kept_and_checked():
    select = {"metric": "eval_loss", "mode": "min"}
    assert expand({**LR_BY_RANK, "select": select}, "exp").select == SweepSelect(
        metric="eval_loss", mode="min"
    )
    assert paths_of({**LR_BY_RANK, "select": "eval_loss"}) == [("select",)]
    assert paths_of({**LR_BY_RANK, "select": {"metric": "", "mode": "lowest", "metrc": "x"}}) == [
        ("select", "metrc"),
        ("select", "metric"),
        ("select", "mode"),
    ]
    # A missing key is reported at that key, on the line of the mapping it is missing from.
    assert problems_of({**LR_BY_RANK, "select": {"metric": "rouge_l"}}) == [
        (("select", "mode"), "is required but missing")
    ]


def test_every_problem_is_reported_at_once_not_only_the_first():
    block = {
        "gird": {},
        "grid": {"adapter.rank": []},
        "zip": [{"train.epochs": [1, 2], "train.warmup_ratio": [0.0]}],
        "random": {"train.dropout": {"normal": [0, 1]}},
        "seeds": [1, 1],
        "select": {"metric": "eval_loss", "mode": "least"},
    }
    assert paths_of(block) == [
        ("gird",),
        ("grid", "adapter.rank"),
        ("zip", 0),
        ("random", "train.dropout"),
        ("random",),  # no samples
        ("seeds",),
        ("select", "mode"),
    ]


def test_a_key_swept_twice_is_still_reported_beside_another_sections_mistake():
    # Pydantic checks across fields only once all are valid; the sweep checks the valid sections anyway.
    block = {"sed": 1, **LR_BY_RANK, "random": {"adapter.rank": {"choice": [4, 8]}}, "samples": 2}
    assert paths_of(block) == [("sed",), ("random", "adapter.rank")]


def test_more_than_the_cap_of_points_is_refused_saying_how_many():
    block = {"grid": {"a.x": list(range(10)), "a.y": list(range(10))}, "seeds": list(range(11))}
    ((path, message),) = problems_of(block)
    assert path == ()
    assert "1100" in message and str(MAX_POINTS) in message
    block = {"grid": {"a.x": list(range(10)), "a.y": list(range(10))}, "seeds": list(range(10))}
    assert len(expand(block, "exp").points) == MAX_POINTS


def test_a_huge_random_sample_count_is_refused_before_drawing():
    assert paths_of({**RANDOM, "samples": 10**9}) == [()]


# nested()


def test_nested_turns_dotted_keys_into_sections_to_merge():
    values = {"train.learning_rate": 1e-4, "train.seed": 1, "adapter.rank": 8, "a.b.c": [1]}
    assert nested(values) == {
        "train": {"learning_rate": 1e-4, "seed": 1},
        "adapter": {"rank": 8},
        "a": {"b": {"c": [1]}},
    }


def test_nested_gives_each_point_its_own_lists():
    values = {"adapter.target_modules": ["q_proj", "v_proj"]}
    tree = nested(values)
    tree["adapter"]["target_modules"].append("k_proj")
    assert values["adapter.target_modules"] == ["q_proj", "v_proj"]


def test_nested_refuses_a_key_inside_a_value():
    with pytest.raises(ValueError):
        nested({"train": 1, "train.seed": 2})


@pytest.mark.parametrize(
    ("block", "name", "before"),
    [  # names the code before stable names gave (recorded from it): run roots launched then hold them
        ({"grid": {"model.name_or_path": ["org1/m", "org2/m", "M"]}}, "exp", ["mm", "mm_2", "mM_3"]),
        (
            {"grid": {"data.prompt_template": ["Q: {q} ->", "{q} | SQL:"]}},
            "tpl",
            ["prompt_templateQ___q____", "prompt_template_q____SQL_"],
        ),
        ({**LR_BY_RANK, "seeds": [1]}, "e" * 50, ["1e-04-8-s1", "1e-04-16-s1", "3e-04-8-s1", "3e-04-16-s1"]),
        (
            {
                "grid": {
                    "data.train": [f"/data/a_rather_long_training_file_name_v{n}.jsonl" for n in range(3)]
                },
                "seeds": [1, 2],
            },
            "e" * 40,
            ["p1-b836a6-s1", "p1-b836a6-s2", "p2-92dbc7-s1", "p2-92dbc7-s2", "p3-0836e1-s1", "p3-0836e1-s2"],
        ),
    ],
)
def test_each_point_knows_the_name_it_had_before_names_were_stable(block, name, before):
    assert [p.legacy for p in expand(block, name).points] == before


def test_values_whose_texts_differ_only_in_case_are_refused_naming_both():
    # One folder holds both on a case-insensitive disk (a laptop's local backend).
    with pytest.raises(SweepError) as refused:
        expand({"grid": {"model.name_or_path": ["abc", "ABC"]}}, "exp")
    assert "differ only in case" in str(refused.value.errors) and "exp-mabc" in str(refused.value.errors)


def test_list_values_whose_items_hold_underscores_keep_names_of_their_own():
    # Joined by '_', ["q_proj"] and ["q", "proj"] would both read q_proj.
    points = expand({"grid": {"adapter.target_modules": [["q_proj"], ["q", "proj"]]}}, "exp").points
    assert len({p.suffix for p in points}) == 2
