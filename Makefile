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

# Runs the suite on the system's lavapipe (Debian 12: Mesa 22.3) and on Mesa 25.0.7; fails if either fails.
# Both at once by default (TEST_JOBS=2): on a fresh machine most of a run is lavapipe compiling each pipeline on
# one thread (its shader cache is empty), so two runs share two cores well. Each writes its log under .cache/ and
# is printed when it ends; TEST_JOBS=1 runs them one after the other, printing as they go. Each run has a vkmoe
# cache directory of its own (measurements), so the two never race on one file.
TEST_JOBS ?= 2
test: bootstrap mesa25
	@rc=0; \
	if [ "$(TEST_JOBS)" = 1 ]; then \
	  $(MAKE) --no-print-directory _pytest-system || rc=1; \
	  $(MAKE) --no-print-directory _pytest-mesa25 || rc=1; \
	else \
	  echo "make test: both lavapipes at once; logs .cache/test-system.log, .cache/test-mesa25.log (TEST_JOBS=1: one after the other)"; \
	  $(MAKE) --no-print-directory _pytest-system >.cache/test-system.log 2>&1 & sys=$$!; \
	  $(MAKE) --no-print-directory _pytest-mesa25 >.cache/test-mesa25.log 2>&1 & m25=$$!; \
	  wait $$sys || rc=1; cat .cache/test-system.log; \
	  wait $$m25 || rc=1; cat .cache/test-mesa25.log; \
	fi; \
	if [ $$rc = 0 ]; then echo "make test: both lavapipes passed"; else echo "make test: FAILED (see above)"; fi; \
	exit $$rc

test-system: bootstrap
	@$(MAKE) --no-print-directory _pytest-system

test-mesa25: bootstrap mesa25
	@$(MAKE) --no-print-directory _pytest-mesa25

_pytest-system:
	@echo "=== pytest: system lavapipe ($$(dpkg-query -W -f='$${Version}' mesa-vulkan-drivers 2>/dev/null)), VKMOE_VALIDATION=$(VALIDATION) ==="
	env -u VK_DRIVER_FILES -u VK_ICD_FILENAMES VKMOE_VALIDATION=$(VALIDATION) VKMOE_CACHE_DIR=$(CURDIR)/.cache/vkmoe-system \
	  $(PY) -m pytest tests $(PYTEST_ARGS)

_pytest-mesa25:
	@echo "=== pytest: Mesa 25 lavapipe (.cache/mesa25), VKMOE_VALIDATION=$(VALIDATION) ==="
	bash scripts/mesa25.sh run env VKMOE_VALIDATION=$(VALIDATION) VKMOE_CACHE_DIR=$(CURDIR)/.cache/vkmoe-mesa25 \
	  $(PY) -m pytest tests $(PYTEST_ARGS)

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
