"""BERTScore F1 (Zhang et al. 2020, the `bert-score` package): predictions and references compared in a
model's contextual embeddings, so a paraphrase scores near a copy where n-gram overlap does not.

    bertscore_f1(preds, refs, model="roberta-large")                 # raw: cosine similarity, ~[0, 1]
    bertscore_f1(preds, refs, model="roberta-large", rescale=True)   # rescaled with bert-score's baseline

The layer: bert-score's tuned layer for the models it knows (`roberta-large`: 17; also under an
organisation, `FacebookAI/roberta-large`), else the model's last layer. A local folder is not recognised by
its name, so a local copy of roberta-large scores with layer 24: name the hub id (fetched into the HF cache
on the node) for numbers comparable with published ones.

Rescaling maps a model's typical score for unrelated sentences to 0 (`(F - b) / (1 - b)`, b from the
baseline file bert-score ships for that model and layer, English only). It spreads scores out but can be
negative, and it needs a baseline: a model without one is an error, never a silently raw number.

An empty prediction or reference scores raw 0 (bert-score's own rule; applied here because bert-score cannot
encode an empty string under transformers 5). Imports torch (through bert-score) only when called, so
`python -m eval score` stays light until BERTScore is asked for.
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path

from eval.metrics import check_pairs

BASELINE_LANGUAGE = "en"


class BertScoreError(ValueError):
    """The scoring model cannot be used as asked (not found, or no rescaling baseline)."""


def bertscore_f1(
    preds: Sequence[str], refs: Sequence[str], model: str, rescale: bool = False, batch_size: int = 64
) -> float:
    """Mean BERTScore F1 over the pairs (0.0 for none)."""
    check_pairs(preds, refs)
    if not preds:
        return 0.0
    known = known_name(model)
    layers = tuned_layer(known) if known else last_layer(model)
    baseline = baseline_f1(model, known, layers) if rescale else None  # before the model loads: fail fast
    raw = raw_f1(list(preds), list(refs), model, layers, batch_size)
    mean = sum(raw) / len(raw)
    return (mean - baseline) / (1 - baseline) if baseline is not None else mean


def raw_f1(preds: list[str], refs: list[str], model: str, layers: int, batch_size: int) -> list[float]:
    """F1 per pair; pairs with an empty side are 0 without reaching the model."""
    from bert_score import score

    scored = [i for i, (p, r) in enumerate(zip(preds, refs, strict=True)) if p.strip() and r.strip()]
    f1 = [0.0] * len(preds)
    if not scored:
        return f1
    try:
        _, _, values = score(
            [preds[i] for i in scored],
            [refs[i] for i in scored],
            model_type=model,
            num_layers=layers,
            batch_size=batch_size,
        )
    except OSError as exc:  # transformers' "not a local folder and not on the hub (or offline)"
        raise BertScoreError(f"cannot load the BERTScore model {model!r}: {exc}") from None
    for i, value in zip(scored, values.tolist(), strict=True):
        f1[i] = value
    return f1


def known_name(model: str) -> str | None:
    """The name bert-score knows this hub id by, or None (a local folder, an unknown model)."""
    from bert_score.utils import model2layers

    if Path(model).is_dir():
        return None
    bare = model.split("/", 1)[-1]  # FacebookAI/roberta-large was roberta-large when bert-score tuned it
    return next((name for name in (model, bare) if name in model2layers), None)


def tuned_layer(known: str) -> int:
    from bert_score.utils import model2layers

    return model2layers[known]


def last_layer(model: str) -> int:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model).num_hidden_layers
    except OSError as exc:
        raise BertScoreError(f"cannot load the BERTScore model {model!r}: {exc}") from None


def baseline_f1(model: str, known: str | None, layers: int) -> float:
    """The F baseline bert-score ships for this model and layer."""
    path = baseline_folder() / f"{known}.tsv" if known else None
    if path is None or not path.is_file():
        raise BertScoreError(
            f"eval.bertscore_rescale: bert-score has no {BASELINE_LANGUAGE} baseline for {model!r} "
            "(it has them for hub ids such as roberta-large); set bertscore_rescale: false"
        )
    with path.open(newline="") as fh:
        rows = list(csv.DictReader(fh))
    return float(rows[layers]["F"])  # row K: layer K (row 0 is the embeddings)


def baseline_folder() -> Path:
    import bert_score

    return Path(bert_score.__file__).parent / "rescale_baseline" / BASELINE_LANGUAGE
