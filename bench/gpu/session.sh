#!/usr/bin/env bash
# One phase of a GPU session on the offline H200, from the repo root, each under the device's
# 10-minute limit per command; results and logs go to $OUT (default ./gpu-out):
#
#   bash bench/gpu/session.sh test     # set up (.wheels carried along), then `pytest -m gpu`
#   bash bench/gpu/session.sh bench1   # decode_roofline + verify_step at the real (8B) shape
#   bash bench/gpu/session.sh bench2   # spec_step + tiny_family
#   CONTEXTS='1024 4096' bash bench/gpu/session.sh long   # verify_step + spec_step over those
#                                      # cached contexts (default 4096), both backends
#
# What travels to the machine (tracked files, 27 MiB, and .wheels, 34 MiB) must stay under 64 MiB:
# check `du -sh .wheels` and the zoo's size after changing either.
# Copy $OUT/*.json to bench/results/ and commit them. The device tool's copy of .git can lag the
# working tree it sends (on 2026-11-22 it said 840e6c2, dirty): set git_commit / git_dirty to the
# commit the run was sent from before committing, and say so in the commit message.
# Extra pytest / benchmark arguments follow the phase (e.g. `test -k flashinfer`,
# `bench1 --backend flashinfer`).
set -uo pipefail
phase=${1:?usage: session.sh test|bench1|bench2|long [args...]}
shift
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
SECONDS=0
bash bench/gpu/setup_device.sh >"$OUT/setup.log" 2>&1 || { tail -20 "$OUT/setup.log"; exit 1; }
tail -1 "$OUT/setup.log"
. .venv/bin/activate
export TOKENIZERS_PARALLELISM=false
# only the prebuilt modules (.wheels/flashinfer-aot): a missing one fails at once naming itself
# (MissingJITCacheError) instead of compiling for minutes and failing to link without a CUDA
# toolkit; and the CUDA rmsnorm kernels (prebuilt), whichever optional packages the image has
export FLASHINFER_DISABLE_JIT=1 FLASHINFER_USE_CUDA_NORM=1
# flashinfer writes generated sources even for prebuilt modules, under $HOME by default
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-$PWD/.flashinfer-workspace}
echo "setup: ${SECONDS}s"

bench() {  # script[=result name], time limit in seconds, extra args
    local script=${1%%=*} name=${1#*=} limit=$2
    shift 2
    local start=$SECONDS
    timeout -s INT -k 30 "$limit" python "bench/gpu/$script.py" --out "$OUT/$name.json" "$@" >"$OUT/$name.log" 2>&1
    echo "== $name rc=$? $((SECONDS - start))s"
    grep -v 'Loading weights' "$OUT/$name.log" | tail -15
}

case $phase in
    test)  # (a test module that cannot import, e.g. scipy missing here, must not stop the others;
           # SIGINT at the limit: pytest still prints the failures so far)
        timeout -s INT -k 30 480 python -m pytest -m gpu -q -rs -p no:cacheprovider --continue-on-collection-errors \
            "$@" 2>&1 | tee "$OUT/test-gpu.log" | tail -40 ;;
    bench1)  # --profile: a torch.profiler table of a few steps beside the JSON (NAME.profile.txt)
        bench decode_roofline 300 --profile "$@"
        bench verify_step 150 "$@" ;;
    bench2)
        bench spec_step 240 --profile "$@"
        bench tiny_family 200 "$@" ;;
    long)  # which backend where: the README's advice was measured over 128-token prompts
        for context in ${CONTEXTS:-4096}; do
            for backend in auto torch; do
                suffix=_ctx$context$([ $backend = torch ] && echo _torch)
                bench verify_step=verify_step$suffix 70 --prefix-len $context --backend $backend "$@"
                bench spec_step=spec_step$suffix 90 --prompt-len $context --batch-sizes --backend $backend "$@"
            done
        done ;;
    *)
        echo "unknown phase '$phase': test, bench1, bench2 or long" >&2
        exit 2 ;;
esac
echo "total: ${SECONDS}s"
