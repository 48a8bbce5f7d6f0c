"""EAGLE-3 head training (Li et al., 2025; SafeAILab/EAGLE ``eagle/traineagle3``).

No feature regression. Training-time test: the head runs ``unroll`` times over each chunk.
Step 0 reads the target's concatenated layer taps of ``x_j`` (through ``fc``) with token
``x_{j+1}`` at rotary position j; step k reads its own step-(k-1) output with token
``x_{j+1+k}`` at position j + k and attends as the depth-k draft node does (UnrolledAttention).
Step k at row j predicts ``x_{j+2+k}``; its loss is the soft cross-entropy against the target's
distribution restricted to the draft vocabulary (renormalised), on rows whose target argmax is
in the draft vocabulary, averaged over those rows (traineagle3 divides by every row: its loss is
this one times their share, the draft vocabulary's coverage), weighted by ``decay ** k``.
``acc_k`` is the fraction of all rows whose drafted token is the target's argmax (rows outside
the draft vocabulary count as misses). The
draft vocabulary is the ``draft_vocab_size`` most frequent tokens of the training data (``d2t`` /
``t2d``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from specflow.config import ConfigError, check_at_least
from specflow.models import LlamaForCausalLM
from specflow.models.eagle import new_head_config
from specflow.models.eagle3 import Eagle3Head, save_eagle3
from specflow.models.loader import read_json, resolve_dtype
from specflow.train.attention import UnrolledAttention
from specflow.train.config import RECIPES, OptimConfig, TrainConfig, TrainJob
from specflow.train.heads import head_data, meta_target, target_pass
from specflow.train.module import TrainModule, count_params, frozen


@dataclass
class Eagle3RecipeConfig:
    """EAGLE-3 head: one layer over fc(cat(taps)), its own lm_head over a draft vocabulary."""

    draft_vocab_size: int | None = None    # None: the target's whole vocabulary
    taps: list[int] | None = None          # target layer inputs; None: [2, L // 2, L - 3] (SGLang)
    unroll: int = 7                        # training-time-test steps
    decay: float = 0.8                     # step k's loss weight is decay ** k
    init_lm_head: bool = True              # start the draft lm_head from the target's rows
    save_dtype: str = "float32"
    save_format: str = "safetensors"       # or "bin": torch files, for loaders that read only those

    def __post_init__(self):
        check_at_least(self, 1, "draft_vocab_size", "unroll")
        if not self.decay > 0:
            raise ValueError(f"decay must be > 0 (step k's loss weight is decay ** k), got {self.decay}")


def draft_vocab(tokens: Tensor, vocab_size: int, size: int) -> Tensor:
    """[size] the most frequent token ids of ``tokens``, ascending (ties to the lower id)."""
    counts = torch.bincount(tokens, minlength=vocab_size).double()
    counts -= torch.arange(vocab_size) / (2 * vocab_size)   # deterministic tie-break, below one count
    return counts.topk(size).indices.sort().values


def new_eagle3_head(target: LlamaForCausalLM, hot: Tensor, taps: tuple[int, ...]) -> Eagle3Head:
    """A freshly initialised head over ``target``'s embedding, drafting among the ids ``hot``
    (one tap: ``fc`` starts as the identity, so training starts from the tap as it is)."""
    head = Eagle3Head(new_head_config(target.config, 1), target.embed_tokens, taps, draft_vocab_size=len(hot))
    if len(taps) == 1:
        nn.init.eye_(head.fc.weight)
    head.d2t.copy_(hot - torch.arange(len(hot)))
    head.t2d.zero_().index_fill_(0, hot, True)
    return head


def recipe_taps(taps: list[int] | None, num_layers: int) -> tuple[int, ...]:
    """``recipe.taps`` (None: the default) for a target of ``num_layers``, or a ConfigError."""
    chosen = tuple(taps) if taps is not None else default_taps(num_layers)
    if taps is not None and (not chosen or len(set(chosen)) != len(chosen)):
        raise ConfigError(f"train.recipe.taps: {list(taps)}: give one or more distinct layer inputs "
                          f"(0..{num_layers - 1}), or null for the default [2, L // 2, L - 3]")
    if any(not 0 <= t < num_layers for t in chosen):
        given = f"{list(taps)}" if taps is not None else f"null (the default [2, L // 2, L - 3] = {list(chosen)})"
        raise ConfigError(f"train.recipe.taps: {given}: a {num_layers}-layer target has layer inputs "
                          f"0..{num_layers - 1}; set recipe.taps to layer indices in that range")
    return chosen


def default_taps(num_layers: int) -> tuple[int, ...]:
    return (2, num_layers // 2, num_layers - 3)


class Eagle3Module(TrainModule):
    """Trains ``head`` against the frozen ``target`` by training-time test (module docstring)."""

    def __init__(self, head: Eagle3Head, target: LlamaForCausalLM, optim: OptimConfig, *,
                 unroll: int = 7, decay: float = 0.8):
        super().__init__(optim)
        self.head = head
        self.target = frozen(target)
        self.unroll, self.decay = unroll, decay

    def trainable(self) -> nn.Module:
        return self.head

    def losses(self, batch: Tensor) -> dict[str, Tensor]:
        b, s = batch.shape[0], batch.shape[1] - 1
        _, probs, tapped = target_pass(self.target, batch, self.head.taps)  # probs [B, S+1, V]
        hot = self.head.d2t + torch.arange(len(self.head.d2t), device=batch.device)   # [Vd] target ids
        in_vocab = self.head.t2d[probs.argmax(-1)]                       # [B, S+1]
        p = probs[..., hot]
        p = p / p.sum(-1, keepdim=True).clamp_min(1e-12)                  # [B, S+1, Vd] renormalised
        hidden = self.head.project(torch.cat(tapped, -1)[:, :-1].reshape(b * s, -1))  # [B*S, H]
        attn = UnrolledAttention(b, s)
        row = torch.arange(s, device=batch.device)
        padded = torch.cat([batch, batch.new_zeros(b, self.unroll)], 1)  # [B, S+1+unroll]
        out: dict[str, Tensor] = {}
        total = batch.new_zeros((), dtype=torch.float32)
        for k in range(self.unroll):
            ids = padded[:, 1 + k : 1 + k + s]                            # [B, S]: x_{j+1+k}
            hidden, _ = self.head(ids.reshape(-1), (row + k).repeat(b), attn, features=hidden)
            logp = self.head.compute_logits(hidden).float().log_softmax(-1).view(b, s, -1)  # [B, S, Vd]
            logp = logp[:, : s - k]                                        # rows whose x_{j+2+k} exists
            pk = p[:, 1 + k :]                                             # [B, S-k, Vd]: x_{j+2+k}
            mask = in_vocab[:, 1 + k :].float()                            # [B, S-k]
            ce = -(pk * logp).sum(-1)                                      # [B, S-k]
            loss_k = (ce * mask).sum() / mask.sum().clamp_min(1)
            # (over every row, as traineagle3 divides by loss_mask.sum(): a target argmax outside the
            # draft vocabulary can never be drafted, so it is a miss, not a row left out)
            acc_k = ((logp.argmax(-1) == pk.argmax(-1)).float() * mask).mean()
            total = total + self.decay ** k * loss_k
            out[f"ce_{k}"], out[f"acc_{k}"] = loss_k, acc_k
        return {"loss": total, **out}


@RECIPES.register("eagle3", config=Eagle3RecipeConfig)
class Eagle3Recipe:
    """An EAGLE-3 head for ``target``, exported in SafeAILab/EAGLE's layout (with d2t / t2d)."""

    def __init__(self, cfg: Eagle3RecipeConfig):
        self.cfg = cfg

    @classmethod
    def from_config(cls, cfg: Eagle3RecipeConfig, **_) -> "Eagle3Recipe":
        return cls(cfg)

    @staticmethod
    def check(cfg: Eagle3RecipeConfig, run: TrainConfig) -> None:
        """Fail before the target, the corpus and any generation load: settings out of range."""
        if cfg.unroll >= run.data.seq_len:
            raise ConfigError(f"train.recipe.unroll: {cfg.unroll} steps need sequences longer than that; "
                              f"set recipe.unroll below data.seq_len ({run.data.seq_len})")
        if run.target is None:
            return
        hf = read_json(Path(run.target) / "config.json")
        hf = hf.get("text_config") or hf
        vocab, layers = hf.get("vocab_size"), hf.get("num_hidden_layers")
        if vocab is not None and cfg.draft_vocab_size is not None and cfg.draft_vocab_size > vocab:
            raise ConfigError(f"train.recipe.draft_vocab_size: {cfg.draft_vocab_size} is more than the "
                              f"target's vocabulary ({vocab} tokens); use 1..{vocab} (or null: all of it)")
        if isinstance(layers, int):
            recipe_taps(cfg.taps, layers)

    def setup(self, run: TrainConfig) -> TrainJob:
        data = head_data(run, "eagle3")
        vocab = data.target.config.vocab_size
        self.hot = draft_vocab(data.train.tokens, vocab, self.cfg.draft_vocab_size or vocab)
        num_layers = data.target.config.num_hidden_layers
        self.taps = recipe_taps(self.cfg.taps, num_layers)
        head = new_eagle3_head(data.target, self.hot, self.taps)
        if self.cfg.init_lm_head:
            head.lm_head.weight.data.copy_(data.target.lm_head.weight.data[self.hot])
        coverage = float(torch.isin(data.train.tokens, self.hot).float().mean())
        module = Eagle3Module(head, data.target, run.optim, unroll=self.cfg.unroll, decay=self.cfg.decay)
        return TrainJob(module, data.train, data.val, {**data.info, "params": count_params(head),
                                                       "draft_vocab_coverage": round(coverage, 4)})

    def export(self, run: TrainConfig, state: dict[str, Tensor], out: Path) -> None:
        head = new_eagle3_head(meta_target(run.target), self.hot, self.taps)
        head.load_state_dict({k.removeprefix("head."): v for k, v in state.items() if k.startswith("head.")})
        save_eagle3(head.to(resolve_dtype(self.cfg.save_dtype, {})), out, format=self.cfg.save_format)
