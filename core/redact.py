"""Keep secrets (HF_TOKEN, WANDB_API_KEY, …) out of shared files and job logs.

A token belongs in the environment, which sbatch passes to the job: never in `configs/cluster.yaml`, whose
`setup` lines are copied into every job's submission script under `logs/`, and never in a log line, which
anyone who can read the log folder sees.
"""

from __future__ import annotations

import logging
import os
import re
import sys

# Whole name parts only: HF_TOKEN and AWS_SECRET_ACCESS_KEY are secrets, TOKENIZERS_PARALLELISM is not.
SECRET_NAME = re.compile(
    r"(?:^|_)(?:TOKEN|SECRET|PASSWORD|PASSWD|API_?KEY|ACCESS_KEY|PRIVATE_KEY)(?:_|$)", re.IGNORECASE
)
SHELL_ASSIGNMENT = re.compile(r"^\s*(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=(\S*)")
MASK = "***"


def literal_secret(line: str) -> str | None:
    """The variable name if a shell line sets a secret-named variable to a literal (not `$OTHER`)."""
    match = SHELL_ASSIGNMENT.match(line)
    if match and SECRET_NAME.search(match.group(1)) and match.group(2).strip("'\"")[:1] not in ("", "$"):
        return match.group(1)
    return None


def secret_values(environ=os.environ) -> list[str]:
    """Values of secret-named variables, longest first (so a token containing another is masked whole).
    Short values are left alone: masking "1" or "true" everywhere would garble the log, not protect it."""
    values = {v for k, v in environ.items() if SECRET_NAME.search(k) and len(v) >= 8}
    return sorted(values, key=len, reverse=True)


class RedactingStream:
    """A text stream that masks secrets in what is written, and passes everything else (fileno, isatty,
    encoding, flush) to the stream it wraps."""

    def __init__(self, stream, secrets: list[str]):
        self._stream = stream
        self._secrets = secrets

    def write(self, text: str) -> int:
        for secret in self._secrets:
            text = text.replace(secret, MASK)
        return self._stream.write(text)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def redact_job_output(environ=os.environ) -> None:
    """From here on, this process's stdout, stderr and every logging handler writing to them mask the
    values of secret-named environment variables (what print, logging and tracebacks write)."""
    secrets = secret_values(environ)
    if not secrets or isinstance(sys.stderr, RedactingStream):
        return
    wrapped = {}
    for name in ("stdout", "stderr"):
        original = getattr(sys, name)
        wrapped[id(original)] = RedactingStream(original, secrets)
        setattr(sys, name, wrapped[id(original)])
    # Handlers made earlier (submitit's own logger) hold the original streams: point them at the wrappers.
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    for logger in loggers:
        for handler in getattr(logger, "handlers", []):
            if isinstance(handler, logging.StreamHandler) and id(handler.stream) in wrapped:
                handler.setStream(wrapped[id(handler.stream)])
