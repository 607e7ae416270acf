# Both targets create .venv on first use.  torch is pinned here to the CPU build (a looser
# spec downloads a CUDA build of several GB) and Triton to the release whose interpreter the
# GPU tests run in; pyproject.toml declares the ranges hpmoe supports.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test lint bench clean

$(BIN)/hpmoe: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0 triton==3.8.0
	$(BIN)/pip install -q -e '.[dev,gpu]'
	touch $@

demo: $(BIN)/hpmoe
	$(BIN)/python -m hpmoe demo --out out

test: $(BIN)/hpmoe
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -x -p no:cacheprovider

clean:
	rm -rf $(VENV) out
