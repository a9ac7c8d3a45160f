# Everything a fresh machine needs: `make run` (the main job, embedded) and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup run offline test test-slow lint bench model

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

model: setup
	$(BIN)/boxcar model pull
	$(BIN)/boxcar model pull all-MiniLM-L6-v2 --no-kernel

# The main job through the REST API on the embedded service: start it, submit
# examples/requests.jsonl, poll with a progress bar, download the results.
run: model
	$(BIN)/python -m cli.demo examples/requests.jsonl -o results.jsonl

# The same file offline, straight through the engine (no service).
offline: model
	$(BIN)/boxcar run examples/requests.jsonl -o results.jsonl

# The portable CPU kernel variant (no AVX-512) the tests hold the native one to: built once a
# machine, as `make model` builds the native one, so that the suite does not wait on a compile.
test: model
	-$(BIN)/python -c "from engine.kernels.cpu_decode_attention import build; build(quiet=True, variant='portable')"
	$(BIN)/pytest -q -x -p no:cacheprovider tests

# The slow tests: the real default model, 50,000-line and 200 MB uploads, a 30 s S3 outage,
# 64 concurrent clients, deep fuzzing. Their figures print at the end.
test-slow: model
	$(BIN)/pytest -q -p no:cacheprovider -m slow tests

lint: setup
	$(BIN)/ruff check .
	$(BIN)/mypy

bench: model
	$(BIN)/python -m bench.offline

# The service, embedded (API + one worker, SQLite and .boxcar/ here; no servers to install).
.PHONY: serve demo compose-config

serve: model
	$(BIN)/boxcar serve

demo: run

compose-config:
	docker-compose -f compose/docker-compose.yml config -q
