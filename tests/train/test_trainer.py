"""The training loop's state: checkpoints every N steps and when training stops, and a resumed run
continues that state (steps, weights, optimiser) rather than starting over."""

import csv
import dataclasses

import pytest
import torch
from safetensors.torch import load_file

from specflow.config import ConfigError
from specflow.models import load_model, loader
from specflow.models.eagle import load_eagle
from specflow.models.eagle3 import load_eagle3
from specflow.models.medusa import load_medusa
from specflow.train import data as train_data
from specflow.train import train
from specflow.train.trainer import StepTimer
from tests.train.runs import tiny_config

SHAPE = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64}


def resumed(cfg, **trainer):
    return dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, **trainer))


def test_a_resumed_run_continues_the_saved_state(tmp_path, tiny_target):
    cfg = tiny_config(tmp_path, {"type": "lm", "tokenizer": str(tiny_target), "model": SHAPE}, steps=6,
                      trainer_extra={"checkpoint_every_n_steps": 4, "log_every_n_steps": 1})
    first = train(cfg)
    last = tmp_path / "log" / "checkpoints" / "last.ckpt"
    assert first.summary["steps"] == 6 and first.summary["training_state"] == str(last)
    state = torch.load(last, weights_only=False)
    assert state["global_step"] == 6
    exported = load_file(tmp_path / "out" / "model.safetensors")

    # resuming at the saved step trains no further: the export is the first run's, bit for bit
    again = train(resumed(cfg, resume="last"))
    assert again.summary["steps"] == 6
    assert all(torch.equal(v, exported[k]) for k, v in load_file(tmp_path / "out" / "model.safetensors").items())

    # resuming with a larger max_steps continues from step 6 with the saved optimiser state
    with pytest.warns(UserWarning, match="max_steps is 9 but the checkpoint's run had 6: the warmup-cosine"):
        more = train(resumed(cfg, resume=str(last), max_steps=9))
    assert more.summary["steps"] == 9
    optim = torch.load(last, weights_only=False)["optimizer_states"][0]["state"]
    assert {int(s["step"]) for s in optim.values()} == {9}   # Adam's step count: 6 saved + 3 resumed
    steps = [int(r["step"]) for r in csv.DictReader((tmp_path / "log" / "metrics.csv").open()) if r["train/ce"]]
    assert steps == sorted(steps) and steps[0] < 6 <= steps[-1]   # the curve spans both parts


def test_resume_without_a_checkpoint_fails_before_training(tmp_path, tiny_target):
    cfg = tiny_config(tmp_path, {"type": "lm", "tokenizer": str(tiny_target), "model": SHAPE}, steps=2,
                      trainer_extra={"resume": "last"})
    with pytest.raises(ConfigError, match="train.trainer.resume: no checkpoint at .*last.ckpt"):
        train(cfg)
    assert not (tmp_path / "out").exists()


STOPS = {  # trainer settings, the step it stops at, how; 24 sequences of batch 8: 3 batches an epoch
    "crash mid-epoch": ({"checkpoint_every_n_steps": 4, "limit_val_batches": 0}, 4, "crash"),
    "crash mid-epoch, workers": ({"checkpoint_every_n_steps": 4, "limit_val_batches": 0, "num_workers": 1}, 4, "crash"),
    "crash at an epoch's end, workers": ({"checkpoint_every_n_steps": 3, "limit_val_batches": 1, "num_workers": 1},
                                         3, "crash"),
    "max_steps mid-epoch, then more": ({"checkpoint_every_n_steps": 100, "limit_val_batches": 0}, 4, "max_steps"),
    "max_time mid-epoch (validates)": ({"checkpoint_every_n_steps": 100, "limit_val_batches": 1}, 4, "max_time"),
    # trainer.max_time itself, out at once, while 2 batches accumulate into each step: it stops when
    # the first step ends, not after the first batch, whose gradient no step would have applied
    "max_time accumulating": ({"checkpoint_every_n_steps": 100, "limit_val_batches": 1,
                               "accumulate_grad_batches": 2}, 1, "trainer.max_time"),
}


