# Both targets create .venv on first use. torch is pinned to the CPU build.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test lint bench clean

$(BIN)/hpmoe: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,gpu]'
	touch $@

demo: $(BIN)/hpmoe
	$(BIN)/python -m hpmoe demo --out out

test: $(BIN)/hpmoe
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -x -p no:cacheprovider

clean:
	rm -rf $(VENV) out
