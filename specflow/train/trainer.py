"""The Lightning loop behind ``specflow train``: fit a recipe, export its checkpoint and loss curves."""

from __future__ import annotations

import dataclasses
import json
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import ModelCheckpoint, Timer
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, RandomSampler

from specflow.config import ConfigError, build_component, dump_yaml
from specflow.train.config import RECIPES, TrainConfig


@dataclass
class TrainResult:
    """A finished run: its summary (steps, wall time, last logged losses, provenance) and the
    trained LightningModule (on rank zero, the exported weights are this module's).
    ``is_global_zero``: whether this process is rank zero (under DDP every rank returns one)."""

    summary: dict
    module: Any
    is_global_zero: bool = True


def train(run: TrainConfig) -> TrainResult:
    """Fit the recipe with Lightning, then export the checkpoint and the loss curves."""
    if run.trainer.num_threads is not None:
        torch.set_num_threads(run.trainer.num_threads)
    L.seed_everything(run.seed, workers=True, verbose=False)
    recipe = build_component(RECIPES, run.recipe, "train.recipe")
    log_dir = run.log_path()
    t = run.trainer
    checkpoints = log_dir / "checkpoints"
    resume = checkpoints / "last.ckpt" if t.resume == "last" else t.resume
    if resume is not None and not Path(resume).is_file():
        raise ConfigError(f"train.trainer.resume: no checkpoint at {resume} ('last' reads "
                          f"<log_dir>/checkpoints/last.ckpt, written by trainer.checkpoint_every_n_steps)")
    metrics = log_dir / "metrics.csv"
    earlier = read_rows(metrics) if resume is not None else []   # (Lightning's CSV logger deletes the file)
    checkpointing = t.checkpoint_every_n_steps is not None
    order = DataOrder()   # a resumed run sees the batches (and noise) the uninterrupted run would
    callbacks = [order] + ([ModelCheckpoint(dirpath=checkpoints, every_n_train_steps=t.checkpoint_every_n_steps,
                                            save_top_k=0, save_last=True)] if checkpointing else [])
    try:  # before the recipe's setup (minutes: the target, the corpus), so a bad setting costs nothing
        if t.max_time is not None:
            callbacks.append(StepTimer(t.max_time))
        trainer = L.Trainer(
            accelerator=t.accelerator, devices=t.devices, strategy=t.strategy, num_nodes=t.num_nodes,
            precision=t.precision, max_steps=t.max_steps,
            val_check_interval=t.val_check_interval, check_val_every_n_epoch=None if t.val_check_interval else 1,
            limit_val_batches=t.limit_val_batches, log_every_n_steps=t.log_every_n_steps,
            gradient_clip_val=t.gradient_clip_val, gradient_clip_algorithm=t.gradient_clip_algorithm,
            accumulate_grad_batches=t.accumulate_grad_batches,
            enable_progress_bar=t.enable_progress_bar, enable_checkpointing=checkpointing, callbacks=callbacks,
            enable_model_summary=False, num_sanity_val_steps=0,
            logger=CSVLogger(str(log_dir), name="", version=""), default_root_dir=str(log_dir))
    except (MisconfigurationException, ValueError, TypeError) as e:
        raise ConfigError(f"train.trainer: {e}") from None
    job = recipe.setup(run)
    if resume is not None:
        check_resumable(resume, job.module)
    order.sampler = EpochShuffle(job.train_data, run.seed)
    order.batch_size = run.optim.batch_size
    # (a generator of its own: the loader's draw of its workers' seed would otherwise move the
    # global RNG, which a resumed run restores)
    train_loader = DataLoader(job.train_data, batch_size=run.optim.batch_size, sampler=order.sampler,
                              drop_last=True, num_workers=t.num_workers,
                              generator=torch.Generator().manual_seed(run.seed))
    if len(train_loader) == 0:  # Lightning would only warn, and the untrained weights be exported
        raise ConfigError(f"train: {len(job.train_data)} training sequences fill no batch of optim.batch_size="
                          f"{run.optim.batch_size}; lower it, or give more data (data.max_files, data.max_tokens)")
    # (a generator of its own too: Lightning validates when max_time stops a run, just before the
    # state is saved, and a draw from the global RNG there would change the resumed run's noise)
    val_loader = (DataLoader(job.val_data, batch_size=run.optim.batch_size, num_workers=t.num_workers,
                             generator=torch.Generator().manual_seed(run.seed))
                  if job.val_data is not None else None)
    start = time.time()
    with warnings.catch_warnings():
        # the frozen target (and any frozen part of a recipe) is in eval mode on purpose
        warnings.filterwarnings("ignore", r"Found \d+ module\(s\) in eval mode at the start of training")
        # (Lightning's own use of torch's deprecated LeafSpec: nothing a user can change)
        warnings.filterwarnings("ignore", r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning)
        if resume is not None:  # (the earlier curves are read above and joined to the new ones)
            warnings.filterwarnings("ignore", r"Experiment logs directory .* exists and is not empty")
        if trainer.world_size == 1:  # DataOrder resumes mid-epoch, which Lightning cannot see
            warnings.filterwarnings("ignore", "You're resuming from a checkpoint that ended before the epoch ended")
        trainer.fit(job.module, train_loader, val_loader, ckpt_path=resume)
    wall = time.time() - start
    if checkpointing:  # the state where training stopped (max_steps, max_time), to continue from
        trainer.save_checkpoint(checkpoints / "last.ckpt", weights_only=False)  # (the whole state, said)
    state = trainer.strategy.lightning_module_state_dict()   # gathered in full under FSDP
    tokens = (trainer.global_step * t.accumulate_grad_batches * trainer.world_size
              * run.optim.batch_size * run.data.seq_len)
    summary = {"name": run.name, "steps": trainer.global_step, "tokens_seen": tokens, "wall_s": round(wall, 1),
               **{k: round(float(v), 4) for k, v in trainer.callback_metrics.items()}, **job.info,
               "checkpoint": str(run.output_dir), "curves": str(log_dir),
               **({"training_state": str(checkpoints / "last.ckpt")} if checkpointing else {})}
    if trainer.is_global_zero:
        out = Path(run.output_dir)
        recipe.export(run, {k: v.detach().cpu() for k, v in state.items()}, out)
        dump_yaml(dataclasses.asdict(run), log_dir / "train_config.yaml")
        (log_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        if earlier:
            join_curves(earlier, metrics)
        if metrics.exists():   # absent when nothing was logged (very short runs)
            plot_losses(metrics, log_dir / "loss.png", run.name)
    return TrainResult(summary, job.module, trainer.is_global_zero)


def check_resumable(ckpt: str | Path, module: L.LightningModule) -> None:
    """Refuse, before training, a checkpoint whose weights are not ``module``'s (another recipe's,
    or another shape's), naming a tensor and both shapes; Lightning fails deep in ``fit``."""
    try:
        saved = torch.load(ckpt, map_location="cpu", weights_only=False, mmap=True)["state_dict"]
    except Exception as e:   # (a head's safetensors, a bare state dict: no Lightning checkpoint)
        raise ConfigError(f"train.trainer.resume: {ckpt} is not a Lightning training checkpoint "
                          f"(written by trainer.checkpoint_every_n_steps): {type(e).__name__}: {e}") from None
    own = module.state_dict()
    missing, unexpected = sorted(own.keys() - saved.keys()), sorted(saved.keys() - own.keys())
    if missing or unexpected:
        raise ConfigError(f"train.trainer.resume: {ckpt} holds another model's weights (another recipe's?): "
                          f"{len(missing)} of this run's tensors missing (first: {missing[:3]}), "
                          f"{len(unexpected)} unknown (first: {unexpected[:3]})")
    for name, value in own.items():
        if saved[name].shape != value.shape:
            raise ConfigError(f"train.trainer.resume: {ckpt}: tensor {name} has shape {tuple(saved[name].shape)}, "
                              f"this run's {tuple(value.shape)}")


class EpochShuffle(RandomSampler):
    """One seeded shuffle per data epoch (a function of (seed, epoch) alone), served from a position
    in it (``epoch``, ``start`` samples) that the run advances (DataOrder): an iterator yields the
    rest of the current epoch's order. Lightning's epochs play no part, so a resumed run sees the
    batches the uninterrupted run did, whether it stopped on a checkpoint mid-epoch or on max_steps
    or max_time (whose final save Lightning marks as the end of an epoch)."""

    def __init__(self, data, seed: int):
        super().__init__(data)
        self.seed, self.epoch, self.start = seed, 0, 0

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed)
        for _ in range(self.epoch + 1):   # epoch e's order is the generator's (e + 1)-th permutation
            order = torch.randperm(len(self.data_source), generator=g)
        # (read the position now: a loader with workers makes its iterator before Lightning's epoch hooks)
        return iter(order[self.start:].tolist())


