# Two commands do everything on a fresh machine:
#   make demo   set up a virtual environment and run the demo on the default backend (and every available one)
#   make test   set up and run the whole test suite, the docs build included
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
export XDG_RUNTIME_DIR ?= /tmp
export NO_MKDOCS_2_WARNING ?= 1

.PHONY: setup demo test docs bench figures clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

setup: $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[dev]'

demo: setup
	$(BIN)/paged-sparse-attn demo

test: setup
	$(BIN)/python -m pytest -q
	$(BIN)/mkdocs build --strict -q -d site

docs: setup
	$(BIN)/mkdocs build --strict -d site

bench: setup
	$(BIN)/paged-sparse-attn bench

figures: setup
	$(BIN)/python scripts/make_figures.py

clean:
	rm -rf $(VENV) site build dist .pytest_cache .hypothesis
