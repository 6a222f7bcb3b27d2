#!/usr/bin/env bash
# The whole test suite from nothing: install, configure, build, ctest.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../cmake/setup.sh"
cd "$ASH_BUILD_DIR"
ctest --output-on-failure -j "$(nproc)" --timeout 1200
