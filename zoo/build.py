"""Rebuild the shipped model family zoo/tiny-code from scratch.

    python zoo/build.py                       # every stage, in order
    python zoo/build.py --stages eagle,report # some stages (earlier outputs must exist)

Stages: tokenizer -> target -> draft -> eagle -> eagle3 -> medusa -> prompts -> eval -> report. Each
training stage runs ``configs/train/<stage>.yaml`` through ``specflow train``'s code path
(Lightning picks the GPU when there is one, else the CPU). Provenance lands beside the models:
``corpus.json`` (every corpus file with its sha256), ``build.json`` (seeds, steps, losses, wall
times), ``curves/<stage>/`` (metrics.csv + loss.png) and ``BUILD.md`` (with the accepted lengths and
speedups of ``specflow run configs/zoo_eval.yaml`` on the held-out prompts).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
STAGES = ["tokenizer", "target", "draft", "eagle", "eagle3", "medusa", "prompts", "eval", "report"]
TRAINED = ["target", "draft", "eagle", "eagle3", "medusa"]
VOCAB_SIZE = 2048
# A chat rendered as Python comments (the family is trained on code), with tools and tool calls in
# the Hermes form the server parses: enough for /v1/chat/completions and tool use to run on it.
CHAT_TEMPLATE = (
    "{%- if tools %}{{ '# tools: ' + (tools | tojson) + '\\n' }}{% endif %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'tool' %}{{ '# tool [' ~ (m['tool_call_id'] or '') ~ ']: ' ~ (m['content'] or '') ~ '\\n' }}"
    "{%- else %}{{ '# ' ~ m['role'] ~ ': ' ~ (m['content'] or '') }}"
    "{%- if m['tool_calls'] %}{% for c in m['tool_calls'] %}"
    "{{ '<tool_call>' ~ ({'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson) ~ '</tool_call>' }}"
    "{%- endfor %}{% endif %}{{ '\\n' }}{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '# assistant:\\n' }}{% endif %}")


def stage_tokenizer(out: Path, record: dict) -> None:
    """Byte-level BPE trained on the training files of the target's corpus (held-out files excluded)."""
    from specflow.models.random import train_bpe_tokenizer
    from specflow.train import load_train_config
    from specflow.train.data import load_corpus

    cfg = load_train_config("configs/train/target.yaml", [f"output_dir={out / 'target'}"])
    corpus = load_corpus(cfg.data)
    start = time.time()
    tok = train_bpe_tokenizer(out / "target", VOCAB_SIZE, corpus.train_files)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(out / "target"))
    (out / "corpus.json").write_text(json.dumps(corpus.manifest(), indent=1) + "\n")
    record["tokenizer"] = {"vocab_size": len(tok), "eos_token": tok.eos_token, "eos_token_id": tok.eos_token_id,
                           "wall_s": round(time.time() - start, 1)}


def stage_train(stage: str, out: Path, record: dict) -> None:
    """``specflow train configs/train/<stage>.yaml`` with paths pointed into ``out``."""
    from specflow.train import load_train_config, train

    overrides = [f"output_dir={out / stage}", f"log_dir={out / 'curves' / stage}"]
    if stage != "target":
        overrides.append(f"target={out / 'target'}")
    else:
        overrides.append(f"recipe.tokenizer={out / 'target'}")
    cfg = load_train_config(f"configs/train/{stage}.yaml", overrides)
    record[stage] = {"config": f"configs/train/{stage}.yaml", "seed": cfg.seed, **train(cfg).summary}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="zoo/tiny-code", help="relative to the repository root")
    parser.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated subset of {STAGES}")
    args = parser.parse_args(argv)
    os.chdir(ROOT)  # configs and recorded paths are relative to the repository root
    out = Path(args.out)
    stages = args.stages.split(",")
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        parser.error(f"unknown stages {unknown}; choose from {STAGES}")
    out.mkdir(parents=True, exist_ok=True)
    record_file = out / "build.json"
    record = json.loads(record_file.read_text()) if record_file.exists() else {}
    record["machine"] = {"python": sys.version.split()[0], "torch": torch.__version__,
                         "platform": platform.platform(),
                         "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    for stage in STAGES:
        if stage not in stages:
            continue
        print(f"== {stage} ==", flush=True)
        if stage == "tokenizer":
            stage_tokenizer(out, record)
        elif stage in TRAINED:
            stage_train(stage, out, record)
        elif stage == "prompts":
            from zoo.report import write_prompts
            write_prompts(out, record)
        elif stage == "eval":
            from specflow.bench.experiment import run_experiment
            run_experiment("configs/zoo_eval.yaml")
        else:
            from zoo.report import write_build_md
            write_build_md(out, record)
        record_file.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
