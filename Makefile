# Set-up is two commands on a fresh machine: `make demo` and `make test`.
# Each creates .venv when missing and installs the package with the pinned CPU torch.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# The machines keep the CPU torch wheel in /opt/wheels; look there first when it exists.
FIND_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)
PIP_INSTALL := $(BIN)/python -m pip install --disable-pip-version-check -q $(FIND_LINKS) -c constraints.txt

.PHONY: demo test lint clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP_INSTALL) -e '.[dev,plot,bench]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/minifloat formats

test: $(STAMP)
	$(BIN)/python -m pytest

lint: $(STAMP)
	$(BIN)/ruff check src tests

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
