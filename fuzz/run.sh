#!/usr/bin/env bash
# Builds the fuzz targets with clang (a project of its own, fuzz/CMakeLists.txt)
# and runs each for a while on a generated seed corpus:
#   bash fuzz/run.sh [--seconds N | --minutes M] [--build-dir DIR] [--ash PATH]
# --ash: the `ash` tool that writes the seed checkpoint (default: build/src/ash).
# Exits non-zero when a target finds a crash, a sanitizer report or (the
# checkpoint target) a mutant that loads other values; its reproducer is left
# in the build directory (crash-*, leak-*, timeout-*).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
seconds=60
build="$root/build-fuzz"
ash="$root/build/src/ash"
while [ $# -gt 0 ]; do
  case "$1" in
    --seconds) seconds=$2; shift 2 ;;
    --minutes) seconds=$(($2 * 60)); shift 2 ;;
    --build-dir) build=$2; shift 2 ;;
    --ash) ash=$2; shift 2 ;;
    *) echo "fuzz/run.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
mkdir -p "$build"
if [ ! -f "$build/CMakeCache.txt" ]; then
  cmake -S "$root/fuzz" -B "$build" -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo > "$build/configure.log"
fi
echo "[fuzz] building the targets in $build"
cmake --build "$build" -j "$(nproc)" > "$build/build.log" 2>&1 || { tail -30 "$build/build.log"; exit 1; }
corpus="$build/corpus"
rm -rf "$corpus"
bash "$root/fuzz/make_corpus.sh" "$corpus" "$ash"
export ASH_FUZZ_CHECKPOINT="$corpus/checkpoint.h5" ASAN_OPTIONS="detect_leaks=0:abort_on_error=1"
status=0
for t in config json tokens checkpoint output safetensors hf_roundtrip; do
  work="$build/work_$t"
  mkdir -p "$work"
  cp -r "$corpus/$t/." "$work/"
  echo "[fuzz] fuzz_$t for $seconds s"
  # -close_fd_mask=3: the library's own output stays out of the log; findings go to stderr.
  # fuzz_json parses each document again at 512 KB: an input slower than 5 s is
  # a finding there (a parser superlinear in the size), 20 s elsewhere.
  limit=20
  [ "$t" = json ] && limit=5
  if (cd "$build" && ./fuzz_$t "$work" -max_total_time="$seconds" -timeout="$limit" -rss_limit_mb=4096 \
        -max_len=4096 -print_final_stats=1 > "$build/fuzz_$t.log" 2>&1); then
    runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$build/fuzz_$t.log" | grep -o '[0-9]*$' || echo "?")
    echo "[fuzz] fuzz_$t: $runs executions, nothing found"
  else
    status=1
    echo "[fuzz] fuzz_$t FOUND something (log: $build/fuzz_$t.log):"
    grep -E "ERROR|SUMMARY|fuzz_checkpoint:|Test unit written" "$build/fuzz_$t.log" | head -20
  fi
done
exit $status
