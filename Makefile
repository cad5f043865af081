# Every target sets itself up from a fresh clone: it creates .venv and installs what it needs.
# The install runs once per change of pyproject.toml or of this Makefile (the stamp .venv/.installed records
# it); later calls go straight to the work, also offline. To reinstall, touch pyproject.toml or `make clean`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_PIN := torch==2.13.0

.PHONY: venv test lint demo bench docs clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

# optkit is installed in editable mode: source changes need no reinstall, only the metadata does.
$(STAMP): pyproject.toml Makefile | $(BIN)/python
	$(BIN)/pip install -q "$(TORCH_PIN)"
	$(BIN)/pip install -q -e ".[dev,cli,test]" "$(TORCH_PIN)"
	touch $(STAMP)

venv: $(STAMP)

test: venv
	$(BIN)/python -m pytest -n 2 tests

lint: venv
	$(BIN)/ruff check src tests bench examples tools

demo: venv
	$(BIN)/optkit train

# timm is a benchmark anchor only: --no-deps, because its dependencies pull torchvision and a CUDA torch
bench: venv
	$(BIN)/python -c "import importlib.util as u, sys; sys.exit(u.find_spec('timm') is None)" \
		|| $(BIN)/pip install -q --no-deps timm
	$(BIN)/python -m bench.run_all

docs: venv  # docs/api.md from the docstrings of optkit.__all__
	$(BIN)/python tools/gen_api.py

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache runs
