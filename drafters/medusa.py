"""Medusa drafter: extra heads on the target's last hidden state predict the tokens after the
next one (Cai et al., 2024). The heads run once per tree, at the root; a node at depth d takes
its children from head d (the top-k of the distribution of the token at depth d + 1), whatever
its path. Medusa needs no KV cache of its own. With CUDA graphs on, the heads replay from a graph
per padded batch size (``RowGraphs``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from specflow.models.medusa import MedusaHeads, load_medusa
from specflow.protocols import TargetFeatures, TargetNeeds
from specflow.registry import DRAFTERS
from specflow.runtime.cuda_graph import RowGraphs
from specflow.runtime.model_runner import ModelRunner, RuntimeOptions
from specflow.tree import Expansion, Frontier, Verdict


@dataclass
class MedusaConfig:
    path: str = "???"  # Medusa heads directory (FasterDecoding/Medusa layout)


@DRAFTERS.register("medusa", config=MedusaConfig)
class MedusaDrafter:
    """Answers every depth from the heads' log-probabilities at the token before the root."""

    needs = TargetNeeds(last_hidden=True)

    def __init__(self, heads: MedusaHeads, runtime: RuntimeOptions | None = None):
        self.heads = heads
        self.hidden: dict[int, Tensor] = {}    # request id -> [H] at its last committed token, heads not run yet
        self.logprobs: dict[int, Tensor] = {}  # request id -> [num_heads, V] for the current root
        runtime = runtime or RuntimeOptions()
        device = next(heads.parameters()).device
        self.run_heads = RowGraphs(self._logprobs, runtime.max_batch_size, capture=device.type == "cuda") \
            if runtime.cuda_graphs else self._logprobs

    @classmethod
    def from_config(cls, cfg: MedusaConfig, *, target: ModelRunner, device: Any = "cpu",
                    dtype: Any = torch.float32, runtime: RuntimeOptions | None = None,
                    **_: Any) -> "MedusaDrafter":
        return cls(load_medusa(cfg.path, target.model, device=device, dtype=dtype), runtime)

    def _logprobs(self, last: Tensor) -> Tensor:
        """[R, H] last hidden states -> [R, num_heads, V] log-probabilities."""
        return torch.log_softmax(self.heads(last).float(), -1).transpose(0, 1)

    def _keep_last(self, features: TargetFeatures) -> None:
        """Keep the hidden state of each request's last committed token: the heads run on it when
        the next tree is drafted, not after a step that drafts none (plain decoding's)."""
        assert features.hidden is not None, "the engine must pass the last hidden states (needs.last_hidden)"
        for rid, hidden in zip(features.request_ids, features.hidden):
            self.hidden[rid] = hidden[-1]
            self.logprobs.pop(rid, None)

    begin = _keep_last

    @torch.inference_mode()
    def _table(self, request_ids: list[int]) -> Tensor:
        """[B, num_heads, V] the heads' log-probabilities at each request's root: one batched run
        over the requests committed to since their last."""
        fresh = [rid for rid in request_ids if rid in self.hidden]
        if fresh:
            logprobs = self.run_heads(torch.stack([self.hidden.pop(rid) for rid in fresh]))   # [R, num_heads, V]
            self.logprobs.update(zip(fresh, logprobs))
        return torch.stack([self.logprobs[rid] for rid in request_ids])

    def expand(self, frontier: Frontier) -> Expansion:
        b, f = frontier.nodes.shape
        k = frontier.k
        vocab = self.heads.vocab_size
        tokens = torch.zeros(b, f, k, dtype=torch.long)
        lps = torch.full((b, f, k), float("-inf"))
        probs = torch.zeros(b, f, vocab) if frontier.want_probs else None
        depth = frontier.tree.depth.gather(1, frontier.nodes.clamp(min=0))     # [B, F]
        where = ((frontier.nodes >= 0) & (depth < self.heads.num_heads)).nonzero().tolist()
        if not where:
            return Expansion(tokens, lps, probs)
        table = self._table(frontier.roots.request_ids)                        # [B, num_heads, V]
        bi, fi = torch.tensor(where).T
        rows = table[bi.to(table.device), depth[bi, fi].to(table.device)]      # [R, V]: head = node depth
        kk = min(k, vocab)
        top_lp, top_tok = rows.topk(kk, dim=-1)                                 # [R, kk]
        tokens[bi, fi, :kk] = top_tok.cpu()
        lps[bi, fi, :kk] = top_lp.cpu()
        if probs is not None:
            probs[bi, fi] = rows.exp().cpu()
        return Expansion(tokens, lps, probs)

    def commit(self, verdict: Verdict, features: TargetFeatures) -> None:
        self._keep_last(features)

    def release(self, request_ids: list[int]) -> None:
        for rid in request_ids:
            self.hidden.pop(rid, None)
            self.logprobs.pop(rid, None)
