# vkmoe: every target bootstraps what it needs (Debian 12, as root): see scripts/bootstrap.sh and README.md.
#   make test PYTEST_ARGS='-k linear'    extra pytest arguments for both runs
SHELL := /bin/bash
PY := .venv/bin/python
PYTEST_ARGS ?=
# Both lavapipes run with the Khronos validation layer (VKMOE_VALIDATION=1); override with VALIDATION=0.
VALIDATION ?= 1

.PHONY: all bootstrap mesa25 test test-system test-mesa25 demo bench probe shaders info dist clean distclean

all: test

bootstrap:
	@bash scripts/bootstrap.sh

mesa25: bootstrap
	@bash scripts/mesa25.sh fetch

# Runs the suite on the system's lavapipe (Debian 12: Mesa 22.3) and on Mesa 25.0.7; fails if any run fails.
# On a fresh machine most of a run is lavapipe compiling each pipeline on one thread (its shader cache is empty),
# and Mesa 25 compiles 2-5x slower than Mesa 22.3 (a cold run here: 3713 s vs 1146 s of tests, test_hadamard.py
# alone 1790 s). So by default (TEST_JOBS=3) three runs go at once: the system lavapipe's, and Mesa 25's in two
# halves (MESA25_FIRST, the files that take about half of its time; then every other file), and both cores stay
# busy to the end (one run per lavapipe left a core idle for the last two thirds of Mesa 25's run).
# TEST_JOBS=2: one run per lavapipe, at once; TEST_JOBS=1: one after the other, printing as they go. Each
# parallel run writes its log under .cache/ (printed when it ends) and each run has a vkmoe cache directory of its
# own (measurements), so no two race on one file.
TEST_JOBS ?= 3
# (a cold fresh-clone CI at b701861: Mesa 25's test_hadamard.py run 31 min, the other files 47.5 min, of which
# test_stage3_in_down.py at least 5 (its four slowest tests); so that file joins the first half)
MESA25_FIRST ?= tests/test_hadamard.py tests/test_stage3_in_down.py
test: bootstrap mesa25
	@rc=0; \
	if [ "$(TEST_JOBS)" = 1 ]; then \
	  $(MAKE) --no-print-directory _pytest-system || rc=1; \
	  $(MAKE) --no-print-directory _pytest-mesa25 || rc=1; \
	elif [ "$(TEST_JOBS)" = 2 ]; then \
	  echo "make test: both lavapipes at once; logs .cache/test-system.log, .cache/test-mesa25.log"; \
	  $(MAKE) --no-print-directory _pytest-system >.cache/test-system.log 2>&1 & sys=$$!; \
	  $(MAKE) --no-print-directory _pytest-mesa25 >.cache/test-mesa25.log 2>&1 & m25=$$!; \
	  wait $$sys || rc=1; cat .cache/test-system.log; \
	  wait $$m25 || rc=1; cat .cache/test-mesa25.log; \
	else \
	  echo "make test: three runs at once (system lavapipe; Mesa 25: $(MESA25_FIRST), then the other files);" \
	       "logs .cache/test-system.log, .cache/test-mesa25-a.log, .cache/test-mesa25-b.log"; \
	  $(MAKE) --no-print-directory _pytest-system >.cache/test-system.log 2>&1 & sys=$$!; \
	  $(MAKE) --no-print-directory _pytest-mesa25 MESA25_TESTS="$(MESA25_FIRST)" MESA25_RUN=a \
	    >.cache/test-mesa25-a.log 2>&1 & m25a=$$!; \
	  $(MAKE) --no-print-directory _pytest-mesa25 MESA25_TESTS="tests $(addprefix --ignore=,$(MESA25_FIRST))" MESA25_RUN=b \
	    >.cache/test-mesa25-b.log 2>&1 & m25b=$$!; \
	  wait $$sys || rc=1; cat .cache/test-system.log; \
	  wait $$m25a || rc=1; cat .cache/test-mesa25-a.log; \
	  wait $$m25b || rc=1; cat .cache/test-mesa25-b.log; \
	fi; \
	if [ $$rc = 0 ]; then echo "make test: every run passed (both lavapipes)"; else echo "make test: FAILED (see above)"; fi; \
	exit $$rc

test-system: bootstrap
	@$(MAKE) --no-print-directory _pytest-system

test-mesa25: bootstrap mesa25
	@$(MAKE) --no-print-directory _pytest-mesa25

_pytest-system:
	@echo "=== pytest: system lavapipe ($$(dpkg-query -W -f='$${Version}' mesa-vulkan-drivers 2>/dev/null)), VKMOE_VALIDATION=$(VALIDATION) ==="
	env -u VK_DRIVER_FILES -u VK_ICD_FILENAMES VKMOE_VALIDATION=$(VALIDATION) VKMOE_CACHE_DIR=$(CURDIR)/.cache/vkmoe-system \
	  $(PY) -m pytest tests --durations=15 $(PYTEST_ARGS)

# MESA25_TESTS: what pytest collects (make test's halves pass their files); MESA25_RUN names the half (its
# vkmoe cache directory and the header). A half that PYTEST_ARGS leaves without tests (pytest's exit 5) passes.
MESA25_TESTS ?= tests
MESA25_RUN ?=
_pytest-mesa25:
	@echo "=== pytest: Mesa 25 lavapipe (.cache/mesa25)$(if $(MESA25_RUN), run $(MESA25_RUN): $(MESA25_TESTS)), VKMOE_VALIDATION=$(VALIDATION) ==="
	bash scripts/mesa25.sh run env VKMOE_VALIDATION=$(VALIDATION) VKMOE_CACHE_DIR=$(CURDIR)/.cache/vkmoe-mesa25$(if $(MESA25_RUN),-$(MESA25_RUN)) \
	  $(PY) -m pytest $(MESA25_TESTS) --durations=15 $(PYTEST_ARGS)$(if $(MESA25_RUN), || [ $$? = 5 ])

demo: bootstrap
	$(PY) -m vkmoe demo

bench: bootstrap
	$(PY) tools/bench_moe

probe: bootstrap
	$(PY) tools/probe_residency

info: bootstrap
	$(PY) -m vkmoe info

shaders: bootstrap
	$(PY) setup.py build_shaders

# The sdist (with the compiled SPIR-V: installing it needs no glslc) and the abi3 wheel, into dist/.
dist: bootstrap
	$(PY) -m pip install -q --disable-pip-version-check build
	$(PY) -m build --outdir dist .

# Build outputs; keeps .venv and .cache (distclean removes those too).
clean:
	rm -rf build dist *.egg-info vkmoe/_spv .pytest_cache bench-out
	rm -f vkmoe/_native*.so vkmoe/_native*.c vkmoe/_native*.o
	find . \( -path ./.venv -o -path ./.cache -o -path ./.git \) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf .venv .cache
