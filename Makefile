# Two entry points for a fresh machine; both set everything up first (a venv in .venv).
#   make demo   train the embedded demo (byte-level GPT on the Python stdlib sources) with zero_offload
#   make test   lint + the fast tier of the test suite (every module and public behaviour at small sizes)
# make test-slow runs the slow tier (tests marked @pytest.mark.slow: ranks and fresh interpreters, the docs'
# code blocks, models nobody here wrote, big sizes), make test-all both; CI (.ci/run) runs both tiers.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# constraints.txt pins torch 2.13.0: a CPU build from this machine kind's local wheel store; on a GPU
# machine pip takes the same release from PyPI with CUDA.
INSTALLED := $(VENV)/.installed
# The models nobody here wrote (transformers, litgpt): the slow tier's, half of a fresh set-up's time.
MODELS := $(VENV)/.installed-models

.PHONY: setup demo test test-slow test-all test-oldest lint bench clean

setup: $(INSTALLED)

$(INSTALLED): pyproject.toml setup.py constraints.txt $(wildcard native/*.c native/*.h native/*.py)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt torch==2.13.0
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[test,dev,plot]'
	$(BIN)/python -c "import lightning_zero_offload.kernels as k; print('CPU-Adam kernels:', k.backend())"
	touch $@

$(MODELS): $(INSTALLED)
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[test,dev,plot,models]'
	touch $@

demo: $(INSTALLED)
	$(BIN)/zero-offload fit --config configs/cpu_demo.yaml
	run=$$(ls -d runs/cpu_demo/version_* | sort -t_ -k2 -n | tail -1) && $(BIN)/python scripts/plot_logs.py $$run --out $$run

lint: $(INSTALLED)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

PYTEST := $(BIN)/python -m pytest -q --durations=25
# pyproject's addopts deselect the slow tier; -m overrides it.
test: lint
	$(PYTEST)

test-slow: $(MODELS)
	$(PYTEST) -m slow

test-all: test test-slow

# The oldest Lightning that pyproject admits, in a venv of its own, against the Trainer-level tests.
OLDEST_VENV ?= .venv-oldest
OLDEST_LIGHTNING := 2.5.0
test-oldest:
	test -x $(OLDEST_VENV)/bin/python || $(PYTHON) -m venv $(OLDEST_VENV)
	$(OLDEST_VENV)/bin/python -m pip install --quiet -c constraints.txt torch==2.13.0
	$(OLDEST_VENV)/bin/python -m pip install --quiet torch==2.13.0 lightning==$(OLDEST_LIGHTNING) \
		pytorch-lightning==$(OLDEST_LIGHTNING) -e . 'pytest>=7'
	$(OLDEST_VENV)/bin/python -m pytest -q -m 'slow or not slow' tests/trainer/test_strategy.py tests/trainer/test_precision.py \
		tests/test_cli.py

bench: $(MODELS)
	$(BIN)/python benchmarks/cpu_adam.py
	$(BIN)/python benchmarks/train_step.py

clean:
	rm -rf $(VENV) $(OLDEST_VENV) build *.egg-info lightning_zero_offload/_native*.so runs
