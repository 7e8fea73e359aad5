# The two commands: `make demo` and `make test`. Each creates .venv and installs the
# package on first use (and again when setup.cfg or pyproject.toml change).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
INSTALLED := $(VENV)/.installed

.PHONY: demo test bench lint venv

$(INSTALLED): setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev,ray]'
	touch $@

venv: $(INSTALLED)

demo: $(INSTALLED)
	$(VENV)/bin/tf-distrib demo

test: $(INSTALLED)
	$(VENV)/bin/ruff check tf_distrib tests examples
	$(PY) -m pytest -q

bench: $(INSTALLED)
	$(VENV)/bin/tf-distrib bench

lint: $(INSTALLED)
	$(VENV)/bin/ruff check tf_distrib tests examples
