# Set-up is two commands on a fresh machine: `make demo` and `make test`.
# Each creates .venv when missing and installs the package with the pinned CPU torch.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# The machines keep the CPU torch wheel in /opt/wheels; look there first when it exists.
FIND_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)
PIP_INSTALL := $(BIN)/python -m pip install --disable-pip-version-check -q $(FIND_LINKS) -c constraints.txt

.PHONY: demo test lint clean gpu-check

# setup.py and the kernel source too: an updated checkout rebuilds the kernels it calls.
$(STAMP): pyproject.toml constraints.txt setup.py $(wildcard src/minifloat/kernels/*.c)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP_INSTALL) -e '.[dev,bench,plot]'
	touch $(STAMP)

# The main job on its embedded default: the small GPT on the Python stdlib sources in four
# precisions, about 5 minutes on 2 cores; the report lands in runs/demo/report.md.
demo: $(STAMP)
	$(BIN)/minifloat compare --precisions bf16,fp8,mxfp8,nvfp4 --model small --steps 80 --eval-every 20 --out runs/demo --overwrite

# The layer contract first (pyproject.toml [tool.importlinter]): an upward import fails here.
test: $(STAMP)
	$(BIN)/lint-imports --no-cache
	$(BIN)/python -m pytest

# On a machine with an NVIDIA GPU (and a CUDA torch in the venv): the CUDA tests, validate at full
# size, bench gemm and bench decode on CUDA, one report in runs/gpu-check/report.md.
gpu-check: $(STAMP)
	$(BIN)/python tools/gpu_check.py --out runs/gpu-check

lint: $(STAMP)
	$(BIN)/ruff check src tests

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
