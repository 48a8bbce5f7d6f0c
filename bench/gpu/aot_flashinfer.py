"""Build, ahead of time and without a GPU, the flashinfer JIT modules specflow runs on an H200, so
the offline GPU machine loads them instead of compiling them on its short lease.

flashinfer loads ``<package>/data/aot/<name>/<name>.so`` when it exists (before any JIT build, and
falling back to one if the load fails), and its modules link only libcudart and the tvm-ffi
symbols, so a module nvcc builds here for sm_90a runs there. Needs nvcc (CUDA 13, like the GPU
machine's) and flashinfer importable; writes ``OUT/<name>/<name>.so``, which
``bench/gpu/setup_device.sh`` copies into the installed package::

    python bench/gpu/aot_flashinfer.py .wheels/flashinfer-aot

The modules: fa2 paged decode and prefill (with custom masks) for bfloat16, head_dim 64 (the
shipped tiny family) and 128 (Llama-3.1-8B), plus rmsnorm, rope, silu_and_mul and packbits
(custom-mask packing). No model the GPU session runs has a sliding window, so the window
variants (half of the attention modules, and of the 64 MiB that travels) are built only with
``--sliding-window``; ``--head-dims 64`` builds what ``session.sh test`` needs alone. Anything
else still builds on first use there (or fails at once under FLASHINFER_DISABLE_JIT).
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path

os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", "9.0a")  # H200 (Hopper); there is no GPU to ask here

import torch  # noqa: E402

HEAD_DIMS = (64, 128)
DTYPE = torch.bfloat16


def specs(head_dims: tuple[int, ...] = HEAD_DIMS, windows: tuple[bool, ...] = (False,)) -> list:
    from flashinfer.jit import gen_act_and_mul_module
    from flashinfer.jit.attention.modules import _gen_batch_prefill_primary_module, gen_batch_decode_module
    from flashinfer.jit.norm import gen_norm_module
    from flashinfer.jit.quantization import gen_quantization_module
    from flashinfer.jit.rope import gen_rope_module

    out = [gen_norm_module(), gen_rope_module(), gen_act_and_mul_module("silu"), gen_quantization_module()]
    for head_dim in head_dims:
        for window in windows:
            # the argument lists BatchDecode/BatchPrefillWithPagedKVCacheWrapper.plan pass (fa2, int32
            # indices, no positional encoding in the kernel, no logits cap, no fp16 qk reduction)
            args = (DTYPE, DTYPE, DTYPE, torch.int32, head_dim, head_dim, 0, window, False)
            out += [gen_batch_decode_module(*args), _gen_batch_prefill_primary_module("fa2", *args, False)]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, help="folder of <name>/<name>.so")
    p.add_argument("--head-dims", type=int, nargs="+", default=list(HEAD_DIMS), help="attention head dims to build")
    p.add_argument("--sliding-window", action="store_true", help="also the sliding-window attention variants")
    args = p.parse_args()
    for spec in specs(tuple(args.head_dims), (False, True) if args.sliding_window else (False,)):
        target = args.out / spec.name / f"{spec.name}.so"
        if target.exists():
            print(f"have  {spec.name}")
            continue
        start = time.perf_counter()
        spec.build()
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(spec.jit_library_path, target)
        print(f"built {spec.name}: {target.stat().st_size / 2**20:.1f} MiB in {time.perf_counter() - start:.0f}s",
              flush=True)
    total = sum(f.stat().st_size for f in args.out.rglob("*.so"))
    print(f"{args.out}: {total / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
