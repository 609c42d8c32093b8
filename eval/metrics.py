"""Text metrics over (prediction, reference) pairs; every score is a fraction in [0, 1].

Empty inputs score 0.0 (an eval on no examples must still write its results), mismatched lengths are a
bug upstream and raise.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Sequence

import sacrebleu
from rouge_score import rouge_scorer

from core.names import TEXT_METRICS

SQL_START = re.compile(r"\s*(select|with)\b", re.IGNORECASE)
SQL_STRING = re.compile(r"'(?:[^']|'')*'")  # a single-quoted literal, '' escaping a quote inside


def normalize(text: str) -> str:
    """What exact match compares: case and runs of whitespace are formatting, not content."""
    return " ".join(text.split()).lower()


def normalize_sql(query: str) -> str:
    """As normalize, except inside string literals: `name = 'Atlas'` and `name = 'atlas'` select
    different rows, while keywords and identifiers (case-insensitive in SQL) may differ in case."""
    parts, end = [], 0
    for literal in SQL_STRING.finditer(query):
        parts += [normalize(query[end : literal.start()]), literal.group()]
        end = literal.end()
    parts.append(normalize(query[end:]))
    return " ".join(part for part in parts if part)


def exact_match_key(reference: str):
    """The normalizer for one pair, chosen by its reference: a query (SELECT/WITH ...) keeps the case of
    its string literals; any other text folds case."""
    return normalize_sql if SQL_START.match(reference) else normalize


def check_pairs(preds: Sequence[str], refs: Sequence[str]) -> None:
    if len(preds) != len(refs):
        raise ValueError(f"{len(preds)} predictions but {len(refs)} references: they must pair up")


def mean(values: Sequence[float]) -> float:
    """The report's mean of per-example scores (0.0 over nothing); a GRPO reward's mean equals it."""
    return sum(values) / len(values) if values else 0.0


def exact_match_each(preds: Sequence[str], refs: Sequence[str]) -> list[float]:
    """1.0 for each prediction equal to its reference (normalized), else 0.0: exact_match per example."""
    check_pairs(preds, refs)
    return [float(exact_match_key(r)(p) == exact_match_key(r)(r)) for p, r in zip(preds, refs, strict=True)]


def exact_match(preds: Sequence[str], refs: Sequence[str]) -> float:
    return mean(exact_match_each(preds, refs))


ROUGE_KEYS = {"rouge1": "rouge_1", "rouge2": "rouge_2", "rougeL": "rouge_l"}


def rouge_each(preds: Sequence[str], refs: Sequence[str]) -> dict[str, list[float]]:
    """F-measure of ROUGE-1, ROUGE-2 and ROUGE-L per example (rouge_score's tokenizer: lowercase,
    alphanumerics)."""
    check_pairs(preds, refs)
    scorer = rouge_scorer_once()
    each: dict[str, list[float]] = {name: [] for name in ROUGE_KEYS.values()}
    for pred, ref in zip(preds, refs, strict=True):
        scores = scorer.score(ref, pred)  # (target, prediction): the order matters for precision/recall
        for key, name in ROUGE_KEYS.items():
            each[name].append(scores[key].fmeasure)
    return each


@functools.cache
def rouge_scorer_once() -> rouge_scorer.RougeScorer:
    """One scorer per process (a GRPO stage scores every step). No stemming: scores stay comparable with the
    published numbers we report against."""
    return rouge_scorer.RougeScorer(list(ROUGE_KEYS), use_stemmer=False)


def rouge(preds: Sequence[str], refs: Sequence[str]) -> dict[str, float]:
    """Mean F-measure of ROUGE-1, ROUGE-2 and ROUGE-L over the examples."""
    return {name: mean(values) for name, values in rouge_each(preds, refs).items()}


def bleu(preds: Sequence[str], refs: Sequence[str]) -> float:
    """Corpus BLEU-4 (sacrebleu defaults). A prediction shorter than 4 tokens has no 4-grams, so a corpus
    of only such pairs scores ~0 even when they match exactly."""
    check_pairs(preds, refs)
    if not preds:
        return 0.0
    score = sacrebleu.corpus_bleu(list(preds), [list(refs)]).score / 100
    return min(1.0, max(0.0, score))  # float noise puts a perfect corpus at 1.0000000000000004


def text_metrics(preds: Sequence[str], refs: Sequence[str], names: Iterable[str]) -> dict[str, float]:
    """The named metrics; "rouge" gives rouge_1, rouge_2 and rouge_l, "rouge_l" only rouge_l."""
    names = list(names)
    unknown = [name for name in names if name not in TEXT_METRICS]
    if unknown:
        raise ValueError(f"unknown text metric(s) {', '.join(unknown)}; valid: {', '.join(TEXT_METRICS)}")
    check_pairs(preds, refs)
    results: dict[str, float] = {}
    if "exact_match" in names:
        results["exact_match"] = exact_match(preds, refs)
    if "rouge" in names or "rouge_l" in names:
        scores = rouge(preds, refs)
        results.update(scores if "rouge" in names else {"rouge_l": scores["rouge_l"]})
    if "bleu" in names:
        results["bleu"] = bleu(preds, refs)
    return results
