"""What a job may import and how many threads a local job computes with, decided before it imports
anything (train/libraries.py, slurm/queueing/backends.py local_threads). A real LoRA job's and eval job's
imports are read from their logs in tests/test_e2e_demo.py (the local demo run)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from slurm.queueing.backends import local_threads
from train.libraries import unused_libraries


@pytest.mark.parametrize(
    ("spec", "hidden"),
    [
        ({"adapter": {"method": "lora"}}, ("bitsandbytes",)),
        ({"adapter": {}}, ("bitsandbytes",)),  # the schema's default method is lora
        ({"adapter": {"method": "qlora"}}, ()),  # QLoRA trains (and is evaluated) on a 4-bit base
        ({"stage_dir": "runs/x/train", "out_dir": "runs/x/export"}, ()),  # an export: nothing hidden
        ({"adapter": None}, ()),
    ],
)
def test_only_a_plain_lora_job_gives_up_bitsandbytes_so_qlora_never_loses_it(spec, hidden):
    assert unused_libraries(spec) == hidden


@pytest.mark.slow  # a fresh process importing peft: ~4 s
def test_a_hidden_library_looks_uninstalled_to_peft_and_transformers_in_a_fresh_process():
    """The mechanism train/libraries.py relies on, in the libraries as installed: find_spec answers None
    (peft's and transformers' availability checks), and peft then imports without it."""
    code = (
        "import importlib.util, sys\n"
        "from train.libraries import hide\n"
        "hide(('bitsandbytes',))\n"
        "import peft\n"
        "from peft.import_utils import is_bnb_available\n"
        "from transformers.utils import is_bitsandbytes_available\n"
        "print(importlib.util.find_spec('bitsandbytes'), is_bnb_available(), is_bitsandbytes_available(),"
        " sys.modules['bitsandbytes'])\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["None", "False", "False", "None"]


@pytest.mark.parametrize(
    ("cpus", "tasks", "cores", "threads"),
    [
        (1, 1, 2, 1),  # the demo's one CPU on a 2-core machine: not torch's default of every core
        (8, 1, 2, 2),  # asked for more than the machine has: its cores
        (8, 2, 16, 4),  # two ranks share the job's CPUs, as SLURM's --cpus-per-task splits them
        (4, 4, 2, 1),  # never below one
    ],
)
def test_a_local_job_computes_with_its_own_cpus_not_every_core_of_the_machine(cpus, tasks, cores, threads):
    assert local_threads(cpus, tasks, cores) == threads
