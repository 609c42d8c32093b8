"""Helpers more than one test module uses (fixtures live in conftest.py)."""

from __future__ import annotations

import time


def wait_until(condition, what: str, timeout_s: float = 240):
    """Polls `condition` until it returns something truthy, and returns that; fails naming `what`. For a
    state another process reaches (a real job, a real launcher), never as a pause."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
