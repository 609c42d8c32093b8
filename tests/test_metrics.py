"""Text metrics against values worked out by hand (token counts and LCS in the comments)."""

from __future__ import annotations

import math

import pytest

from eval.metrics import bleu, exact_match, normalize, normalize_sql, rouge, text_metrics

# pred: the cat sat on the mat (6 tokens)    ref: the cat is on mat (5 tokens)
#   unigram overlap: the, cat, on, mat = 4          -> P 4/6, R 4/5, F 8/11
#   bigram overlap: "the cat" = 1 of 5 and 4        -> P 1/5, R 1/4, F 2/9
#   LCS: the cat on mat = 4                         -> F 8/11
CAT = ("the cat sat on the mat", "the cat is on mat")
# Same words, reversed: all unigrams match, no bigram does, the LCS is 1 token of 4.
REVERSED = ("a b c d", "d c b a")


def test_normalize_folds_case_and_whitespace():
    assert normalize("  The\tCat \n sat ") == "the cat sat"


def test_sql_exact_match_keeps_the_case_inside_string_literals():
    # A real model's eval scored EM above execution accuracy because 'Atlas' = 'atlas' here.
    assert (
        exact_match(["SELECT name FROM t WHERE name = 'atlas'"], ["select NAME from t where name = 'Atlas'"])
        == 0
    )
    assert (
        exact_match(
            ["SELECT  name FROM t WHERE name = 'Atlas'"], ["select name\nfrom t where name = 'Atlas'"]
        )
        == 1
    )
    assert normalize_sql("SELECT 'It''s A'  ,X") == "select 'It''s A' ,x"
    assert normalize_sql("WITH a AS (SELECT 1) SELECT * FROM a WHERE s = 'Q  R'") == (
        "with a as (select 1) select * from a where s = 'Q  R'"
    )
    assert exact_match(["It's the CAPITAL"], ["it's the capital"]) == 1  # text is not SQL: case folds


def test_exact_match_ignores_case_and_spacing_but_not_punctuation():
    preds = ["  The Cat\tsat ", "dog", "a b"]
    refs = ["the cat sat", "Dog!", "a  b"]
    assert exact_match(preds, refs) == pytest.approx(2 / 3)


def test_rouge_of_one_pair_by_hand():
    scores = rouge([CAT[0]], [CAT[1]])
    assert scores == pytest.approx({"rouge_1": 8 / 11, "rouge_2": 2 / 9, "rouge_l": 8 / 11})


def test_rouge_l_depends_on_order_rouge_1_does_not():
    scores = rouge([REVERSED[0]], [REVERSED[1]])
    assert scores == pytest.approx({"rouge_1": 1.0, "rouge_2": 0.0, "rouge_l": 0.25})


def test_rouge_is_the_mean_over_pairs():
    scores = rouge([CAT[0], REVERSED[0]], [CAT[1], REVERSED[1]])
    expected = {"rouge_1": (8 / 11 + 1) / 2, "rouge_2": (2 / 9) / 2, "rouge_l": (8 / 11 + 0.25) / 2}
    assert scores == pytest.approx(expected)


def test_rouge_ignores_case_and_punctuation():
    assert rouge(["The CAT!"], ["the cat"])["rouge_l"] == pytest.approx(1.0)


def test_bleu_identical_is_one_disjoint_is_zero():
    text = "the quick brown fox jumps over the lazy dog"
    assert bleu([text], [text]) == 1.0
    assert bleu(["one two three four five"], ["six seven eight nine ten"]) == 0.0


def test_bleu_brevity_penalty_by_hand():
    # Every n-gram of the prediction is in the reference (precisions 1), but 6 tokens against 8:
    # BLEU = BP = exp(1 - 8/6).
    assert bleu(["a b c d e f"], ["a b c d e f g h"]) == pytest.approx(math.exp(1 - 8 / 6), abs=1e-6)


def test_text_metrics_selects_keys():
    preds, refs = [CAT[0]], [CAT[1]]
    assert set(text_metrics(preds, refs, ["rouge"])) == {"rouge_1", "rouge_2", "rouge_l"}
    assert text_metrics(preds, refs, ["rouge_l"]) == pytest.approx({"rouge_l": 8 / 11})
    both = text_metrics(preds, refs, ["exact_match", "bleu"])
    assert set(both) == {"exact_match", "bleu"}
    assert both["exact_match"] == 0.0
    assert 0.0 < both["bleu"] < 1.0


def test_unknown_metric_names_the_valid_ones():
    with pytest.raises(ValueError, match="blue") as raised:
        text_metrics(["a"], ["a"], ["blue"])
    for valid in ("rouge", "rouge_l", "bleu", "exact_match"):
        assert valid in str(raised.value)


def test_empty_inputs_score_zero():
    assert text_metrics([], [], ["rouge", "bleu", "exact_match"]) == {
        "exact_match": 0.0,
        "rouge_1": 0.0,
        "rouge_2": 0.0,
        "rouge_l": 0.0,
        "bleu": 0.0,
    }


@pytest.mark.parametrize("metric", [exact_match, rouge, bleu])
def test_mismatched_lengths_raise(metric):
    with pytest.raises(ValueError, match="2 predictions but 1 references"):
        metric(["a", "b"], ["a"])
