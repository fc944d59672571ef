# Koi — two set-up commands: `make run` and `make test`. Both create .venv when missing.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test install lint bench clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	@touch $(STAMP)

install: $(STAMP)

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
