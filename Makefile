# make test: set up a virtual environment and run the tests.
# make demo: set up the same environment and run the main example job.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.autopar-installed

.PHONY: test demo bench clean

$(STAMP): setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q tests

demo: $(STAMP)
	$(PY) examples/train_demo.py

bench: $(STAMP)
	$(PY) benchmark/grad_accumulation.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
