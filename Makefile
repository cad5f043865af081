# Every target sets itself up from a fresh clone: it creates .venv and installs what it needs.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_PIN := torch==2.13.0

.PHONY: venv test lint demo bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

venv: $(BIN)/python
	$(BIN)/pip install -q "$(TORCH_PIN)"
	$(BIN)/pip install -q -e ".[dev,cli]"

test: venv
	$(BIN)/python -m pytest -n 2 tests

lint: venv
	$(BIN)/ruff check src tests bench examples

demo: venv
	$(BIN)/optkit train

bench: venv
	$(BIN)/python -m bench.run_all

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache runs
