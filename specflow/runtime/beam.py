"""EAGLE-2's beam expanded over per-branch K/V paths: no tree mask, no scratch bookkeeping.

After the root, an EAGLE-2 build expands a fixed frontier of k nodes per request at every level
(SGLang's multi-step draft, SafeAILab/EAGLE ``topK_genrate``). Give each request k *branches*,
one per frontier position: branch j owns one KV slot per level, and when level d expands, its
slots for levels 1..d-1 hold the K/V of the ancestors of the level's j-th node, copied from its
parent's branch (every layer in one gather). A node then sees the committed prefix (the root
included) and its own branch: plain decode attention over a KV list fixed per row, so every
level's layout is known before the first and nothing waits on the device between levels but
the top-k the tree builder ranks. With CUDA graphs on, a level replays the drafter runner's
one-token graph of its padded row count (``GraphRunner.forward_rows``; eager past the largest).

Only the drafter's cache changes hands: the builder still scores and reranks, and ``commit``
keeps the root's K/V alone, as for every EAGLE build (the branch slots go back to the pool).
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from specflow.runtime.attention import ForwardBatch
from specflow.runtime.model_runner import ModelRunner


def top_children(logprobs: Tensor, k: int, to_target: Callable[[Tensor], Tensor], vocab_size: int) -> Tensor:
    """[R, 2k] float32: the top-k log-probs of each row of ``logprobs`` [R, V_draft]
    (descending, -inf past the draft vocabulary), then their ids mapped by ``to_target`` into
    the target's ``vocab_size`` (0 past it), in one tensor so that one copy brings both to the
    host."""
    assert vocab_size < 2**24, "token ids past 2^24 do not round-trip through float32"
    kk = min(k, logprobs.shape[-1])
    top_lp, ids = logprobs.topk(kk, dim=-1)                                     # [R, kk]
    ids = to_target(ids)
    if kk < k:  # fewer draft tokens than children asked
        top_lp, ids = F.pad(top_lp, (0, k - kk), value=float("-inf")), F.pad(ids, (0, k - kk))
    return torch.cat([top_lp, ids.float()], -1)


class Beam:
    """Levels 1..``levels`` of an EAGLE-2 beam of width ``k`` over a drafter ``runner`` (an
    EAGLE-style model: ``forward(..., features=)``) whose cache ends with each request's root.

    ``root_hidden`` [B, H] is the model's output at each root and ``children`` [B, 1, k] the
    root's children (target ids). Reserves ``levels * k`` slots per request past its cache, all
    or nothing (OutOfPages).
    """

    def __init__(self, runner: ModelRunner, request_ids: list[int], root_hidden: Tensor, children: Tensor,
                 k: int, levels: int, compute_logits: Callable[[Tensor], Tensor],
                 to_target: Callable[[Tensor], Tensor]):
        cache = runner.cache
        assert cache.page_size == 1, "a branch slot is a page of its own"
        self.runner, self.k, self.levels = runner, k, levels
        self.compute_logits, self.to_target = compute_logits, to_target
        self.vocab_size = runner.model.config.vocab_size  # the target's: drafts are target ids
        self.request_ids = request_ids
        self.kv0 = np.array([runner.kv_len(r) for r in request_ids], dtype=np.int64)   # [B] prefix, root last
        ends = (self.kv0 + levels * k).tolist()
        cache.reserve(request_ids, ends)
        table = cache.batch_slots(request_ids, ends).numpy()                               # [B, W] slots
        b, width = len(request_ids), int(self.kv0.max())
        col = self.kv0[:, None] + np.arange(levels * k)                                     # [B, L * k]
        self.branch_np = np.take_along_axis(table, col, 1).reshape(b, levels, k)           # [B, L, k] slot of (level, branch)
        self.prefix = np.where(np.arange(width) < self.kv0[:, None], table[:, :width], 0)  # [B, P] slots, 0 past kv0
        self.branch = torch.from_numpy(self.branch_np).to(runner.device)                   # [B, L, k]
        self.tokens = children.to(runner.device)                                           # [B, F, k] last level's children
        self.hidden = root_hidden                                                          # [B * F, H] their parents' outputs
        self.level = 0

    @torch.inference_mode()
    def expand(self, choice: Tensor) -> tuple[Tensor, Tensor]:
        """Feed the next level: ``choice`` [B, k] picks among the last level's children
        (flattened [F * k], -1: none) and branch j takes the j-th. Returns the children of the
        fed nodes: tokens and log-probs [B, k, k] (descending; -inf under a -1), on ``choice``'s
        device."""
        assert self.level < self.levels, f"the beam was reserved for {self.levels} levels"
        b, k, cache, device = len(self.request_ids), self.k, self.runner.cache, self.runner.device
        d = self.level + 1
        pick = choice.to(device).clamp(min=0)                                  # [B, k]
        parent = pick // k                                                     # [B, k] branch of each node's parent
        tokens = self.tokens.reshape(b, -1).gather(1, pick)                    # [B, k]
        hidden = self.hidden.view(b, -1, self.hidden.shape[-1])                # [B, F, H]
        features = hidden.gather(1, parent[..., None].expand(b, k, hidden.shape[-1]))  # [B, k, H]
        if d > 1:  # branch j takes over its parent's ancestors (gathered before any write)
            src = self.branch[:, : d - 1].gather(2, parent[:, None].expand(b, d - 1, k)).reshape(-1)
            dst = self.branch[:, : d - 1].reshape(-1)                          # [B * (d-1) * k]
            for pool in (cache.k, cache.v):
                pool[:, dst] = pool[:, src]
        batch, inputs = self._batch(d), {"features": features.view(b * k, -1)}
        graphs = self.runner.graphs
        out = graphs.forward_rows(batch, tokens.view(-1), inputs) if graphs is not None else None  # [B * k, H]
        if out is None:  # no graphs, or more rows than the largest graph
            self.runner.attn.plan(batch)
            out, _ = self.runner.model(tokens.view(-1), batch.positions.to(device), self.runner.attn, (), **inputs)
        logprobs = torch.log_softmax(self.compute_logits(out).float(), -1)      # [B * k, V_draft]
        top = top_children(logprobs, k, self.to_target, self.vocab_size)                       # [B * k, 2k]
        self.tokens, self.hidden, self.level = top[:, k:].long().view(b, k, k), out, d
        top = top.view(b, k, 2 * k).to(choice.device)                          # the level's one copy back
        return top[..., k:].long(), top[..., :k].masked_fill((choice < 0)[..., None], float("-inf"))

    def _batch(self, d: int) -> ForwardBatch:
        """Level d's layout: row (b, j) sees request b's prefix, then branch j's slots of levels
        1..d (its ancestors, then itself), and writes its K/V to the last."""
        b, k = len(self.request_ids), self.k
        width = self.prefix.shape[1] + d
        kv = np.zeros((b, k, width), dtype=np.int64)                            # [B, k, P + d]
        kv[:, :, : self.prefix.shape[1]] = self.prefix[:, None]
        cols = np.broadcast_to((self.kv0[:, None] + np.arange(d))[:, None], (b, k, d))   # [B, k, d]
        np.put_along_axis(kv, cols, self.branch_np[:, :d].transpose(0, 2, 1), 2)
        prefix_lens = np.repeat(self.kv0 + d - 1, k)                            # [B * k]: the path before the node
        return ForwardBatch(
            request_ids=[r for r in self.request_ids for _ in range(k)],
            positions=torch.from_numpy(np.repeat(self.kv0 - 1 + d, k)),         # the root's position + d
            prefix_lens=prefix_lens.tolist(), qo_lens=[1] * (b * k), tree_masks=[None] * (b * k),
            slot_mapping=torch.from_numpy(self.branch_np[:, d - 1].reshape(-1)),
            kv_index=torch.from_numpy(kv.reshape(b * k, width)))
