"""core/hashing.py content_hash: the one content hash, byte for byte what the four copies it replaced gave
(`sha256(json.dumps(value, sort_keys=True, default=str))[:16]` for an identity, `[:20]` for a cache key,
and train/data.py's `json.dumps(parts)` without options): a run folder made before keeps its identity."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from core.hashing import CACHE_KEY_CHARS, IDENTITY, IDENTITY_CHARS, content_hash

# An identity as slurm/planning/plan.py builds one: nested dicts (keys out of order), a float, None, a Path (not
# JSON: written as str), a non-ASCII character (escaped by json.dumps).
SAMPLE = {
    "model": {"name_or_path": "google/flan-t5-small", "kind": "seq2seq"},
    "adapter": {"rank": 8, "alpha": 16.0},
    "data": {"train": Path("data/demo/sql/easy.jsonl"), "prompt_template": "{question} → SQL: "},
    "world_size": 2,
    "eval": None,
}


def old_expression(value, chars: int) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:chars]


def test_an_identity_is_the_hash_run_folders_already_hold():
    """Pinned: the value the old expression gave before the helper existed (a changed text or length
    would make every finished run look changed and run again)."""
    assert content_hash(SAMPLE) == old_expression(SAMPLE, 16) == "e042a5951dfcdf57"
    assert content_hash(SAMPLE, CACHE_KEY_CHARS) == old_expression(SAMPLE, 20) == "e042a5951dfcdf57964b"


def test_the_tokenized_data_cache_key_is_unchanged_without_the_json_options():
    """train/data.py hashed json.dumps(parts) without sort_keys or default: the same text for its list of
    an int and strings, so its cached token ids are still found."""
    parts = [2, "9f2c", "a1b2", "train", "{question} | SQL: ", "question", "sql"]
    old = hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:20]
    assert content_hash(parts, CACHE_KEY_CHARS) == old == "6621e8f28136d1a52d26"


def test_the_run_folder_reads_back_exactly_the_identities_it_is_given():
    """core/rundir.py tells a DONE holding a config hash from a torn one by IDENTITY: a length set in two
    places could drift and every DONE would read as unreadable."""
    assert IDENTITY.fullmatch(content_hash(SAMPLE)) and len(content_hash(SAMPLE)) == IDENTITY_CHARS
    assert not IDENTITY.fullmatch(content_hash(SAMPLE, CACHE_KEY_CHARS))
    assert not IDENTITY.fullmatch(content_hash(SAMPLE)[:-1])
