"""``specflow run | sweep | serve | app | train | bench | list | make-model``."""

from __future__ import annotations

import argparse
import os
import sys

from specflow.config import ConfigError
from specflow.registry import RegistryError, load_module

THREADS_HELP = "torch intra-op threads (default: torch's; small models often run faster with 1)"


def cmd_list(args: argparse.Namespace) -> None:
    from specflow.registry import ALL, VERIFIERS, describe

    for kind, registry in ALL.items():
        print(f"== {kind}s ==")
        print("   " + registry.contract.replace("\n", "\n   "))
        for name in registry.names():
            cls, _ = registry.get(name)
            params = ", ".join(f"{n}={d!r}" for n, _, d in describe(cls))
            label = f"[{_lossless_label(cls)}]" if registry is VERIFIERS else ""
            print(f"  {name:<12} " + "  ".join(part for part in (params, label) if part))
        print()


def _lossless_label(cls: type) -> str:
    """A verifier's declared ``lossless``: a class attribute, or a property (its docstring says when)."""
    flag = getattr(cls, "lossless", None)
    if isinstance(flag, bool):
        return "lossless" if flag else "lossy"
    if isinstance(flag, property) and flag.__doc__:
        return flag.__doc__
    return "lossless or not: set when built"


def _set_threads(threads: int | None) -> None:
    if threads is not None:
        if threads < 1:
            raise ValueError(f"--threads must be >= 1, got {threads}")
        import torch

        torch.set_num_threads(threads)


def cmd_run(args: argparse.Namespace) -> None:
    from specflow.bench.experiment import failed_pipelines, run_experiment

    _set_threads(args.threads)
    if failed := failed_pipelines(run_experiment(args.config, args.overrides)):
        raise SystemExit(f"specflow run: error: {failed}")


def cmd_sweep(args: argparse.Namespace) -> None:
    from specflow.bench.experiment import failed_pipelines
    from specflow.bench.sweep import run_sweep

    _set_threads(args.threads)
    failed = [f"{'at ' + point + ': ' if point else ''}{failed}"
              for point, results in run_sweep(args.config, args.grid, args.overrides).items()
              if (failed := failed_pipelines(results))]
    if failed:
        raise SystemExit(f"specflow sweep: error: {'; '.join(failed)}")


def cmd_bench(args: argparse.Namespace) -> None:
    from specflow.bench.decode import run_decode_bench

    _set_threads(args.threads)
    run_decode_bench(args.target, batch_sizes=args.batch_sizes, max_tokens=args.max_tokens,
                     prompt_len=args.prompt_len, repeats=args.repeats, out=args.out)


def cmd_serve(args: argparse.Namespace) -> None:
    from specflow.serve import run_server

    run_server(args.config, args.overrides, host=args.host, port=args.port, api_key=args.api_key,
               shutdown_timeout=args.shutdown_timeout)


def cmd_app(args: argparse.Namespace) -> None:
    try:
        from specflow.app.ui import launch
    except ImportError as e:
        raise SystemExit(f"specflow app: error: {e}; install the app extra: pip install 'specflow[app]'") from None
    launch(args.config, host=args.host, port=args.port)


def cmd_train(args: argparse.Namespace) -> None:
    try:
        from specflow.train import load_train_config, train
    except ImportError as e:
        raise SystemExit(f"specflow train: error: {e}; install the train extra: pip install 'specflow[train]'") from None
    result = train(load_train_config(args.config, args.overrides))
    if result.is_global_zero:  # (under DDP every rank returns: one summary, not one per process)
        print("\n".join(f"{k}: {v}" for k, v in result.summary.items()))


def cmd_make_model(args: argparse.Namespace) -> None:
    from pathlib import Path

    from specflow.models.random import make_random_checkpoint

    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not args.force:
        raise ValueError(f"{out} exists and is not an empty directory; pass --force to write the random "
                         "checkpoint over it")
    make_random_checkpoint(args.out, hidden_size=args.hidden_size, num_layers=args.num_layers,
                           vocab_size=args.vocab_size, seed=args.seed)
    print(f"wrote a random-weight Llama checkpoint with a BPE tokenizer to {args.out}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specflow", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("list", help="registered drafters, tree builders and verifiers")
    p.set_defaults(fn=cmd_list)

    p = sub.add_parser("run", help="run a YAML experiment against the same-run baseline")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", help="key=value overrides")
    p.add_argument("--threads", type=int, default=None, help=THREADS_HELP)
    p.set_defaults(fn=cmd_run)

    p = sub.add_parser("sweep", help="grid over pipeline parameters (and batch size, sampling, engine); "
                                     "saves and prints the best point")
    p.add_argument("config")
    p.add_argument("--grid", action="append", default=[], help="key=v1,v2,... (repeatable)")
    p.add_argument("overrides", nargs="*", help="key=value overrides")
    p.add_argument("--threads", type=int, default=None, help=THREADS_HELP)
    p.set_defaults(fn=cmd_sweep)

    p = sub.add_parser("bench", help="plain-decoding tokens/s against transformers generate")
    p.add_argument("target")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help=THREADS_HELP)
    p.add_argument("--out", default=None, help="also write the numbers as JSON here")
    p.set_defaults(fn=cmd_bench)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, streaming, /metrics)")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. engine.spec_max_batch_size=8")
    p.add_argument("--host", default="127.0.0.1", help="bind address (loopback unless you say otherwise)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("SPECFLOW_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $SPECFLOW_API_KEY, else none)")
    p.add_argument("--shutdown-timeout", type=int, default=30,
                   help="seconds in-flight requests may finish after SIGINT/SIGTERM before they are cancelled")
    p.set_defaults(fn=cmd_serve)

    p = sub.add_parser("train", help="train a target, draft model or drafter head with a Lightning recipe")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. trainer.devices=4 trainer.strategy=ddp")
    p.set_defaults(fn=cmd_train)

    p = sub.add_parser("make-model", help="write a small random-weight Llama checkpoint (+ tokenizer)")
    p.add_argument("out")
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="write over a directory that is not empty")
    p.set_defaults(fn=cmd_make_model)

    p = sub.add_parser("app", help="Gradio app: each step's draft tree and accepted path, live")
    p.add_argument("config", nargs="?", help="experiment YAML (target + pipelines); default: zoo/tiny-code")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=7860)
    p.set_defaults(fn=cmd_app)

    for name in ("list", "run", "sweep", "serve", "app"):
        sub.choices[name].add_argument(
            "--plugin", action="append", default=[], metavar="MODULE",
            help="import a module of components first: a .py file or a module name (repeatable)")

    args, extra = parser.parse_known_args(argv)
    if extra:  # key=value overrides may follow an option (sweep ... --grid tree.depth=3,5 sampling.seed=1)
        if not hasattr(args, "overrides") or any(a.startswith("-") for a in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides += extra
    try:
        for spec in getattr(args, "plugin", []):
            load_module(spec)
        args.fn(args)
    except (ConfigError, RegistryError, ValueError, FileNotFoundError, ModuleNotFoundError,
            NotImplementedError) as e:  # (a checkpoint the native models cannot run: rope type, activation)
        print(f"specflow {args.command}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
