"""Repack a flashinfer-python wheel without what specflow's attention path never touches.

    python bench/gpu/slim_flashinfer.py flashinfer_python-0.7.2.post1-py3-none-any.whl .wheels/

Written for 0.7.2.post1 (62 MB wheel, 420+ MB unpacked), so that the wheel fits in the 64 MiB
that travels to the offline GPU machine. Kept:

- Python: every module ``import flashinfer`` and the kept APIs (decode, prefill, page, norm, rope,
  activation, sampling, quantization's packbits, cascade, jit) can import, found by following all
  import statements (including those inside functions), plus the sibling modules of each kept
  one (for importlib-based lazy imports). flashinfer/__init__.py imports fused_moe, gemm and
  parts of experimental, so their Python stays; their CUDA sources go.
- JIT sources (flashinfer/data): csrc files of the kept kernels (SEEDS) and every csrc header they
  include; flashinfer's own headers; the include roots of the vendored cutlass, cccl and spdlog
  (the JIT passes them to nvcc). Dropped: the other ~270 csrc entries (MoE, GEMM, comm, MLA,
  trtllm, ...), cutlass/cccl examples, tests, docs and Python packages.

The output is ``flashinfer_python-<version>+slim-py3-none-any.whl``; install it with --no-deps.
"""

from __future__ import annotations

import argparse
import ast
import base64
import fnmatch
import hashlib
import re
import zipfile
from pathlib import Path, PurePosixPath

PKG = "flashinfer"
ROOT_MODULES = ["flashinfer", "flashinfer.decode", "flashinfer.prefill", "flashinfer.page", "flashinfer.norm",
                "flashinfer.rope", "flashinfer.activation", "flashinfer.sampling", "flashinfer.quantization",
                "flashinfer.cascade", "flashinfer.jit"]
# top-level csrc files the kept JIT generators read (flashinfer/jit/attention/modules.py, jit/{norm,rope,
# page,sampling,quantization,cascade}.py); activation's source is generated from a string
SEEDS = ["batch_decode*", "batch_prefill*", "single_decode*", "single_prefill*", "cascade.cu", "norm.cu",
         "page.cu", "quantization.cu", "rope.cu", "sampling.cu", "renorm.cu",
         "flashinfer_cascade_binding.cu", "flashinfer_norm_binding.cu", "flashinfer_page_binding.cu",
         "flashinfer_quantization_binding.cu", "flashinfer_rope_binding.cu", "flashinfer_sampling_binding.cu"]
KEEP_TREES = ["data/include/", "data/cutlass/include/", "data/cutlass/tools/util/include/", "data/cccl/cub/cub/",
              "data/cccl/thrust/thrust/", "data/cccl/libcudacxx/include/", "data/spdlog/include/"]
LICENSE = re.compile(r"^data/(cutlass|cccl|spdlog)/LICENSE[^/]*$")
INCLUDE = re.compile(rb'^\s*#\s*include\s*[<"]([^>"]+)[>"]', re.M)


def module_file(names: set[str], module: str) -> str | None:
    base = module.replace(".", "/")
    for path in (f"{base}/__init__.py", f"{base}.py"):
        if path in names:
            return path
    return None


def imported_modules(source: bytes, path: str) -> set[str]:
    """Every ``flashinfer...`` name an import statement in ``path`` may load (all scopes)."""
    package = path.rsplit("/", 1)[0].replace("/", ".")
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # names may be submodules
    return {m for m in found if m == PKG or m.startswith(PKG + ".")}


def python_closure(wheel: zipfile.ZipFile) -> set[str]:
    names = set(wheel.namelist())
    keep, todo = set(), list(ROOT_MODULES)
    while todo:
        parts = todo.pop().split(".")
        for i in range(1, len(parts) + 1):  # importing a.b.c runs a and a.b first
            path = module_file(names, ".".join(parts[:i]))
            if path and path not in keep:
                keep.add(path)
                todo.extend(imported_modules(wheel.read(path), path))
    dirs = {p.rsplit("/", 1)[0] for p in keep}
    siblings = {n for n in names if n.rsplit("/", 1)[0] in dirs and not n.startswith(f"{PKG}/data/")}
    return keep | siblings


def csrc_closure(wheel: zipfile.ZipFile) -> set[str]:
    """Seed csrc files plus the csrc headers they include (transitively)."""
    csrc = f"{PKG}/data/csrc/"
    names = set(wheel.namelist())
    top = [n[len(csrc):] for n in names if n.startswith(csrc) and "/" not in n[len(csrc):]]
    seeds = set()
    for pattern in SEEDS:
        matched = fnmatch.filter(top, pattern)
        if not matched:
            raise SystemExit(f"no csrc file matches {pattern!r}: is this the flashinfer version this script targets?")
        seeds.update(csrc + m for m in matched)
    keep, todo = set(), sorted(seeds)
    while todo:
        path = todo.pop()
        if path in keep:
            continue
        keep.add(path)
        here = PurePosixPath(path).parent
        for inc in INCLUDE.findall(wheel.read(path)):
            inc = inc.decode()
            for candidate in (str(here / inc), csrc + inc):
                candidate = str(PurePosixPath(candidate))
                if candidate in names and candidate.startswith(csrc):
                    todo.append(candidate)
                    break
    return keep


def kept(name: str, python: set[str], csrc: set[str]) -> bool:
    if not name.startswith(PKG + "/"):
        return True  # dist-info, rewritten below
    rel = name[len(PKG) + 1:]
    if rel.startswith("data/"):
        return (name in csrc or any(rel.startswith(t) for t in KEEP_TREES) or bool(LICENSE.match(rel))
                or (rel.count("/") == 1 and rel.endswith(".py")))
    return name in python


def record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def slim(src: Path, out_dir: Path) -> Path:
    with zipfile.ZipFile(src) as wheel:
        dist_info = next(n.split("/")[0] for n in wheel.namelist() if n.split("/")[0].endswith(".dist-info"))
        name, version = dist_info[: -len(".dist-info")].rsplit("-", 1)
        new_version = f"{version}+slim"
        new_info = f"{name}-{new_version}.dist-info"
        python, csrc = python_closure(wheel), csrc_closure(wheel)
        out = out_dir / f"{name}-{new_version}-py3-none-any.whl"
        out_dir.mkdir(parents=True, exist_ok=True)
        records = []
        with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as dst:
            for info in wheel.infolist():
                if info.is_dir() or not kept(info.filename, python, csrc) or info.filename.endswith("/RECORD"):
                    continue
                data = wheel.read(info)
                target = info.filename.replace(dist_info + "/", new_info + "/", 1)
                if target == f"{new_info}/METADATA":
                    data = re.sub(rb"^Version: .*$", f"Version: {new_version}".encode(), data, count=1, flags=re.M)
                dst.writestr(target, data)
                records.append(record_line(target, data))
            records.append(f"{new_info}/RECORD,,")
            dst.writestr(f"{new_info}/RECORD", "\n".join(records) + "\n")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("wheel", type=Path)
    parser.add_argument("out_dir", type=Path)
    args = parser.parse_args()
    out = slim(args.wheel, args.out_dir)
    print(f"{out}: {out.stat().st_size / 2**20:.1f} MiB (from {args.wheel.stat().st_size / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
