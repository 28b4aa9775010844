# make test: the tests on the newest supported JAX (on Python 3.12, which
#            jax 0.12 needs; Gemma's tests included), then a quick job on the
#            oldest (jax 0.10.2 and PuLP 3, on Python 3.11).
# make demo: the newest environment (Ray's dashboard included: autopar[ray]),
#            and the main example job.
#
# The Pythons are found by .ci/find-python (on PATH, or pyenv's builds); to
# choose them: make test PYTHON=/path/to/python3.12 OLDEST_PYTHON=/path/to/python3.11
# Without a Python 3.12 the tests run on $(FALLBACK_PYTHON), on the newest
# JAX it can install.
FALLBACK_PYTHON ?= python3
PYTHON ?= $(or $(shell .ci/find-python 3.12),$(FALLBACK_PYTHON))
OLDEST_PYTHON ?= $(shell .ci/find-python 3.11)
VENV ?= .venv
OLDEST_VENV ?= .venv-oldest
PY := $(VENV)/bin/python
OLDEST_PY := $(OLDEST_VENV)/bin/python
# A stamp per Python version: a .venv made with another Python is made anew.
version = $(shell $(1) -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)
STAMP := $(VENV)/.autopar-installed-$(call version,$(PYTHON))
OLDEST_STAMP := $(OLDEST_VENV)/.autopar-installed-$(call version,$(OLDEST_PYTHON))
# Two test processes (pytest-xdist; tests/conftest.py keeps each file's
# tests on one process, and the Ray files' together): on this project's
# 2-core machine the newest job took 21 minutes from a fresh clone, against
# 31 in one process in the working copy (2026-11-29, 484 tests).
TEST_WORKERS ?= 2
PYTEST := pytest -q -n $(TEST_WORKERS)
# The oldest job: what depends most on JAX's and PuLP's internals, every
# method's step against jax.jit's (test_one_device_semantics), and
# docs/ray.md's recipes on the oldest Ray.
QUICK_TESTS := tests/test_jax_compat.py tests/test_marker_split.py \
  tests/test_control_flow.py tests/test_primitive_rules.py tests/test_losses.py \
  tests/test_one_device_semantics.py tests/test_ray_recipes.py

.PHONY: test lint test-newest test-oldest demo bench clean

$(STAMP): setup.py .ci/gemma-deps.txt .ci/zoo-deps.txt
	$(PYTHON) -m venv --clear $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,ray]'
	@# Gemma and the model zoo (keras-hub, MaxText) need Python >= 3.12 (their
	@# tests are skipped, saying so, elsewhere). What they import is resolved
	@# first, holding the jax, jaxlib, flax and numpy just installed; the
	@# packages themselves come last, with --no-deps (.ci/*-deps.txt say why):
	@# an install that resolves after them would report their unmet
	@# requirements as pip errors.
	if $(PY) -c 'import sys; sys.exit(sys.version_info < (3, 12))'; then \
	  $(PY) -m pip freeze | grep -iE '^(jax|jaxlib|flax|numpy)==' > $(VENV)/held.txt && \
	  $(PY) -m pip install --quiet -c $(VENV)/held.txt -r .ci/gemma-deps.txt \
	    -r .ci/zoo-deps.txt && \
	  $(PY) -m pip install --quiet --no-deps gemma==4.0.1 kauldron==1.4.4 \
	    keras-hub==0.32.0 maxtext==0.2.5; fi
	touch $(STAMP)

$(OLDEST_STAMP): setup.py .ci/oldest.txt
	$(OLDEST_PYTHON) -m venv --clear $(OLDEST_VENV)
	$(OLDEST_PY) -m pip install --quiet --upgrade pip
	$(OLDEST_PY) -m pip install --quiet -c .ci/oldest.txt -e '.[test,ray]'
	touch $(OLDEST_STAMP)

test: lint test-newest test-oldest

# The stages' import contracts (.importlinter) and ruff (ruff.toml).
lint: $(STAMP)
	$(VENV)/bin/lint-imports
	$(VENV)/bin/ruff check .

test-newest: $(STAMP)
	@$(PY) -c 'import sys, jax, pulp, ray; print(f"tests on Python {sys.version.split()[0]}, jax {jax.__version__}, PuLP {pulp.__version__}, Ray {ray.__version__}")'
	$(PY) -m $(PYTEST) --durations=15 tests

test-oldest:
	@if [ -z "$(OLDEST_PYTHON)" ]; then \
	  echo "make: no Python 3.11 found: the quick job on the oldest JAX is skipped (set OLDEST_PYTHON=)"; \
	else \
	  $(MAKE) --no-print-directory $(OLDEST_STAMP) && \
	  $(OLDEST_PY) -c 'import sys, jax, pulp, ray; print(f"quick job on Python {sys.version.split()[0]}, jax {jax.__version__}, PuLP {pulp.__version__}, Ray {ray.__version__}")' && \
	  $(OLDEST_PY) -m $(PYTEST) $(QUICK_TESTS); \
	fi

demo: $(STAMP)
	$(PY) examples/train_demo.py

bench: $(STAMP)
	$(PY) benchmark/grad_accumulation.py

clean:
	rm -rf $(VENV) $(OLDEST_VENV) *.egg-info .pytest_cache