@pytest.mark.parametrize("stop", list(STOPS))
def test_an_interrupted_run_resumes_to_the_uninterrupted_weights(tmp_path, tiny_target, monkeypatch, stop):
    """A run stopped mid-epoch and resumed ends with the weights of a run never stopped: the resumed
    run sees the same batches (not epoch 0's order again, nor the next epoch's where Lightning's
    final save marks the stopped epoch done, nor epoch 0's where workers draw indices before the
    epoch hooks) and the same EAGLE feature noise (the global RNG)."""
    import lightning as L

    extra, at, how = STOPS[stop]

    def config(name, **trainer):
        cfg = tiny_config(tmp_path / name, {"type": "eagle"}, target=tiny_target, steps=8,
                          data={"max_tokens": 1600}, trainer_extra=extra)   # 24 sequences: 3 batches an epoch
        return resumed(cfg, **trainer)

    train(config("whole"))

    class Crash(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if trainer.global_step == at:   # after step `at`'s checkpoint
                raise RuntimeError("interrupted")

    class OutOfTime(L.Callback):   # what Lightning's Timer does once max_time has passed
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if trainer.global_step == at:
                trainer.should_stop = True

    init = L.Trainer.__init__
    stopper = {"crash": [Crash()], "max_time": [OutOfTime()]}.get(how, [])
    monkeypatch.setattr(L.Trainer, "__init__", lambda self, *a, **kw: init(
        self, *a, **{**kw, "callbacks": [*kw["callbacks"], *stopper]}))
    if how == "crash":
        with pytest.raises(RuntimeError, match="interrupted"):
            train(config("split"))
    else:
        stop = {"max_steps": {"max_steps": at}, "trainer.max_time": {"max_time": "00:00:00:00"}}.get(how, {})
        assert train(config("split", **stop)).summary["steps"] == at
    monkeypatch.setattr(L.Trainer, "__init__", init)
    assert torch.load(tmp_path / "split" / "log" / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == at
    assert train(config("split", resume="last")).summary["steps"] == 8

    whole = load_file(tmp_path / "whole" / "out" / "model.safetensors")
    split = load_file(tmp_path / "split" / "out" / "model.safetensors")
    assert whole.keys() == split.keys()
    for k in whole:
        assert torch.equal(whole[k], split[k]), (k, (whole[k] - split[k]).abs().max())


def test_max_time_bounds_each_part_of_a_resumed_run(tmp_path, tiny_target):
    """Lightning's Timer keeps the time elapsed in the checkpoint: a run max_time stopped, resumed
    with the same max_time, stopped again before a step. Each part now gets max_time afresh."""
    cfg = tiny_config(tmp_path, {"type": "eagle"}, target=tiny_target, steps=8, data={"max_tokens": 1600},
                      trainer_extra={"checkpoint_every_n_steps": 100, "limit_val_batches": 0,
                                     "max_time": "00:00:00:00"})   # out of time when each step ends
    assert train(cfg).summary["steps"] == 1
    assert train(resumed(cfg, resume="last")).summary["steps"] == 2
    timer = StepTimer("00:01:00:00")
    timer.load_state_dict({"time_elapsed": {"train": 3600.0}})   # (a checkpoint's hour gone)
    assert timer.time_elapsed() == 0.0


def test_resuming_from_a_file_that_is_no_training_checkpoint_names_the_key(tmp_path, tiny_target):
    bare = tmp_path / "weights.pt"
    torch.save({"head.fc.weight": torch.zeros(2, 2)}, bare)
    cfg = tiny_config(tmp_path, {"type": "eagle"}, target=tiny_target, steps=2, trainer_extra={"resume": str(bare)})
    with pytest.raises(ConfigError, match=r"train.trainer.resume: .*weights.pt is not a Lightning training checkpoint"):
        train(cfg)


@pytest.mark.parametrize("recipe", [{"type": "eagle"}, {"type": "eagle3", "taps": [1]},
                                    {"type": "medusa", "num_heads": 2}], ids=lambda r: r["type"])
def test_a_head_export_reads_the_target_weights_no_second_time(recipe, tmp_path, tiny_target, monkeypatch):
    """The export builds the head from the target's config.json: a second load of the target (for an
    8B one, another 32 GB in float32) while the trained module still holds it could run out of memory
    at the very end of a run."""
    reads = []
    read_weights = loader.read_weights
    monkeypatch.setattr(loader, "read_weights", lambda file, device: reads.append(file) or read_weights(file, device))
    train(tiny_config(tmp_path, recipe, target=tiny_target, steps=2))
    assert reads == [tiny_target / "model.safetensors"]
    loaders = {"eagle": load_eagle, "eagle3": load_eagle3, "medusa": load_medusa}
    assert loaders[recipe["type"]](tmp_path / "out", load_model(tiny_target))   # (the export loads back)


@pytest.mark.parametrize("recipe", [{"type": "eagle"}, {"type": "eagle3", "taps": [1]},
                                    {"type": "medusa", "num_heads": 2}, {"type": "distill", "model": SHAPE}],
                         ids=lambda r: r["type"])
def test_the_frozen_target_is_loaded_in_the_dtype_the_run_computes_in(recipe, tmp_path, tiny_target, monkeypatch):
    """(a head recipe loaded its target in float32 whatever the precision: an 8B target held 32 GB
    under bf16-mixed, whose matmuls run in bfloat16 anyway); the trained weights stay float32, and
    EAGLE-3's continuations are written in that dtype too"""
    data = {"generated_tokens": 1200} if recipe["type"] == "eagle3" else None
    written = []   # the dtype of each generate_continuations call
    generate = train_data.generate_continuations
    monkeypatch.setattr(train_data, "generate_continuations",
                        lambda *a, dtype, **kw: written.append(dtype) or generate(*a, dtype=dtype, **kw))
    for precision, dtype in (("bf16-mixed", torch.bfloat16), ("32-true", torch.float32)):
        cfg = tiny_config(tmp_path / precision, recipe, target=tiny_target, steps=2, data=data,
                          trainer_extra={"precision": precision, "log_every_n_steps": 1})
        module = train(cfg).module
        target = module.teacher if recipe["type"] == "distill" else module.target
        assert {p.dtype for p in target.parameters()} == {dtype}
        assert {p.dtype for p in module.trainable().parameters() if p.requires_grad} == {torch.float32}
        losses = [float(r["train/loss"]) for r in csv.DictReader((tmp_path / precision / "log" / "metrics.csv").open())
                  if r.get("train/loss")]
        assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    if recipe["type"] == "eagle3":
        assert written == [torch.bfloat16, torch.float32]
