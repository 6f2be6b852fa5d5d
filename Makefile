# fusetune: the two entry points are `make demo` and `make test` (see README.md).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: install demo test test-gpu lint serve worker bench

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev,tracking]"
	touch $@

install: $(VENV)/.installed

# Starts the embedded service, fine-tunes the bundled tiny model through the HTTP API, loads the result.
demo: install
	$(VENV)/bin/fusetune demo

# The whole suite. Triton kernels run under TRITON_INTERPRET=1 when there is no GPU (tests/conftest.py).
# Two pytest workers (pytest-xdist), each test sent to whichever is free: on a 2-core machine about 16 minutes
# of pytest where one worker takes 22.5 (the interpreted kernels and the trainer processes each use a core).
test: install
	$(PY) -m pytest -q --timeout=900 -n 2 --dist worksteal --durations=25

# On a GPU machine: the kernel tests at real sizes and under torch.compile.
test-gpu:
	$(PY) -m pytest -q -m gpu tests

lint: install
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

serve: install
	$(VENV)/bin/fusetune serve

worker: install
	$(VENV)/bin/fusetune worker
