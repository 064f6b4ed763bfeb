# The two commands at the top of README.md: `make serve` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: serve test lint down clean

# Create the virtualenv and install the project (+ dev tools) once; reinstall when
# pyproject.toml changes. torch==2.13.0 resolves to the CPU wheel on our machines.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip 2>&1 | grep -v "is ignored" || true
	$(BIN)/pip install --quiet --progress-bar off -e '.[dev]' 2>&1 | grep -v "is ignored" || true
	$(BIN)/python -c "import torch, transformers, ray, specdec"
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/pytest -q

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

serve: $(STAMP)
	@echo "make serve: not yet available (the HTTP API lands with issue #5)."

down:
	@echo "make down: nothing to stop yet."

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
