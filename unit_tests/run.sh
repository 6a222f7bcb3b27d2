#!/usr/bin/env bash
# The whole test suite from nothing: install, configure, build, ctest.
# The JAX oracle's Python environment is created once and reused:
#   ${ASH_VENV:-~/.cache/adjoint-sharding/venv} with pinned jax, h5py, numpy, matplotlib from PyPI.
# So is the Python package's (docs/python.md, "Tests"):
#   ${ASH_PY_VENV:-~/.cache/adjoint-sharding/pyvenv} with pinned numpy, h5py, pytest, nanobind,
#   scikit-build-core and torch (PyPI's wheel, ~5.5 min and 5.4 GB once; ASH_PY_TORCH=0: no torch,
#   the torch tests are skipped), and mamba-ssm's Python sources with einops (no CUDA build).
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
ASH_PY_VENV="${ASH_PY_VENV:-$HOME/.cache/adjoint-sharding/pyvenv}"
ASH_PY_PACKAGES=("numpy==2.4.6" "h5py==3.16.0" "pytest==9.2.0" "nanobind==3.1.0" "scikit-build-core==1.1.2")
if ! "$ASH_PY_VENV/bin/python" -c "import numpy, h5py, pytest, nanobind, scikit_build_core" 2>/dev/null; then
  echo "[setup] creating $ASH_PY_VENV (numpy, h5py, pytest, nanobind, scikit-build-core)"
  rm -rf "$ASH_PY_VENV"
  python3 -m venv "$ASH_PY_VENV"
  "$ASH_PY_VENV/bin/pip" install -q --disable-pip-version-check "${ASH_PY_PACKAGES[@]}"
fi
if [ "${ASH_PY_TORCH:-1}" != 0 ] && ! "$ASH_PY_VENV/bin/python" -c "import torch" 2>/dev/null; then
  echo "[setup] adding torch to $ASH_PY_VENV (PyPI's wheel: several minutes, once)"
  "$ASH_PY_VENV/bin/pip" install -q --disable-pip-version-check "torch==2.15.0" || \
    echo "[setup] torch could not be installed: the torch tests will be skipped" >&2
fi
# transformers and safetensors: the Mamba oracle (transformers' own MambaForCausalLM, its
# pure-PyTorch path in float64) and the interchange format of import-hf / export-hf.
if "$ASH_PY_VENV/bin/python" -c "import torch" 2>/dev/null && \
   ! "$ASH_PY_VENV/bin/python" -c "import transformers, safetensors" 2>/dev/null; then
  echo "[setup] adding transformers and safetensors to $ASH_PY_VENV"
  "$ASH_PY_VENV/bin/pip" install -q --disable-pip-version-check "transformers==5.24.0" "safetensors==0.8.0" || \
    echo "[setup] transformers could not be installed: the Mamba oracle tests will be skipped" >&2
fi
# mamba-ssm's Python sources (its selective_scan_ref) for ctest mamba_baseline_smoke: no
# CUDA build here (perf_tests/mamba_build.sh builds the kernels for a GPU); --no-deps, as
# the scan module needs only torch, triton (torch's) and einops.
if "$ASH_PY_VENV/bin/python" -c "import torch" 2>/dev/null && \
   ! "$ASH_PY_VENV/bin/python" -c "import einops, importlib.util as u; assert u.find_spec('mamba_ssm')" 2>/dev/null; then
  echo "[setup] adding einops and mamba-ssm's Python sources to $ASH_PY_VENV"
  MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE "$ASH_PY_VENV/bin/pip" install -q --disable-pip-version-check \
    --no-deps --no-build-isolation "einops==0.8.1" "mamba-ssm==2.3.2.post1" || \
    echo "[setup] mamba-ssm could not be installed: mamba_baseline_smoke will be skipped" >&2
fi
# mambapy: the parallel scan transformers runs with use_mambapy=True (without the package it
# silently runs its recurrent loop), for perf_tests/mamba_cpu_vs_hf.py and its ctest smoke;
# --no-deps: it needs only torch.
if "$ASH_PY_VENV/bin/python" -c "import torch" 2>/dev/null && \
   ! "$ASH_PY_VENV/bin/python" -c "import mambapy.pscan" 2>/dev/null; then
  echo "[setup] adding mambapy to $ASH_PY_VENV"
  "$ASH_PY_VENV/bin/pip" install -q --disable-pip-version-check --no-deps "mambapy==1.2.0" || \
    echo "[setup] mambapy could not be installed: mamba_cpu_vs_hf_smoke will be skipped" >&2
fi
export ASH_CMAKE_ARGS="${ASH_CMAKE_ARGS:-} -DASH_ORACLE_PYTHON=$ASH_VENV/bin/python"
export ASH_CMAKE_ARGS="$ASH_CMAKE_ARGS -DASH_ENABLE_PYTHON=ON -DPython_EXECUTABLE=$ASH_PY_VENV/bin/python"
source "$(dirname "${BASH_SOURCE[0]}")/../cmake/setup.sh"
cd "$ASH_BUILD_DIR"
ctest --output-on-failure -j "$(nproc)" --timeout 1200
