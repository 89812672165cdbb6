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
test: bootstrap mesa25
	@rc=0; \
	$(MAKE) --no-print-directory _pytest-system || rc=1; \
	$(MAKE) --no-print-directory _pytest-mesa25 || rc=1; \
	if [ $$rc = 0 ]; then echo "make test: both lavapipes passed"; else echo "make test: FAILED (see above)"; fi; \
	exit $$rc

test-system: bootstrap
	@$(MAKE) --no-print-directory _pytest-system

test-mesa25: bootstrap mesa25
	@$(MAKE) --no-print-directory _pytest-mesa25

_pytest-system:
	@echo "=== pytest: system lavapipe ($$(dpkg-query -W -f='$${Version}' mesa-vulkan-drivers 2>/dev/null)), VKMOE_VALIDATION=$(VALIDATION) ==="
	env -u VK_DRIVER_FILES -u VK_ICD_FILENAMES VKMOE_VALIDATION=$(VALIDATION) $(PY) -m pytest tests $(PYTEST_ARGS)

_pytest-mesa25:
	@echo "=== pytest: Mesa 25 lavapipe (.cache/mesa25), VKMOE_VALIDATION=$(VALIDATION) ==="
	bash scripts/mesa25.sh run env VKMOE_VALIDATION=$(VALIDATION) $(PY) -m pytest tests $(PYTEST_ARGS)

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
