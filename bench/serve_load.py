"""Loopback load test of `specflow serve`: throughput and p50 / p99 latency at concurrency 1, 8 and
32, with and without speculation, through the real `openai` client.

    .venv/bin/python bench/serve_load.py                     # configs/serve.yaml (the shipped tiny-code)
    .venv/bin/python bench/serve_load.py --target random engine.spec_max_batch_size=16

It starts two servers on free loopback ports and stops them at the end: the config's, and the same
config with ``engine.drafter=null`` for "plain", the engine's real plain decoding (overlapped one
step ahead; ``"speculative": false`` requests on a server with a drafter decode so too, feeding the
drafter, but verify root-only rows of speculative steps beside requests that speculate). The modes
alternate level by level. Every
level sends a fixed number of requests with ``ignore_eos`` at temperature 0 (identical work in
both modes), and the whole run is bounded by ``--timeout``.

By default the pipeline of configs/serve.yaml (n-gram drafts, EAGLE-2 tree, rejection sampling)
serves its own target, the shipped zoo/tiny-code model; ``--target random`` writes a
random-weight Llama (hidden 256, 4 layers, vocab 4096) on the spot instead, which falls into
loops at temperature 0 that n-gram drafts predict well (flattering numbers). Speculation stays
on at every batch size (``engine.spec_max_batch_size=null``) unless an override says otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai
from omegaconf import OmegaConf

PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "import os\nimport sys\n\n\ndef main(argv):\n    parser = ",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
]


def bench_config(config: Path, target: str | None, overrides: list[str], workdir: Path) -> tuple[Path, Path]:
    """``config`` with the overrides applied and its target replaced (``random``: a fresh
    random-weight checkpoint; None: the config's own, a relative path read from the repository
    root as the shipped configs are), and the same without a drafter, written to ``workdir``."""
    from specflow.models.random import make_random_checkpoint

    cfg = OmegaConf.load(config)
    if target == "random":
        target = str(make_random_checkpoint(workdir / "target", seed=0))
    elif target is None:
        target = str(Path(__file__).parents[1] / cfg.engine.target)  # (an absolute target stays as it is)
    cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(
        [f"engine.target={target}", "engine.spec_max_batch_size=null", *overrides]))
    paths = workdir / "serve.yaml", workdir / "serve_plain.yaml"
    OmegaConf.save(cfg, paths[0])
    OmegaConf.save(OmegaConf.merge(cfg, OmegaConf.from_dotlist(["engine.drafter=null"])), paths[1])
    return paths


def start_server(config: Path, threads: int, log: Path, timeout: float) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen([sys.executable, "-m", "specflow.cli", "serve", str(config), "--port", str(port)],
                            stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}; see {log}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"the server did not become healthy in {timeout} s; see {log}")


async def run_level(client: openai.AsyncOpenAI, model: str, concurrency: int, num_requests: int,
                    max_tokens: int, mode: str) -> dict:
    """``num_requests`` requests, at most ``concurrency`` in flight; latency is per request."""
    gate = asyncio.Semaphore(concurrency)
    latencies, tokens, steps = [], 0, 0

    async def one(i: int) -> None:
        nonlocal tokens, steps
        async with gate:
            t0 = time.perf_counter()
            out = await client.completions.create(
                model=model, prompt=PROMPTS[i % len(PROMPTS)], max_tokens=max_tokens, temperature=0.0,
                extra_body={"ignore_eos": True})
            latencies.append(time.perf_counter() - t0)
            tokens += out.usage.completion_tokens
            steps += out.usage.model_extra["accept_length"]["steps"]

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(num_requests)))
    wall = time.perf_counter() - t0
    q = statistics.quantiles(latencies, n=100, method="inclusive")
    return {"mode": mode, "concurrency": concurrency,
            "requests": num_requests, "tokens": tokens, "tokens_per_s": tokens / wall,
            "requests_per_s": num_requests / wall, "p50_s": q[49], "p99_s": q[98],
            "accept_length": (tokens - num_requests) / max(1, steps)}   # the first token comes from prefill


async def run(urls: dict[str, str], model: str, args: argparse.Namespace) -> list[dict]:
    """Every level on each server (mode -> its url), one after the other."""
    clients = {mode: openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=args.timeout)
               for mode, url in urls.items()}
    rows = []
    for concurrency in args.concurrency:  # warm-up: every batch size a level reaches (CUDA graphs)
        for mode, client in clients.items():
            await run_level(client, model, concurrency, max(2, concurrency), args.max_tokens, mode)
    for concurrency in args.concurrency:
        for mode, client in clients.items():
            rows.append(await run_level(client, model, concurrency, max(args.requests, concurrency),
                                        args.max_tokens, mode))
            print(format_row(rows[-1]), flush=True)
    return rows


def format_row(r: dict) -> str:
    return (f"{r['mode']:<12}{r['concurrency']:>5}{r['requests']:>6}{r['tokens']:>8}{r['tokens_per_s']:>10.1f}"
            f"{r['requests_per_s']:>8.2f}{r['p50_s']:>9.3f}{r['p99_s']:>9.3f}{r['accept_length']:>8.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--config", type=Path, default=Path(__file__).parents[1] / "configs" / "serve.yaml")
    parser.add_argument("--target", default=None,
                        help="checkpoint directory, or 'random' (default: the config's own target)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the serve config")
    parser.add_argument("--requests", type=int, default=32, help="requests per level (at least the concurrency)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the server process")
    parser.add_argument("--timeout", type=float, default=900, help="bound on the whole run, seconds")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="serve-load-") as tmp:
        config, plain = bench_config(args.config, args.target, args.overrides, Path(tmp))
        servers = {}  # mode -> (process, url)
        try:
            for mode, path in (("speculative", config), ("plain", plain)):
                servers[mode] = start_server(path, args.threads, Path(tmp) / f"{mode}.log", args.timeout)
            model = httpx.get(servers["plain"][1] + "/v1/models").json()["data"][0]["id"]
            engine = OmegaConf.load(config).engine
            print(f"server: {args.config} on {engine.target}: drafter {dict(engine.drafter)}, tree {dict(engine.tree)}, "
                  f"spec_max_batch_size {engine.spec_max_batch_size}; {args.max_tokens} new tokens per request")
            print(f"{'mode':<12}{'conc':>5}{'reqs':>6}{'tokens':>8}{'tok/s':>10}{'req/s':>8}{'p50 s':>9}"
                  f"{'p99 s':>9}{'accept':>8}")
            asyncio.run(asyncio.wait_for(run({m: url for m, (_, url) in servers.items()}, model, args), args.timeout))
        finally:
            for proc, _ in servers.values():
                proc.send_signal(signal.SIGINT)
                proc.wait(60)


if __name__ == "__main__":
    main()
