"""Secrets stay out of job logs: a job process masks secret-named environment values in everything it
prints or logs, and the cluster profile refuses literal tokens (tested in test_validation)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from core.redact import literal_secret, secret_values

TOKEN = "hf_ThisIsNotARealTokenButIsLong"


@pytest.mark.parametrize(
    ("line", "name"),
    [
        ("export HF_TOKEN=hf_abcdef", "HF_TOKEN"),
        ("WANDB_API_KEY='0123abcd'", "WANDB_API_KEY"),
        ('export DB_PASSWORD="x"', "DB_PASSWORD"),
        ("export HF_TOKEN=$HF_TOKEN", None),  # passing it on from the environment is fine
        ('export HF_TOKEN="${HF_TOKEN}"', None),
        ("export HF_HOME=/scratch/hf", None),
        ("export TOKENIZERS_PARALLELISM=false", None),
        ("export AWS_SECRET_ACCESS_KEY=abc/def", "AWS_SECRET_ACCESS_KEY"),
        ("module load cuda/12.4", None),
        ("source .venv/bin/activate", None),
    ],
)
def test_literal_secret_in_a_shell_line(line, name):
    assert literal_secret(line) == name


def test_only_secret_named_long_values_are_masked():
    environ = {
        "HF_TOKEN": TOKEN,
        "GH_TOKEN": TOKEN + "Longer",
        "MY_SECRET": "short",
        "PATH": "/usr/bin:/bin",
        "TOKENIZERS_PARALLELISM": "false-but-long",
    }
    assert secret_values(environ) == [TOKEN + "Longer", TOKEN]


def test_job_output_masks_secrets_in_prints_logs_and_tracebacks(repo_root):
    # A real Python process set up as a job is: submitit's logger exists before the redaction starts.
    script = textwrap.dedent(
        """
        import logging, os, submitit
        from core.redact import redact_job_output
        from slurm.queueing.jobs import _configure_logging
        redact_job_output()
        _configure_logging()
        token = os.environ["HF_TOKEN"]
        print("print:", token)
        logging.getLogger("train").warning("logging: %s", token)
        logging.getLogger("submitit").warning("submitit: " + token)
        raise RuntimeError("traceback: " + token)
        """
    )
    env = {**os.environ, "HF_TOKEN": TOKEN}
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=repo_root, env=env, capture_output=True, text=True
    )
    assert done.returncode == 1
    output = done.stdout + done.stderr
    assert TOKEN not in output
    for shown in ("print: ***", "logging: ***", "submitit: ***", "RuntimeError: traceback: ***"):
        assert shown in output, output
