#!/usr/bin/env bash
# The whole test suite from nothing: install, configure, build, ctest.
# The JAX oracle's Python environment is created once and reused:
#   ${ASH_VENV:-~/.cache/adjoint-sharding/venv} with pinned jax, h5py, numpy, matplotlib from PyPI.
set -euo pipefail
ASH_VENV="${ASH_VENV:-$HOME/.cache/adjoint-sharding/venv}"
if ! "$ASH_VENV/bin/python" -c "import jax, h5py, numpy" 2>/dev/null; then
  if ! python3 -m venv --help >/dev/null 2>&1 || ! python3 -c "import ensurepip" 2>/dev/null; then
    echo "[setup] installing python3 and python3-venv"
    SUDO=""
    [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq python3 python3-venv >/dev/null
  fi
  echo "[setup] creating $ASH_VENV (jax, h5py, numpy)"
  rm -rf "$ASH_VENV"
  python3 -m venv "$ASH_VENV"
  "$ASH_VENV/bin/pip" install -q --disable-pip-version-check "jax[cpu]==0.10.2" "h5py==3.16.0" "numpy==2.4.6"
fi
# matplotlib draws the perf suite's plots (its smoke test runs in ctest).
if ! "$ASH_VENV/bin/python" -c "import matplotlib" 2>/dev/null; then
  echo "[setup] adding matplotlib to $ASH_VENV"
  "$ASH_VENV/bin/pip" install -q --disable-pip-version-check "matplotlib==3.10.8"
fi
export ASH_CMAKE_ARGS="${ASH_CMAKE_ARGS:-} -DASH_ORACLE_PYTHON=$ASH_VENV/bin/python"
source "$(dirname "${BASH_SOURCE[0]}")/../cmake/setup.sh"
cd "$ASH_BUILD_DIR"
ctest --output-on-failure -j "$(nproc)" --timeout 1200
