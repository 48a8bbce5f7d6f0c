#!/usr/bin/env bash
# Stage, on a machine with network, the wheels the offline GPU machine lacks: run from the repo
# root, then carry .wheels/ along (bench/gpu/setup_device.sh installs them there). Where nvcc is
# found, also build flashinfer's kernels for the H200 ahead of time into .wheels/flashinfer-aot/
# (bench/gpu/aot_flashinfer.py; about 10 minutes on 2 cores, kept between runs), so the GPU
# machine loads them instead of compiling them on its short lease.
# Target: the H200 image (CPython 3.12.3, torch 2.11.0+cu130, nvcc 13.0, transformers, lightning,
# safetensors; no omegaconf, no flashinfer, no network).
set -euo pipefail
OUT=${OUT:-.wheels}
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
FLASHINFER=${FLASHINFER:-0.7.2.post1}
# CPython 3.12 on manylinux x86_64; pure-Python wheels match any platform
TARGET=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
mkdir -p "$OUT"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# flashinfer: the full wheel (62 MB) is too big to carry; keep a repack of what specflow uses
"$PY" -m pip download -q --no-deps "flashinfer-python==$FLASHINFER" -d "$tmp"
rm -f "$OUT"/flashinfer_python-*.whl
"$PY" bench/gpu/slim_flashinfer.py "$tmp/flashinfer_python-$FLASHINFER-py3-none-any.whl" "$OUT"

# with their dependency trees (setup_device.sh installs only what the machine lacks):
#   apache-tvm-ffi, requests, nvidia-ml-py: `import flashinfer`;  ninja: drives flashinfer's JIT builds;
#   omegaconf 2.4 (vendors its antlr4 runtime) and einops: specflow dependencies missing there;
#   pytest, pytest-xdist, hypothesis: `make test-gpu`;  setuptools: the editable install of specflow
"$PY" -m pip download -q "${TARGET[@]}" -d "$OUT" \
    "apache-tvm-ffi==0.1.15.post2" requests nvidia-ml-py ninja "omegaconf==2.4.0" einops \
    pytest pytest-xdist hypothesis "setuptools>=68"

if command -v nvcc >/dev/null; then
    aot="$tmp/aot"
    "$PY" -m pip install -q --target "$aot/site" --no-deps "$OUT"/flashinfer_python-*.whl
    "$PY" -m pip install -q --target "$aot/site" "apache-tvm-ffi==0.1.15.post2" tqdm tabulate requests \
        nvidia-ml-py ninja packaging
    # headers the norm kernels include (cublasLt.h, curand_kernel.h) that a minimal CUDA install lacks
    "$PY" -m pip download -q --no-deps "nvidia-cublas>=13,<14" "nvidia-curand>=10.4,<11" -d "$aot/cuda"
    for wheel in "$aot"/cuda/*.whl; do unzip -q -o "$wheel" 'nvidia/*/include/*' -d "$aot/cuda"; done
    # modules link -lcuda; the driver's libcuda.so.1 arrives at run time, an empty stub with its soname links
    echo > "$aot/empty.c" && cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$aot/libcuda.so" "$aot/empty.c"
    PYTHONPATH="$aot/site" PATH="$aot/site/bin:$PATH" CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}" \
        CPATH="$(echo "$aot"/cuda/nvidia/*/include | tr ' ' :)" LIBRARY_PATH="$aot" \
        FLASHINFER_WORKSPACE_BASE="$aot/workspace" "$PY" bench/gpu/aot_flashinfer.py "$OUT/flashinfer-aot"
else
    echo "no nvcc here: flashinfer's kernels will be compiled on the GPU machine at first use (minutes)"
fi

ls -l "$OUT"
du -ch "$OUT"/*.whl "$OUT"/flashinfer-aot 2>/dev/null | tail -1
