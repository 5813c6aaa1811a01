# Two commands: `make train` and `make test` (with `make test-fast`, its quick
# tier). Each creates .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Reinstalled whenever pyproject.toml changes.
STAMP := $(VENV)/.installed

.PHONY: train test test-fast clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

# The default experiment; running it again resumes from its last checkpoint.
# ARGS adds flags (quoted when there are several) and WORKDIR moves it,
# e.g. a first look (its lines say how long each part takes):
#   make train WORKDIR=/tmp/smoke \
#       ARGS='--config.num_train_steps=20 --config.num_eval_steps=20'
WORKDIR ?= workdirs/lm_stdlib
ARGS ?=
train: $(STAMP)
	$(BIN)/python -m train.train --config=configs/lm_stdlib.py --workdir=$(WORKDIR) $(ARGS)

# Compilation dominates the suite: one worker per core (up to 4) halves it.
# The slowest tests are listed at the end, for the suite's time budget.
test: $(STAMP)
	$(BIN)/python -m pytest -n auto --maxprocesses=4 --durations=15

# The quick tier for the edit-test loop: the tests marked `core`.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -m core -p no:xdist

clean:
	rm -rf $(VENV)
