#!/usr/bin/env bash
# Installs what `make test` / `make demo` need on Debian 12, idempotently; a second run costs about a second.
#   1. apt: libvulkan1 mesa-vulkan-drivers glslc vulkan-validationlayers (+ python3-venv, python3-dev, gcc,
#      libc6-dev only where the interpreter or C toolchain is missing). `apt-get update` and `apt-get install`
#      run only when something is missing (checked with dpkg-query).
#   2. .venv (python3 -m venv), then pyproject.toml's build requirements and `pip install -e '.[test]'` only
#      when setup.py (or pyproject.toml/setup.cfg) changed since the last install (hash stamp in .venv) or vkmoe isn't importable.
#   3. `python setup.py build_shaders` (only shaders whose source changed) and the cffi module (vkmoe/_native*.so) rebuilt in place
#      when native/ is newer than it.
# Environment: PYTHON (interpreter for the venv, default python3), VKMOE_BOOTSTRAP_QUIET=1 (less output).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$PWD
PYTHON=${PYTHON:-python3}
VENV=$root/.venv
PY=$VENV/bin/python
export DEBIAN_FRONTEND=noninteractive
say() { [ "${VKMOE_BOOTSTRAP_QUIET:-0}" = 1 ] || echo "bootstrap: $*" >&2; }
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

# ---- 1. apt packages -------------------------------------------------------------------------------------
want=(libvulkan1 mesa-vulkan-drivers glslc vulkan-validationlayers)
if [ ! -x "$PY" ]; then
  # The venv has to be created: make sure the interpreter, venv/ensurepip, a C compiler and Python.h exist.
  if ! command -v "$PYTHON" >/dev/null 2>&1; then
    want+=(python3 python3-venv python3-dev)
  else
    "$PYTHON" -c 'import venv, ensurepip' >/dev/null 2>&1 || want+=(python3-venv)
    "$PYTHON" -c 'import os, sysconfig, sys; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
      || want+=(python3-dev)
  fi
fi
command -v cc >/dev/null 2>&1 || want+=(gcc libc6-dev)
# One dpkg-query for all; a package that is unknown or not fully installed ("ii") counts as missing.
installed=$(dpkg-query -W -f='${Package} ${db:Status-Abbrev}\n' "${want[@]}" 2>/dev/null | awk '$2=="ii"{print $1}' || true)
missing=()
for p in "${want[@]}"; do
  grep -qx "$p" <<<"$installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  say "apt-get install ${missing[*]}"
  as_root apt-get update -qq
  as_root apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# ---- 2. virtual environment and the editable install ----------------------------------------------------
if [ ! -x "$PY" ]; then
  say "creating .venv with $PYTHON"
  "$PYTHON" -m venv "$VENV"
fi
stamp=$VENV/.vkmoe-setup.sha256
hash=$({ cat setup.py; cat pyproject.toml setup.cfg 2>/dev/null || true; } | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$hash" ] \
   || ! "$PY" -c 'import importlib.util as u, sys; sys.exit(u.find_spec("vkmoe") is None)' 2>/dev/null; then
  say "pip install -e '.[test]'"
  rm -f "$stamp"
  # The build requirements come from pyproject.toml's [build-system] (the one place they are listed).
  mapfile -t build_reqs < <("$PY" -c 'import re; t = open("pyproject.toml").read(); s = re.search(r"\[build-system\].*?requires\s*=\s*\[(.*?)\]", t, re.S); print("\n".join(re.findall(r"\"([^\"]+)\"", s.group(1))))')
  "$PY" -m pip install -q --disable-pip-version-check "${build_reqs[@]}"
  # No build isolation: setup.py needs cffi at build time (cffi_modules), and it is already in the venv.
  "$PY" -m pip install -q --disable-pip-version-check --no-build-isolation -e '.[test]'
  echo "$hash" > "$stamp"
fi

# ---- 3. shaders and the native module ------------------------------------------------------------------
"$PY" setup.py -q build_shaders
if [ -f native/build_native.py ]; then
  so=$(ls -t vkmoe/_native*.so 2>/dev/null | head -n1 || true)
  if [ -z "$so" ] || [ -n "$(find native -type f -newer "$so" -print -quit)" ]; then
    say "building the cffi module in place (setup.py build_ext --inplace --force)"
    "$PY" setup.py -q build_ext --inplace --force
    for f in vkmoe/_native*.so; do [ -e "$f" ] && touch "$f"; done   # distutils keeps the build copy's mtime
  fi
fi
say "ready (.venv: $("$PY" -c 'import sys; print(sys.version.split()[0])'))"
