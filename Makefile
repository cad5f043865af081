# Every target sets itself up from a fresh clone: it creates .venv and installs what it needs.
# The install runs once per change of pyproject.toml or of this Makefile (a stamp records it); later calls go
# straight to the work, also offline. To reinstall, touch pyproject.toml or `make clean`.
# Two stamps: .venv/.installed-demo (optkit and its cli extra: all `make demo` needs) and .venv/.installed
# (everything: the dev, cli and test extras and timm, for test, lint, bench and docs). The full install also
# renews the demo stamp, so `make demo` after `make test` installs nothing; `make test` after `make demo`
# installs the rest.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.installed-demo
TORCH_PIN := torch==2.13.0

.PHONY: venv test lint demo bench docs clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

# optkit is installed in editable mode: source changes need no reinstall, only the metadata does.
# timm is a test and benchmark anchor only: --no-deps, because its dependencies pull torchvision and a CUDA
# torch (tests that compare with it are skipped without it).
$(STAMP): pyproject.toml Makefile | $(BIN)/python
	$(BIN)/pip install -q "$(TORCH_PIN)"
	$(BIN)/pip install -q -e ".[dev,cli,test]" "$(TORCH_PIN)"
	$(BIN)/pip install -q --no-deps timm
	touch $(STAMP) $(DEMO_STAMP)

$(DEMO_STAMP): pyproject.toml Makefile | $(BIN)/python
	$(BIN)/pip install -q "$(TORCH_PIN)"
	$(BIN)/pip install -q -e ".[cli]" "$(TORCH_PIN)"
	touch $(DEMO_STAMP)

venv: $(STAMP)

test: venv
	$(BIN)/python -m pytest -n 2 tests

lint: venv
	$(BIN)/ruff check src tests bench examples tools

demo: $(DEMO_STAMP)
	$(BIN)/optkit train

bench: venv
	$(BIN)/python -m bench.run_all

docs: venv  # docs/api.md from the docstrings of optkit.__all__
	$(BIN)/python tools/gen_api.py

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache runs
