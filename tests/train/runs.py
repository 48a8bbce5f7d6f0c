"""Small training runs on the ``tiny_target`` fixture for the recipe tests."""

from __future__ import annotations

from pathlib import Path

from specflow import SamplingParams, SpecEngine
from specflow.config import validate
from specflow.train import TrainConfig

PROMPTS = ["def parse(self, line):\n    ", "import os\nimport sys\n\n", "class Queue:\n    def __init__(self):\n",
           "    for name in names:\n        if "]

# the target's own greedy continuations: the text a greedy speculative run will see
GENERATED = {"generated_tokens": 6144, "generate_prompt_len": 8, "generate_len": 56}
# steps for an EAGLE head: the corpus is the running Python's stdlib, and on 3.12's (the GPU
# machine's) 60 steps left heads at 1.8 tokens a step, where 3.11's reached 2.7
HEAD_STEPS = 120


def tiny_config(tmp: Path, recipe: dict, *, target: Path | None = None, steps: int = 60, lr: float = 3e-3,
                data: dict | None = None, trainer_extra: dict | None = None, **top) -> TrainConfig:
    """A TrainConfig for a seconds-long CPU run over two stdlib files (64-token sequences)."""
    return validate(TrainConfig, {
        "name": "test", "output_dir": str(tmp / "out"), "log_dir": str(tmp / "log"),
        "target": str(target) if target else None, "recipe": recipe,
        "data": {"max_files": 2, "seq_len": 64, "val_sequences": 4, **(data or {})},
        "optim": {"lr": lr, "warmup_steps": 5, "batch_size": 8, "weight_decay": 0.0},
        "trainer": {"max_steps": steps, "accelerator": "cpu", "devices": 1, "enable_progress_bar": False,
                    "log_every_n_steps": 5, "val_check_interval": None, **(trainer_extra or {})},
        **top}, "train")


def mean_accept_length(target: Path, drafter: dict, max_tokens: int = 24) -> float:
    """Greedy chain-4 speculative decoding of PROMPTS: mean tokens committed per step."""
    engine = SpecEngine(target, drafter=drafter, tree={"type": "chain", "depth": 4},
                        verifier={"type": "greedy"}, device="cpu", dtype="float32")
    outs = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    steps = [a for o in outs for a in o.accept_lengths]
    return sum(steps) / len(steps)


def logged(log_dir: Path, key: str) -> list[float]:
    """The values of one logged metric, in step order, from Lightning's metrics.csv."""
    import csv

    return [float(r[key]) for r in csv.DictReader((log_dir / "metrics.csv").open()) if r.get(key)]
