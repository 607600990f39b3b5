# Two commands on a fresh machine with Python 3.11:  `make demo`  and  `make test`.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.hetnode-installed

.PHONY: demo test lint venv clean

demo: $(STAMP)
	$(BIN)/hetnode demo --quick

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/pytest

lint: $(STAMP)
	$(BIN)/ruff check .

venv: $(STAMP)

# torch first, pinned to the CPU wheel: an open range would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	@touch $(STAMP)

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