class StepTimer(Timer):
    """``trainer.max_time``: Lightning's Timer, but looked at only when an optimiser step ends (a
    stop between the micro-batches of an accumulated step would save a run whose next batches the
    resumed one skips), and for each part of a resumed run afresh (Lightning's keeps the time
    elapsed in the checkpoint, so a run it stopped resumed with the same max_time at once)."""

    def __init__(self, duration: str):
        super().__init__(duration=duration, interval="step")
        self._step = -1   # the global step at the last look

    def on_train_batch_end(self, trainer, *args, **kwargs) -> None:
        if trainer.global_step != self._step:
            self._step = trainer.global_step
            super().on_train_batch_end(trainer, *args, **kwargs)

    def on_train_start(self, trainer, module) -> None:
        super().on_train_start(trainer, module)
        self._step = trainer.global_step

    def on_fit_start(self, trainer, *args, **kwargs) -> None:
        pass   # (Lightning's looks at a restored time elapsed here; each part starts afresh)

    def load_state_dict(self, state_dict: dict) -> None:
        pass


class DataOrder(L.Callback):
    """Keeps in a training checkpoint the position in the data order (EpochShuffle) and the global
    RNG (EAGLE's feature noise); resuming restores both, so the run continues as if never stopped.
    Under a multi-process strategy Lightning swaps in its DistributedSampler and only the RNG is
    kept."""

    def __init__(self):
        self.sampler: EpochShuffle | None = None
        self.batch_size = 1
        self.saved_max_steps: int | None = None   # the max_steps of the run a resumed run continues
        self._max_steps: int | None = None

    def on_train_start(self, trainer, module) -> None:
        saved = self.saved_max_steps
        if saved is not None and saved != trainer.max_steps:
            warnings.warn(f"trainer.max_steps is {trainer.max_steps} but the checkpoint's run had {saved}: the "
                          f"warmup-cosine schedule is stretched to the new max_steps, so the learning rate jumps "
                          f"at step {trainer.global_step} and the run will not end with the weights of an "
                          f"uninterrupted {trainer.max_steps}-step run", stacklevel=1)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        s = self.sampler   # (before ModelCheckpoint, which Lightning runs last, saves this state)
        s.start += self.batch_size
        if s.start + self.batch_size > len(s.data_source):   # drop_last: no full batch left
            s.epoch, s.start = s.epoch + 1, 0

    def state_dict(self) -> dict:
        state = {"epoch": self.sampler.epoch, "start": self.sampler.start, "rng": torch.get_rng_state(),
                 "max_steps": self._max_steps}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda_rng"] = torch.cuda.get_rng_state_all()
        return state

    def setup(self, trainer, module, stage: str) -> None:
        self._max_steps = trainer.max_steps

    def load_state_dict(self, state: dict) -> None:
        self.sampler.epoch, self.sampler.start = state["epoch"], state["start"]
        self.saved_max_steps = state.get("max_steps")
        torch.set_rng_state(state["rng"])
        if "cuda_rng" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda_rng"])


