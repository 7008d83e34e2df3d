# Two commands on a fresh clone (each creates its own virtual environment in .venv):
#   make demo   install, then run the offline demo recipe (CPU, about 10 minutes on 2 cores)
#   make test   install with the dev extra, then run the test suite
# On a CPU machine torch is pinned to the local CPU build first, so pip never pulls CUDA wheels.
# On a GPU machine: make demo TORCH=torch (or follow the README's GPU install).

PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin
export DS_BUILD_OPS := 0

.PHONY: demo test lint clean-venv

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/torch.txt: | $(BIN)/python
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip freeze | grep -i '^torch==' > $@

$(VENV)/installed-%: pyproject.toml $(VENV)/torch.txt
	$(BIN)/python -m pip install -q -c $(VENV)/torch.txt -e ".[$*]"
	touch $@

demo: $(VENV)/installed-offline
	$(BIN)/polydraft run recipes/demo/demo.yaml $(ARGS)

test: $(VENV)/installed-dev
	$(BIN)/python -m pytest -q $(ARGS)

lint: $(VENV)/installed-dev
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

clean-venv:
	rm -rf $(VENV)
