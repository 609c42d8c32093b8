"""README.md is a front page and docs/ a site (mkdocs.yml): the front page stays short enough to read, and
the site builds strictly, so a broken link or a page left out of the navigation fails the suite."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_readme_is_a_front_page_of_at_most_300_lines_and_3000_words_with_the_ci_test_command():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 300 and len(text.split()) <= 3000
    assert "make test " in text and "make demo " in text  # the two set-up commands; CI runs `make test`


def test_the_docs_site_builds_strictly_without_a_broken_link(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "site" / "reference" / "configuration" / "index.html").is_file()
