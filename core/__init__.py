"""The ground floor: the contract every layer shares, importing nothing of the project above it.

config (the experiment schema), names (metrics, splits, the SQL time limit), files (atomic writes, tolerant
reads), examples (reading data files), speeds (the speed book), problems (file:line errors), layout (the
names the pipeline gives its own files), rundir (the files of a run folder), job_records (job.json: every
scheduler job a run folder had), preflight (its result type).
Standard library, pydantic and PyYAML only: the login node imports all of it without torch.
tests/test_layers.py checks that nothing here imports train/, eval/ or slurm/.
"""
