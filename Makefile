# Koi — two set-up commands: `make run` and `make test`. Both create .venv when missing.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test install lock lint bench clean

# pinned by constraints.txt: the same numerics on every machine (see that file)
$(STAMP): pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	@touch $(STAMP)

install: $(STAMP)

## re-resolve pyproject.toml's ranges in a scratch venv and pin the result in constraints.txt
lock:
	rm -rf .lock-venv && $(PYTHON) -m venv .lock-venv
	.lock-venv/bin/python -m pip install --quiet --upgrade pip
	.lock-venv/bin/python -m pip install --quiet -e '.[dev]'
	{ sed -n '/^#/p' constraints.txt; .lock-venv/bin/python -m pip freeze --exclude-editable; } > constraints.txt.new
	mv constraints.txt.new constraints.txt && rm -rf .lock-venv

## the main job on the embedded default (SQLite, Temporal dev server, simulated fleet)
run: $(STAMP)
	@if $(BIN)/koi --help | grep -qw demo; then \
	  $(BIN)/koi demo $(ARGS); \
	else \
	  $(BIN)/koi db upgrade && $(BIN)/koi catalog gpus && $(BIN)/koi catalog models && \
	  $(BIN)/koi catalog instances --cloud aws; \
	fi

## every test (starts the local PostgreSQL when it is down)
test: $(STAMP)
	@scripts/ensure-services.sh
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check koi workflows activities workers infra tests

clean:
	rm -rf .koi .pytest_cache build *.egg-info
