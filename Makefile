# The two commands: `make demo` and `make test`. Each creates .venv and installs the
# package with the exact versions of constraints.txt on first use (and again when
# setup.cfg, pyproject.toml or constraints.txt change).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
INSTALLED := $(VENV)/.installed
FAST := not multiprocess and not slow and not gpu and not slurm

.PHONY: demo test test-fast bench chaos docs notebooks gpu-check lint venv constraints \
	system-deps

$(INSTALLED): setup.cfg pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# A venv made before tf_distrib required `tensorflow` holds `tensorflow-cpu`: two
	# TensorFlows would share one package directory.
	$(PY) -m pip uninstall --quiet --yes tensorflow-cpu 2>/dev/null || true
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt \
		-e '.[dev,ray,docs]'
	# The native all-reduce op, compiled now rather than in the first job (it warns, and
	# the transport keeps its Python path, where there is no C++ compiler).
	TF_CPP_MIN_LOG_LEVEL=2 $(PY) -c 'from tf_distrib.transport import native_sum; native_sum.library()'
	touch $@

venv: $(INSTALLED)

demo: $(INSTALLED)
	$(VENV)/bin/tf-distrib demo

# The whole suite, notebooks and multi-process tests included (what CI runs).
test: $(INSTALLED)
	$(VENV)/bin/ruff check tf_distrib tests examples notebooks
	$(PY) -m pytest -q

# In-process tests only: under 3 minutes.
test-fast: $(INSTALLED)
	$(PY) -m pytest -q -m "$(FAST)"

# Debian packages some tests drive for real, once: Slurm and munge (tests/test_slurm.py,
# a real slurmctld and slurmd) and strace (the durable-backup order, tests/test_durability.py).
# And a C++ compiler: tests/test_native_sum.py builds the native all-reduce op.
# Without root or apt-get those tests skip, naming what they need. The check's loop runs
# in a subshell: its `exit 1` must end the check, not the recipe.
SYSTEM_TOOLS := slurmctld slurmd munged strace c++
system-deps:
	@if (for t in $(SYSTEM_TOOLS); do command -v $$t >/dev/null || exit 1; done); then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
			slurm-wlm munge strace g++ >/dev/null; \
	else echo "system-deps: not root or no apt-get: the Slurm and strace tests will skip"; fi

bench: $(INSTALLED)
	$(VENV)/bin/tf-distrib bench

# Trials of a 2-worker job under drawn faults, each checked bitwise (tf_distrib.chaos);
# `make chaos TRIALS=100 SEED=1` for the soak in docs/fault_tolerance.md.
TRIALS ?= 20
SEED ?= 0
chaos: $(INSTALLED)
	$(VENV)/bin/tf-distrib chaos --trials $(TRIALS) --seed $(SEED) --out chaos-results.json

# The documentation site (mkdocs, API reference from the docstrings); warnings fail it.
docs: $(INSTALLED)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet --site-dir site

# Runs every notebook and commits its outputs (plots) into it.
notebooks: $(INSTALLED)
	$(PY) notebooks/execute.py --write notebooks/*.ipynb

# On a machine with NVIDIA GPUs: the GPU tests, then the GPU benchmarks, in one go.
gpu-check: $(INSTALLED)
	$(PY) -m pytest -q -m gpu -rs
	$(VENV)/bin/tf-distrib bench gpu

lint: $(INSTALLED)
	$(VENV)/bin/ruff check tf_distrib tests examples notebooks

# Re-resolves the newest versions within setup.cfg's ranges into constraints.txt.
constraints:
	rm -rf .constraints-venv && $(PYTHON) -m venv .constraints-venv
	.constraints-venv/bin/pip install --quiet --disable-pip-version-check -e '.[dev,ray,docs]'
	(sed -n '1,3p' constraints.txt; .constraints-venv/bin/pip freeze --exclude-editable \
		| grep -v '^tf_distrib') > constraints.txt.new
	mv constraints.txt.new constraints.txt && rm -rf .constraints-venv
