# Two commands do all the set-up on a fresh machine (Python 3.11):
#   make demo   EAGLE-3 speculative decoding on the embedded default with its shipped head, compared
#               with plain decoding in the same run (answer, tau, tokens/s, speedup)
#   make test   the default test suite on 2 pytest-xdist workers, printing its wall time: 346 s
#               (698 tests) on a quiet 2-core VM, 721 s on a busy one (.ci/run calls
#               it, then make test-slow, then make demo with the base install alone and an
#               empty cache)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
TEST_WORKERS ?= 2

.PHONY: demo test test-slow test-all bench lint clean

$(VENV)/.base: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.test: $(VENV)/.base
	$(PY) -m pip install -q -e '.[test]'
	touch $@

demo: $(VENV)/.base
	$(PY) decode.py --compare-plain --max-new-tokens 128 --timing-runs 3

# 2 pytest-xdist workers, one test file each at a time (a file's tests share their fixtures and
# compiled programs); TEST_WORKERS=0 runs it in one process. Prints the wall time it took. The
# tests compile at LLVM -O0 and share one compilation cache per run (tests/conftest.py).
test: $(VENV)/.test
	@start=$$(date +%s); \
	$(PY) -m pytest -q -m "not slow" -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS); rc=$$?; \
	echo "make test: the default suite took $$(( $$(date +%s) - start )) s (wall)"; exit $$rc

# the real SmolLM2 checks and the longest runs (kill-and-resume, training on a mesh, the device
# steps at a toy shape, the served SmolLM2, the serving sweeps at a toy shape, unfiltered
# sampling against plain sampling, staggered serving with adaptive verification, the two-process
# data jobs, decode --ignore-eos end to end, the OLMoE head's training, and end-to-end or
# statistical checks moved out of the default suite to keep it under 10 minutes): 47 tests in
# 1,805 s on a busy 2-core VM (2026-12-07, 39 in ~1,400 s the session before), compiled at XLA's
# default optimisation level
test-slow: $(VENV)/.test
	EAGLE3_JAX_TEST_XLA_OPT=default $(PY) -m pytest -q -m slow $(PYTEST_ARGS)

test-all: $(VENV)/.test
	$(PY) -m pytest -q $(PYTEST_ARGS)

bench: $(VENV)/.test
	$(PY) benchmarks/plain_decoding.py

lint: $(VENV)/.test
	$(PY) -m pip install -q ruff && $(VENV)/bin/ruff check eagle3_jax tests decode.py train.py benchmarks configs scripts

clean:
	rm -rf $(VENV) .venv-base .pytest_cache
