"""One module per verb of launch.py (slurm/cli.py's table names which): a verb is read in one file.

launch.py    --all/--exp, --dry-run, --preflight, --calibrate, --retry-failed
watch.py     --status, --tail (and what they share with --cancel: the experiments the run root holds)
cancel.py    --cancel, --cancel --removed
report.py    --report (and the report a finished local or --wait launch writes)
export.py    --export
sync.py      --sync
"""
