#!/usr/bin/env bash
# Installs what AdjointSharding needs from Debian (skipped when present),
# then configures and builds into ${ASH_BUILD_DIR:-build}. Idempotent.
# Sourced by examples/run.sh and unit_tests/run.sh; extra CMake arguments
# can be passed in ASH_CMAKE_ARGS (e.g. -DCMAKE_PREFIX_PATH=/opt/kokkos-4.6).
set -euo pipefail
ASH_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ASH_BUILD_DIR="${ASH_BUILD_DIR:-$ASH_ROOT/build}"

packages=(cmake make g++ pkg-config
  libtrilinos-kokkos-dev libtrilinos-kokkos-kernels-dev libopenblas-dev
  libhdf5-dev libxxhash-dev libopenmpi-dev openmpi-bin libcli11-dev nlohmann-json3-dev libgtest-dev libbenchmark-dev fortunes)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "[setup] installing Debian packages: ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
else
  echo "[setup] Debian packages present"
fi

echo "[setup] configuring $ASH_BUILD_DIR"
mkdir -p "$ASH_BUILD_DIR"
# shellcheck disable=SC2086
if ! cmake -S "$ASH_ROOT" -B "$ASH_BUILD_DIR" -DCMAKE_BUILD_TYPE=Release ${ASH_CMAKE_ARGS:-} \
     > "$ASH_BUILD_DIR/configure.log" 2>&1; then
  cat "$ASH_BUILD_DIR/configure.log"
  echo "[setup] configure failed (log: $ASH_BUILD_DIR/configure.log)" >&2
  exit 1
fi
grep -E "AdjointSharding" "$ASH_BUILD_DIR/configure.log" || true
echo "[setup] building with $(nproc) jobs"
cmake --build "$ASH_BUILD_DIR" -j "$(nproc)"
