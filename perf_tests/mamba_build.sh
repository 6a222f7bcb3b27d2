#!/usr/bin/env bash
# Builds mamba-ssm's selective-scan CUDA extension (selective_scan_cuda) for one GPU
# architecture, for perf_tests/mamba_baseline.py --scan cuda --mamba-dir OUT:
#
#   bash perf_tests/mamba_build.sh --out DIR [--sdist mamba_ssm-VER.tar.gz | --version VER]
#                                  [--arch 90] [--python PY] [--jobs N]
#
# It builds the public package from PyPI's source distribution and vendors nothing.
# mamba-ssm's own setup.py compiles its kernels for nine architectures (sm_75 … sm_121)
# and first tries to download a prebuilt wheel; this recipe instead compiles the same ten
# sources of csrc/selective_scan with its nvcc flags for --arch alone, through
# torch.utils.cpp_extension, against the torch of --python (which must be the torch that
# runs the baseline: the extension is tied to its version). OUT then holds mamba_ssm/
# (the package's Python files), selective_scan_cuda*.so and BUILD_INFO.json (version,
# sdist SHA-256, torch, nvcc, flags).
#
# On a machine with no network (the lent GPU machine), download the source here first:
#   python3 -m pip download --no-deps --no-binary :all: --no-build-isolation -d DIR mamba-ssm==2.3.2.post1
# (MAMBA_SKIP_CUDA_BUILD=TRUE in the environment; its metadata step imports torch), carry
# DIR and pass --sdist.
set -euo pipefail
version=2.3.2.post1
arch=90
out=""
sdist=""
py=python3
jobs="$(nproc)"
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out=$2; shift 2 ;;
    --sdist) sdist=$2; shift 2 ;;
    --version) version=$2; shift 2 ;;
    --arch) arch=$2; shift 2 ;;
    --python) py=$2; shift 2 ;;
    --jobs) jobs=$2; shift 2 ;;
    *) echo "mamba_build.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
[ -n "$out" ] || { echo "mamba_build.sh: --out DIR is required" >&2; exit 2; }
[[ "$arch" =~ ^[0-9]+a?$ ]] || { echo "mamba_build.sh: --arch takes a compute capability such as 90" >&2; exit 2; }
mkdir -p "$out"
out="$(cd "$out" && pwd)"
if [ -z "$sdist" ]; then
  echo "[mamba] downloading mamba-ssm==$version (source)"
  MAMBA_SKIP_CUDA_BUILD=TRUE "$py" -m pip download -q --no-deps --no-binary :all: --no-build-isolation \
    -d "$out/sdist" "mamba-ssm==$version"
  sdist="$(ls "$out"/sdist/mamba_ssm-*.tar.gz | head -1)"
fi
[ -f "$sdist" ] || { echo "mamba_build.sh: no source distribution at $sdist" >&2; exit 2; }
rm -rf "$out/src" "$out/mamba_ssm" "$out/build"
mkdir -p "$out/src" "$out/build"
tar -xzf "$sdist" -C "$out/src" --strip-components=1
cp -r "$out/src/mamba_ssm" "$out/mamba_ssm"
echo "[mamba] compiling selective_scan_cuda for sm_$arch with $jobs jobs (log: $out/build/build.log)"
MAX_JOBS="$jobs" "$py" - "$out" "$arch" "$sdist" > "$out/build/build.log" 2>&1 <<'EOF' || { tail -40 "$out/build/build.log"; exit 1; }
import hashlib, json, os, shutil, subprocess, sys, time
import torch
from torch.utils import cpp_extension

out, arch, sdist = sys.argv[1], sys.argv[2], sys.argv[3]
src = os.path.join(out, "src", "csrc", "selective_scan")
sources = [os.path.join(src, f) for f in (
    "selective_scan.cpp",
    "selective_scan_fwd_fp32.cu", "selective_scan_fwd_fp16.cu", "selective_scan_fwd_bf16.cu",
    "selective_scan_bwd_fp32_real.cu", "selective_scan_bwd_fp32_complex.cu",
    "selective_scan_bwd_fp16_real.cu", "selective_scan_bwd_fp16_complex.cu",
    "selective_scan_bwd_bf16_real.cu", "selective_scan_bwd_bf16_complex.cu")]
# mamba-ssm 2.3's setup.py flags for nvcc, its nine -gencode pairs replaced by one, and no
# -std=c++17: cpp_extension adds the standard this torch's headers need (C++20 for torch 2.15)
nvcc_flags = ["-O3", "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
              "-U__CUDA_NO_BFLOAT16_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
              "-U__CUDA_NO_BFLOAT162_OPERATORS__", "-U__CUDA_NO_BFLOAT162_CONVERSIONS__",
              "--expt-relaxed-constexpr", "--expt-extended-lambda", "--use_fast_math", "--ptxas-options=-v",
              "-lineinfo", "--threads", "4", "-gencode", f"arch=compute_{arch},code=sm_{arch}"]
cxx_flags = ["-O3"]
os.environ["TORCH_CUDA_ARCH_LIST"] = ""  # the -gencode above is the only target
t0 = time.time()
mod = cpp_extension.load(name="selective_scan_cuda", sources=sources, extra_cflags=cxx_flags,
                         extra_cuda_cflags=nvcc_flags, extra_include_paths=[src],
                         build_directory=os.path.join(out, "build"), verbose=True)
shutil.copy2(mod.__file__, out)
nvcc = os.path.join(cpp_extension.CUDA_HOME or "", "bin", "nvcc")
info = {
    "package": "mamba-ssm", "version": open(os.path.join(out, "mamba_ssm", "__init__.py")).read()
    .split('__version__ = "')[1].split('"')[0],
    "sdist": os.path.basename(sdist), "sdist_sha256": hashlib.sha256(open(sdist, "rb").read()).hexdigest(),
    "torch": torch.__version__, "torch_cuda": torch.version.cuda,
    "nvcc": subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1],
    "arch": f"sm_{arch}", "nvcc_flags": nvcc_flags, "cxx_flags": cxx_flags,
    "seconds": round(time.time() - t0, 1), "extension": os.path.basename(mod.__file__)}
json.dump(info, open(os.path.join(out, "BUILD_INFO.json"), "w"), indent=1)
print(json.dumps(info))
EOF
cat "$out/BUILD_INFO.json"; echo
echo "[mamba] built: python3 perf_tests/mamba_baseline.py --mamba-dir $out ..."