def read_rows(metrics_csv: Path) -> list[dict]:
    """The rows of a Lightning CSV log ([] when there is none)."""
    import csv

    if not metrics_csv.exists():
        return []
    with metrics_csv.open(newline="") as f:
        return list(csv.DictReader(f))


def join_curves(earlier: list[dict], metrics_csv: Path) -> None:
    """Put a resumed run's earlier rows (those before its first new step) back in front of the
    rows it logged, so the curves cover the whole run."""
    import csv

    rows = read_rows(metrics_csv)
    first = min((int(r["step"]) for r in rows), default=None)
    rows = [r for r in earlier if first is None or int(r["step"]) < first] + rows
    keys = sorted({k for r in rows for k in r})
    with metrics_csv.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)


def plot_losses(metrics_csv: Path, png: Path, title: str) -> None:
    """Every ``*loss``/``*ce`` column of Lightning's CSV log against the step, one PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_rows(metrics_csv)
    keys = [k for k in (rows[0] if rows else {}) if k.endswith(("loss", "ce")) or "/ce" in k]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for k in keys:
        pts = [(int(r["step"]), float(r[k])) for r in rows if r.get(k)]
        if pts:
            ax.plot(*zip(*pts), label=k, marker="o" if k.startswith("val") else None, markersize=3)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats)")
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=80)
    plt.close(fig)
