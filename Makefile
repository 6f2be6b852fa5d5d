# fusetune: the two entry points are `make demo` and `make test` (see README.md).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: install lock upgrade demo test test-gpu test-numerics-narrow lint serve worker bench

# The installs come from requirements.lock: every package, pinned with its hashes, as CI last passed with it,
# for any platform and Python >= 3.11 (uv's universal resolution). requirements-service.lock is the same
# versions without the dev extra, for the image: the tracking extra, and the ray extra so that one image serves
# as a Ray cluster's nodes as well (docker-compose.yml's `ray` profile, deploy/kubernetes/ray-cluster.yaml).
# `make lock` after a change to pyproject.toml's dependencies; `make upgrade` to move every pin to the newest
# release inside pyproject.toml's ranges.
LOCK := requirements.lock
SERVICE_LOCK := requirements-service.lock
COMPILE := pip compile pyproject.toml --generate-hashes --universal --python-version 3.11 --quiet

$(VENV)/.installed: pyproject.toml $(LOCK)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --require-hashes -r $(LOCK)
	$(PY) -m pip install -q --no-deps -e .
	touch $@

install: $(VENV)/.installed

lock: install
	$(VENV)/bin/uv $(COMPILE) --extra dev --extra tracking $(UPGRADE) -o $(LOCK)
	$(VENV)/bin/uv $(COMPILE) --extra tracking --extra ray -c $(LOCK) -o $(SERVICE_LOCK)

upgrade:
	$(MAKE) lock UPGRADE=--upgrade
	$(MAKE) test

# Starts the embedded service, fine-tunes the bundled tiny model through the HTTP API, loads the result.
demo: install
	$(VENV)/bin/fusetune demo

# The whole suite. Triton kernels run under TRITON_INTERPRET=1 when there is no GPU (tests/conftest.py).
# Two pytest workers (pytest-xdist), each test sent to whichever is free: on a 2-core machine about 16 minutes
# of pytest where one worker takes 22.5 (the interpreted kernels and the trainer processes each use a core).
test: install
	$(PY) -m pytest -q --timeout=900 -n 2 --dist worksteal --durations=25

# The numerical tests whose arithmetic goes through the CPU's math libraries (the fused linear cross-entropy,
# the sequence log-probs, the convergence runs, the trainer's equivalence tests) again on the narrow code paths:
# oneDNN, MKL and torch's own vectorised kernels without AVX-512 and AMX, whose matmuls and reductions sum in
# another order (and whose bf16 matmuls read K in pairs). On a CPU that has the wide
# instructions, `make test` took those; this takes the AVX2 ones, so one machine checks both (.ci/run).
# The selection is the marker `numerics` (tests/conftest.py's NUMERICS lists the modules and says why these).
test-numerics-narrow: install
	ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2 \
	  $(PY) -m pytest -q --timeout=900 -n 2 --dist worksteal -m numerics

# On a GPU machine: the kernel tests at real sizes and under torch.compile.
test-gpu:
	$(PY) -m pytest -q -m gpu tests

lint: install
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

serve: install
	$(VENV)/bin/fusetune serve

worker: install
	$(VENV)/bin/fusetune worker
