# Two commands on a fresh machine with Python 3.11, 3.12 or 3.13:  `make demo`  and  `make test`.
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.hetnode-installed

# Interpreters to try, in order; the first that runs and is a supported version makes the venv.
# Each is run, not just found on PATH: pyenv puts shims there for versions it will not run.
PYTHON ?= python3.11 python3.12 python3.13 python3
SUPPORTED_PYTHONS := 3.11 3.12 3.13

TORCH := torch==2.13.0
# PyPI's Linux torch wheels are CUDA builds of several GB; elsewhere (macOS, Windows) PyPI's wheel is the CPU one.
# TORCH_INDEX empty: the default index.
ifeq ($(shell uname -s),Linux)
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
endif
# A closed network or a missing DNS name must not cost pip's 180 s timeout and retries: probe the index first
# (`timeout` bounds the DNS look-up too, which urllib's timeout does not).
TORCH_INDEX_PROBE_S ?= 5
define PROBE_INDEX
import sys, urllib.request
try:
    urllib.request.urlopen(sys.argv[1], timeout=float(sys.argv[2])).close()
except Exception as e:
    sys.exit(f"{sys.argv[1]}: {e}")
endef
export PROBE_INDEX

.PHONY: demo test lint venv clean

demo: $(STAMP)
	$(BIN)/hetnode demo --quick

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/pytest

lint: $(STAMP)
	$(BIN)/ruff check .

venv: $(STAMP)

$(BIN)/python:
	@found=""; \
	for p in $(PYTHON); do \
	    v=$$($$p -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) || continue; \
	    case " $(SUPPORTED_PYTHONS) " in *" $$v "*) \
	        echo "$(VENV): Python $$v ($$p)"; exec $$p -m venv $(VENV);; esac; \
	    found="$$found $$p=$$v"; \
	done; \
	echo "hetnode needs Python 3.11, 3.12 or 3.13; tried: $(PYTHON) (found:$${found:- none that runs})." >&2; \
	echo "Get one with \`uv python install 3.12\`, \`pyenv install 3.12\`, or your distribution's python3.12" \
	     "package (Ubuntu before 24.04: the deadsnakes PPA), then: make PYTHON=/path/to/python3.12" >&2; \
	exit 1

# torch first, the CPU build: `pip install -e .` alone would take any allowed torch from PyPI (CUDA on Linux).
# The CPU index is probed first; where it cannot be reached (or fails) the default index serves torch.
$(STAMP): pyproject.toml | $(BIN)/python
	@if [ -n "$(TORCH_INDEX)" ] && timeout $$(($(TORCH_INDEX_PROBE_S) * 2)) $(BIN)/python -c "$$PROBE_INDEX" \
	        "$(TORCH_INDEX)/torch/" $(TORCH_INDEX_PROBE_S); then \
	    echo "$(TORCH): CPU build from $(TORCH_INDEX)"; \
	    $(BIN)/python -m pip install --quiet --index-url $(TORCH_INDEX) $(TORCH) \
	    || { echo "$(TORCH) from $(TORCH_INDEX) failed; trying the default index (CUDA on Linux)" >&2; \
	         $(BIN)/python -m pip install --quiet $(TORCH); }; \
	else \
	    [ -z "$(TORCH_INDEX)" ] || echo "$(TORCH_INDEX) not reachable; $(TORCH) from the default index"; \
	    $(BIN)/python -m pip install --quiet $(TORCH); \
	fi
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	@touch $(STAMP)

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
