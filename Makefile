# lightning_rollout developer commands. Every target creates .venv on first use.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
CONSTRAINTS ?= .ci/constraints.txt
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
# test processes of `make test` (pytest-xdist; a file's tests stay in one process, `serial` ones run alone)
TEST_JOBS ?= auto
# the end-to-end bench's own venv (MuJoCo, Stable-Baselines3), so .venv keeps matching CI
E2E_VENV ?= build/venv-e2e
E2E_PY := $(E2E_VENV)/bin/python
E2E_STAMP := $(E2E_VENV)/.installed
E2E_OUT ?= benchmarks/results/e2e
E2E_ARGS ?=

.PHONY: help install test test-slow demo docs bench bench-quick bench-real bench-gpu bench-scaling bench-e2e bench-e2e-quick clean

help:
	@echo "make demo       train PPO on CartPole for a short budget, TensorBoard logs + learning curve"
	@echo "make test       run the test suite (creates .venv and installs on first use)"
	@echo "make test-slow  end-to-end learning runs (PPO to the 475 bar); minutes"
	@echo "make docs       build the Sphinx docs (warnings are errors) into docs/_build/html"
	@echo "make bench      benchmarks against the peers; writes benchmarks/results/"
	@echo "make bench-real the same on real envs (MuJoCo HalfCheetah, ALE Pong, envpool); installs the bench-real extra"
	@echo "make bench-gpu  the heavy-policy scenario with every policy on the GPU (needs a CUDA build of torch)"
	@echo "make bench-scaling  1-16 worker processes on a GIL-bound env (for a machine with 16 cores or more)"
	@echo "make bench-e2e  whole PPO and SAC training runs on MuJoCo against Stable-Baselines3 and TorchRL's Collector;"
	@echo "                hours (3 seeds); its own venv $(E2E_VENV); writes $(E2E_OUT) (bench-e2e-quick: a 1-minute smoke run)"

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c $(CONSTRAINTS) -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -m "not slow" -n $(TEST_JOBS) --dist loadfile $(PYTEST_ARGS)

test-slow: $(STAMP)
	$(PY) -m pytest -m slow -p no:cacheprovider $(PYTEST_ARGS)

demo: $(STAMP)
	$(PY) examples/ppo_cartpole.py --demo --out runs/demo

docs: $(STAMP)
	$(VENV)/bin/sphinx-build -W --keep-going -b html docs docs/_build/html

bench: $(STAMP)
	$(PY) -m benchmarks --out benchmarks/results

bench-real: $(STAMP)
	$(PIP) install -q -c $(CONSTRAINTS) -e '.[bench-real]'
	$(PY) -m benchmarks --group real --out benchmarks/results/real

bench-gpu: $(STAMP)
	$(PY) -m benchmarks --scenario heavy_policy --policy-device cuda --out benchmarks/results/gpu

bench-scaling: $(STAMP)
	$(PY) -m benchmarks --group scaling --out benchmarks/results/scaling

$(E2E_STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(E2E_PY) || $(PYTHON) -m venv $(E2E_VENV)
	$(E2E_VENV)/bin/pip install -q --upgrade pip
	$(E2E_VENV)/bin/pip install -q -c $(CONSTRAINTS) -e '.[dev,e2e]'
	touch $(E2E_STAMP)

bench-e2e: $(E2E_STAMP)
	$(E2E_PY) -m benchmarks.e2e --out $(E2E_OUT) $(E2E_ARGS)

bench-e2e-quick: $(E2E_STAMP)
	$(E2E_PY) -m benchmarks.e2e --quick --out benchmarks/results/e2e-quick

bench-quick: $(STAMP)
	$(PY) -m benchmarks --quick --out benchmarks/results/quick

clean:
	rm -rf $(VENV) $(E2E_VENV) docs/_build runs lightning_logs .pytest_cache .hypothesis
