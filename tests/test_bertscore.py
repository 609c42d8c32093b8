"""BERTScore with a tiny BERT built here, offline: random weights, a 30-word WordPiece vocabulary, two layers.

Its scores mean nothing linguistically; what they show is the plumbing: the model folder is loaded, tokens
are matched, an identical pair scores 1 and beats unrelated pairs, and empty text does not crash.
"""

from __future__ import annotations

import json

import pytest

from eval import bertscore
from eval.__main__ import main
from eval.bertscore import BertScoreError, bertscore_f1
from eval.score import score

WORDS = [
    "the",
    "cat",
    "sat",
    "on",
    "mat",
    "dog",
    "ran",
    "in",
    "park",
    "a",
    "what",
    "is",
    "name",
    "of",
    "table",
    "select",
    "from",
    "where",
    "how",
    "many",
    "rows",
]


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory) -> str:
    import torch
    from transformers import BertConfig, BertModel, BertTokenizerFast

    folder = tmp_path_factory.mktemp("tiny-bert")
    vocab = folder / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    BertTokenizerFast(vocab_file=str(vocab), model_max_length=64).save_pretrained(folder)
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=5 + len(WORDS),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    BertModel(config).save_pretrained(folder)
    return str(folder)


def test_identical_pairs_score_one_and_beat_unrelated_pairs(tiny_bert):
    sentences = ["the cat sat on the mat", "how many rows in the table"]
    same = bertscore_f1(sentences, sentences, tiny_bert)
    unrelated = bertscore_f1(sentences, ["dog ran in a park", "what is the name of a cat"], tiny_bert)
    assert same == pytest.approx(1.0, abs=1e-5)
    assert unrelated < same - 0.01


def test_an_empty_prediction_scores_zero_instead_of_crashing(tiny_bert):
    # bert-score encodes "" with a tokenizer method transformers 5 no longer has: it raised AttributeError.
    assert bertscore_f1(["", "the cat sat"], ["the cat sat", "the cat sat"], tiny_bert) == pytest.approx(0.5)
    assert bertscore_f1([], [], tiny_bert) == 0.0


def test_rescaling_without_a_baseline_is_an_error_not_a_raw_score(tiny_bert):
    with pytest.raises(BertScoreError, match="no en baseline .* set bertscore_rescale: false"):
        bertscore_f1(["the cat"], ["the cat"], tiny_bert, rescale=True)


def test_rescaling_uses_the_tuned_layers_baseline_row(monkeypatch):
    # The model is replaced by a fixed raw score: only the layer choice and the arithmetic are under test.
    # roberta-large.tsv, row LAYER 17 (bert-score's tuned layer): F = 0.83122575.
    monkeypatch.setattr(bertscore, "raw_f1", lambda preds, refs, model, layers, batch: [0.9] * len(preds))
    baseline = 0.83122575
    for name in ("roberta-large", "FacebookAI/roberta-large"):
        value = bertscore_f1(["a"], ["b"], name, rescale=True)
        assert value == pytest.approx((0.9 - baseline) / (1 - baseline))
    assert bertscore_f1(["a"], ["b"], "roberta-large") == pytest.approx(0.9)  # raw unless asked


def test_score_writes_bertscore_f1_and_needs_a_model(tiny_bert):
    results = score(["the cat sat"], ["the cat sat"], ["exact_match", "bertscore"], bertscore_model=tiny_bert)
    assert list(results) == ["n", "exact_match", "bertscore_f1"]
    assert results["bertscore_f1"] == pytest.approx(1.0, abs=1e-5)
    with pytest.raises(ValueError, match="bertscore needs bertscore_model"):
        score(["a"], ["a"], ["bertscore"])


def test_bertscore_through_the_cli(tmp_path, tiny_bert, capsys):
    # In this process (eval's main, as `python -m eval` calls it): a subprocess would import torch again.
    (tmp_path / "p.jsonl").write_text(json.dumps({"id": 1, "prediction": "the cat sat"}) + "\n")
    (tmp_path / "r.jsonl").write_text(json.dumps({"id": 1, "reference": "the cat sat"}) + "\n")
    files = ["--predictions", str(tmp_path / "p.jsonl"), "--references", str(tmp_path / "r.jsonl")]

    def run(*args) -> tuple[int, str]:
        code = main(["score", *files, "--metrics", "bertscore", *args])
        return code, capsys.readouterr().err

    assert run("--bertscore-model", tiny_bert, "--out", str(tmp_path / "out.json"))[0] == 0
    assert json.loads((tmp_path / "out.json").read_text())["bertscore_f1"] == pytest.approx(1.0, abs=1e-5)
    code, err = run()
    assert code == 2 and "bertscore needs --bertscore-model" in err
    code, err = run("--bertscore-model", str(tmp_path / "no-such-model"))
    assert code == 2 and err.startswith("error: --bertscore-model: cannot load the BERTScore model")
