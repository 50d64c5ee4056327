# lightning_rollout developer commands. Every target creates .venv on first use.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
CONSTRAINTS ?= .ci/constraints.txt
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: help install test test-slow demo docs bench bench-quick bench-real bench-gpu bench-scaling clean

help:
	@echo "make demo       train PPO on CartPole for a short budget, TensorBoard logs + learning curve"
	@echo "make test       run the test suite (creates .venv and installs on first use)"
	@echo "make test-slow  end-to-end learning runs (PPO to the 475 bar); minutes"
	@echo "make docs       build the Sphinx docs (warnings are errors) into docs/_build/html"
	@echo "make bench      benchmarks against the peers; writes benchmarks/results/"
	@echo "make bench-real the same on real envs (MuJoCo HalfCheetah, ALE Pong, envpool); installs the bench-real extra"
	@echo "make bench-gpu  the heavy-policy scenario with every policy on the GPU (needs a CUDA build of torch)"
	@echo "make bench-scaling  1-16 worker processes on a GIL-bound env (for a machine with 16 cores or more)"

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c $(CONSTRAINTS) -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

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

bench-quick: $(STAMP)
	$(PY) -m benchmarks --quick --out benchmarks/results/quick

clean:
	rm -rf $(VENV) docs/_build runs lightning_logs .pytest_cache .hypothesis
