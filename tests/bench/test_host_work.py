"""bench/host_work.py runs end to end, counts ops, and puts the methods it times back as they were;
no speed is asserted."""

import importlib.util
import math
from pathlib import Path

from specflow.models import LlamaForCausalLM
from specflow.models.eagle import EagleHead
from specflow.runtime.beam import Beam

ROOT = Path(__file__).resolve().parents[2]


def test_host_work_measures_every_batch_size_and_restores_the_timed_methods():
    spec = importlib.util.spec_from_file_location("bench_host_work", ROOT / "bench" / "host_work.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    timed = LlamaForCausalLM.forward, LlamaForCausalLM.compute_logits, EagleHead.forward, Beam._replay
    rows = module.main(["--batch-sizes", "1", "3", "--steps", "1"])
    assert [r["batch_size"] for r in rows] == [1, 3]
    assert all(math.isfinite(r[k]) and r[k] > 0 for r in rows
               for k in ("decode_host_ms", "spec_host_ms", "decode_ops", "spec_ops"))
    assert all(r["spec_ops"] > r["decode_ops"] for r in rows)  # a tree's build and walk dispatch more
    assert (LlamaForCausalLM.forward, LlamaForCausalLM.compute_logits, EagleHead.forward, Beam._replay) == timed
