# Two commands on a fresh machine (only Python 3.11 needed):
#   make run    create .venv on first use, install, train the quickstart, print metrics
#   make test   create .venv on first use, install with test extras, run the tests
#   make test-fast   the unit tier only (tests/unit: no process, no CLI run, no training)
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
TORCH := torch==2.13.0
TORCHREC := torchrec==1.8.0
# The CUDA build of fbgemm when a GPU is visible, the CPU build otherwise.
FBGEMM := $(shell nvidia-smi -L >/dev/null 2>&1 && echo fbgemm-gpu==1.8.0 || echo fbgemm-gpu-cpu==1.8.0)
CONFIG ?= configs/criteo_quickstart.yaml
PYTEST_ARGS ?=

.PHONY: run test test-fast lint install clean

$(VENV)/.installed: pyproject.toml Makefile
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) (set PYTHON=...)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH) $(FBGEMM)
	@# compat: a plain path in site-packages, which mypy and pyright follow (they do not run the
	@# import hook of the default editable install, and would see no recsys_dist).
	$(PY) -m pip install --quiet -e '.[test]' --config-settings editable_mode=compat
	@# Last, and without its declared deps: torchrec's metadata names the CUDA build fbgemm-gpu.
	$(PY) -m pip install --quiet --no-deps $(TORCHREC)
	$(PY) -c "import recsys_dist, torchrec; print('recsys_dist environment ready')"
	touch $@

install: $(VENV)/.installed

run: $(VENV)/.installed
	$(VENV)/bin/recsys-dist train --config $(CONFIG)

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Test files run in parallel (pytest-xdist, one file per worker at a time; as many workers as
# cores, at most 4: 3 workers on 2 cores measured slower than 2). The 25 slowest tests are
# listed after each full run, for the suite's results files. Bytecode caches are written even
# where the environment sets PYTHONDONTWRITEBYTECODE (empty: unset), so the workers, the ranks
# and the CLI subprocesses read recsys_dist and the tests compiled once, not each from source
# (a collection took 8.5 s without them, 5.8 s with; a fresh clone's suite 9:45-9:57 against 9:12).
TEST_WORKERS ?= auto
test: lint
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -n $(TEST_WORKERS) --maxprocesses 4 --dist loadfile --durations=25 $(PYTEST_ARGS)

# The unit tier, for the edit loop: tests/unit/conftest.py fails any test there that starts a
# process, a CLI command, ranks or a training run (about 35-55 s on 2 cores).
test-fast: $(VENV)/.installed
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -n $(TEST_WORKERS) --maxprocesses 4 tests/unit $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache
