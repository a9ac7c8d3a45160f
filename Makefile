# Everything a fresh machine needs: `make run` (the main job, embedded) and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup run test lint bench model

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

model: setup
	$(BIN)/boxcar model pull

run: model
	$(BIN)/boxcar run examples/requests.jsonl -o results.jsonl

test: model
	$(BIN)/pytest -q -x -p no:cacheprovider tests

lint: setup
	$(BIN)/ruff check .
	$(BIN)/mypy

bench: model
	$(BIN)/python -m bench.offline

# The service, embedded (API + one worker, SQLite and .boxcar/ here; no servers to install).
.PHONY: serve demo compose-config

serve: model
	$(BIN)/boxcar serve

# The main job through the REST API: start, submit examples/requests.jsonl, poll, download.
demo: model
	$(BIN)/python -m worker.demo examples/requests.jsonl -o results.jsonl

compose-config:
	docker-compose -f compose/docker-compose.yml config -q
