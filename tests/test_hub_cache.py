"""train/hub_cache.py: a node that lacks a hub model fails at once, naming the repo and the fetch command."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import hub_cache

LOAD = """
from core.config import ModelSpec
from train.device import Hardware, decide
from train.hub_cache import NotInCache
from train.model import load_base, load_tokenizer

spec = ModelSpec(name_or_path="Qwen/Qwen2.5-0.5B", kind="causal", revision={revision!r})
for load in (lambda: load_tokenizer(spec.name_or_path, spec), lambda: load_base(spec, None, decide(Hardware(), "fp32"))):
    try:
        load()
    except NotInCache as exc:
        print(exc)
"""


@pytest.mark.slow
def test_a_model_missing_offline_fails_with_its_repo_and_fetch_command(repo_root, tmp_path):
    """The cache holds Qwen's config.json only, as a login node that ran preflight without network would:
    tokenizer and weights are missing, and HF_HUB_OFFLINE=1 (conftest) makes any download fail at once."""
    env = os.environ | {"HF_HUB_CACHE": str(hub_cache(tmp_path / "hub"))}
    for revision, command in ((None, "hf download Qwen/Qwen2.5-0.5B"), ("v2", "--revision v2")):
        code = LOAD.format(revision=revision)
        done = subprocess.run(
            [sys.executable, "-c", code], cwd=repo_root, env=env, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
        lines = done.stdout.splitlines()
        assert len(lines) == 2, done.stdout  # the tokenizer, then the weights
        for line in lines:
            assert line.startswith("Qwen/Qwen2.5-0.5B is not in this machine's Hugging Face cache")
            assert line.endswith(command)
