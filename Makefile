# The two commands of the README, and what they need.
#   make demo   run every demo experiment (--all on configs/demo): on the dev SLURM cluster if one is
#               up (sbatch on PATH), else locally
#   make test   start the dev SLURM cluster and run the whole test suite against it
#   make test-fast   the tests that need no cluster (a developer's loop)
PY      := .venv/bin/python
STATE   ?= /tmp/slurm-lora-dev
TORCH   ?= torch==2.13.0

.PHONY: demo test test-fast venv cluster cluster-down lint docs docs-serve

venv: .venv/.installed
.venv/.installed: pyproject.toml
	python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: a bare `torch` would pull a multi-GB CUDA build on a CPU machine.
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

models/.built: venv demo/tiny.py
	$(PY) -m demo.tiny models
	touch $@

demo: venv models/.built
	$(PY) launch.py --all --config-dir configs/demo --wait

cluster:
	bash slurm/dev-cluster/up.sh $(STATE)

cluster-down:
	bash slurm/dev-cluster/down.sh $(STATE)

# Two pytest-xdist workers: the cluster tests in order on one (tests/conftest.py groups them), the rest on
# the other and on the first when it is free. The tiny models are built before the workers start.
test: venv models/.built cluster
	SLURM_DEV_STATE=$(STATE) $(PY) -m pytest -q -n 2 --dist loadgroup

# The developer's loop, under two minutes: every test that needs no SLURM cluster and takes under a second
# (`slow` marks the rest: end-to-end runs, DDP, resumes, anything over 1 s in --durations=0; make test runs them).
test-fast: venv models/.built
	$(PY) -m pytest -q -n 2 -m "not cluster and not slow" -p no:cacheprovider

# The docs site (mkdocs.yml): built strictly into site/, or served with live reload at http://127.0.0.1:8000.
docs: venv
	$(PY) -m mkdocs build --strict -q

docs-serve: venv
	$(PY) -m mkdocs serve

lint: venv
	$(PY) -m ruff check . && $(PY) -m ruff format --check .
