"""Content hashes, one way everywhere: a run folder's identity (a job's config hash, an eval's, an export's)
and the cache keys of the login node and the trainer.

A value is hashed as its JSON text (keys sorted, anything JSON cannot say written as str()), SHA-256, cut
to a number of hex digits. Changing any of this changes every identity: each finished run would look
changed and run again, so the text hashed must stay byte for byte what it is (tests/test_hashing.py).
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

IDENTITY_CHARS = 16  # a config hash (DONE, job.json), an eval's and an export's identity
CACHE_KEY_CHARS = 20  # preflight's cache, the token counts and splits book, the tokenized-data cache
IDENTITY = re.compile(rf"[0-9a-f]{{{IDENTITY_CHARS}}}")


def content_hash(value, chars: int = IDENTITY_CHARS) -> str:
    """The first `chars` hex digits of the SHA-256 of `value`'s JSON (sort_keys, default=str)."""
    text = json.dumps(value, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:chars]


def file_fingerprint(path: str | Path) -> str:
    """SHA-256 of a file's content: a copy hits a cache keyed by it, an edit within the same second does not
    (a modification time would). The token cache and preflight's cache key a local data file by it."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
