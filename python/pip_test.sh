#!/usr/bin/env bash
# ctest python_pip_install (docs/python.md, "Tests"): `pip install .` of the
# repository into a venv of its own, then pytest against the installed package
# (not build/python). The venv lives in WORKDIR (the build tree) and the
# install is redone only when the sources change: a hash of every tracked file
# that goes into the wheel is kept beside it. The build tools (scikit-build-core,
# nanobind) and numpy/h5py/pytest come from the test interpreter's venv
# (--system-site-packages would pull torch in too, so the venv gets its own
# small copies from pip's cache: no build isolation, nothing fetched but those).
#   pip_test.sh PYTHON SOURCE_DIR WORKDIR ASH_CLI
set -euo pipefail
PY="$1" SRC="$2" WORK="$3" CLI="$4"
mkdir -p "$WORK"
VENV="$WORK/venv"
# The working tree's contents (edits not yet committed count too).
hash=$(cd "$SRC" && git ls-files -z -- src cmake python/src python/adjoint_sharding python/CMakeLists.txt CMakeLists.txt pyproject.toml 2>/dev/null |
       xargs -0 sha256sum | sha256sum | cut -c1-16)
[ -n "$hash" ] || hash=nogit
if [ "$(cat "$WORK/installed.hash" 2>/dev/null)" != "$hash" ] || ! "$VENV/bin/python" -c "import adjoint_sharding" 2>/dev/null; then
  rm -rf "$VENV" "$WORK/installed.hash"
  "$PY" -m venv "$VENV"
  versions=$("$PY" -c "import importlib.metadata as m; print(' '.join(f'{p}=={m.version(p)}' for p in ('numpy', 'h5py', 'pytest', 'nanobind', 'scikit-build-core')))")
  # shellcheck disable=SC2086
  "$VENV/bin/pip" install -q --disable-pip-version-check $versions
  echo "[pip_test] pip install $SRC (sources $hash)"
  start=$(date +%s)
  "$VENV/bin/pip" install -q --disable-pip-version-check --no-build-isolation --no-deps \
    -Cbuild-dir="$WORK/wheel-build" "$SRC"
  echo "[pip_test] installed in $(( $(date +%s) - start )) s"
  echo "$hash" > "$WORK/installed.hash"
else
  echo "[pip_test] sources unchanged ($hash): reusing $VENV"
fi
cd "$WORK"
# The installed package, not the build tree's: PYTHONPATH cleared, run outside the sources.
env -u PYTHONPATH ASH_CLI="$CLI" ASH_SOURCE_DIR="$SRC" OMP_NUM_THREADS=1 \
  "$VENV/bin/python" -c "import adjoint_sharding, sys; p = adjoint_sharding.__file__; print('[pip_test] imported', p); sys.exit(0 if p.startswith('$VENV') else 1)"
env -u PYTHONPATH ASH_CLI="$CLI" ASH_SOURCE_DIR="$SRC" OMP_NUM_THREADS=1 \
  "$VENV/bin/python" -m pytest -q -p no:cacheprovider -rs "$SRC/python/tests/test_api.py"
