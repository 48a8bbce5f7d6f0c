"""Speculative decoding steps: every running request's draft tree, one batched target forward
over the trees, the verifier's walk, then the commit of accepted tokens (K/V, stop checks,
logprobs, step records, the drafter's state). The engine's path when it has a drafter and some
running request speculates (else specflow.overlap's plain steps)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from specflow.logprobs import add_token_logprobs
from specflow.request import Request, RequestOutput
from specflow.runtime.kv_cache import OutOfPages
from specflow.runtime.model_runner import ExtendOutput
from specflow.runtime.transfer import to_host
from specflow.sampling import next_tokens
from specflow.tree import DraftTree, Roots, StepRecord, Verdict

if TYPE_CHECKING:
    from specflow.engine import SpecEngine


class SpeculativeDecoding:
    """The engine's speculative steps; the engine's scheduler, runner, pipeline, sampling,
    penalties and request lifecycle (finish, preempt) are its engine's."""

    def __init__(self, engine: SpecEngine):
        self.engine = engine

    def step(self) -> list[RequestOutput]:
        """One speculative step over the running batch: draft, verify, commit. A step whose target
        forward finds no pages preempts a request and tries again."""
        engine, finished = self.engine, []
        while engine.scheduler.running:
            batch = list(engine.scheduler.running)
            roots = self._roots(batch)
            t0 = time.perf_counter()
            try:
                tree, drafted = self._draft(batch, roots)
            except OutOfPages:  # the drafter's own pool is full: verify the roots only this step
                tree, drafted = DraftTree.root_only(roots), []
            if engine.record_steps and engine.device.type == "cuda":  # the timings split the device's work
                torch.cuda.synchronize(engine.device)
            t1 = time.perf_counter()
            try:
                out = self._target_forward(batch, tree)
            except OutOfPages:  # (a root-only step: _draft drafts only trees the pool holds in full)
                finished += engine._preempt()
                continue
            if tree.num_nodes > 1:  # the verifier reads it beside the target's logits (a beam's is there)
                tree = tree.to(engine.device)
            verdict = self._verify(tree, out, batch, drafted)
            if tree.num_nodes > 1:  # (a root-only step's verdict is the engine's own)
                engine.pipeline.check_verdict(tree, verdict, engine.model.config.vocab_size, full=engine.check_drafts)
            # the verdict, the tree's tokens and each row's tried depth come to the host in one
            # copy: with a beam's tree and the greedy verifier, the step's one wait for the device
            *verdict, tokens, tried = to_host([verdict.accepted, verdict.accept_len, verdict.bonus_tokens,
                                               tree.tokens, tried_depth(tree, verdict)])
            t2 = time.perf_counter()
            timings = {"draft": t1 - t0, "verify": t2 - t1}
            finished += self._commit(batch, tree, Verdict(*verdict), tokens.tolist(), out, timings, tried.tolist())
            break
        return finished

    def _roots(self, batch: list[Request]) -> Roots:
        seqs = [r.seq for r in batch]
        return Roots(
            request_ids=[r.id for r in batch],
            tokens=torch.tensor([s[-1] for s in seqs]),
            positions=torch.tensor([len(s) - 1 for s in seqs]),
            contexts=seqs,
            generators=[r.generator for r in batch],
            greedy=torch.tensor([r.params.greedy for r in batch]),
            check_drafts=self.engine.check_drafts,
        )

    def speculating(self, batch: list[Request]) -> list[int]:
        """The rows of ``batch`` that speculate this step by the engine's policy: none above
        ``spec_max_batch_size``, else those whose requests ask to."""
        limit = self.engine.spec_max_batch_size
        if limit is not None and len(batch) > limit:
            return []
        return [i for i, r in enumerate(batch) if r.params.speculative]

    def _draft(self, batch: list[Request], roots: Roots) -> tuple[DraftTree, list[int]]:
        """The tree of every request, and the rows that drafted; requests that do not speculate get
        the root only, and so do those whose full trees the target's pool cannot hold: the first
        speculating rows that fit draft (eagerly; with CUDA graphs, whose one shape pads every row
        to N, all rows or none), rather than preempting or cutting a request short. That is
        decided before any draw (the pool's room for trees of ``num_draft_tokens`` nodes), as
        giving up a drawn tree for its size would bias sampled drafts whose size depends on their
        draws."""
        engine = self.engine
        rows = self._rows_that_fit(batch, self.speculating(batch))
        if not rows:
            return DraftTree.root_only(roots), []
        drafting = roots if len(rows) == len(batch) else roots.select(rows)
        tree = engine.tree_builder.build(engine.drafter, drafting)
        engine.pipeline.check_tree(tree, drafting, engine.model.config.vocab_size, full=engine.check_drafts)
        if len(rows) == len(batch):
            return tree, rows
        return DraftTree.root_only(roots).pad_to(engine.tree_builder.num_draft_tokens).place(rows, tree), rows

    def _target_forward(self, batch: list[Request], tree: DraftTree) -> ExtendOutput:
        """One batched target pass over every tree: every node when CUDA graphs want one fixed
        shape, read where the tree lies (padding nodes' outputs are never read); eagerly, each
        request up to its last valid node."""
        engine = self.engine
        ids, n, taps = [r.id for r in batch], tree.num_nodes, engine.drafter.needs.layer_taps
        if engine.runner.graphs is not None or n == 1:  # no value of the tree comes back to the host
            masks = list(tree.mask) if n > 1 else None  # (1 node: causal)
            return engine.runner.extend(ids, tree.tokens, positions=tree.positions, tree_masks=masks, taps=taps)
        n_send = tree.valid.long() * torch.arange(1, n + 1, device=tree.valid.device)  # [B, N]
        tokens, positions, n_send = to_host([tree.tokens, tree.positions, n_send.amax(1)])
        n_send = n_send.tolist()
        return engine.runner.extend(
            ids, [t[:n] for t, n in zip(tokens.tolist(), n_send)],
            positions=[p[:n] for p, n in zip(positions.tolist(), n_send)],
            tree_masks=[tree.mask[b, :n, :n] if n > 1 else None for b, n in enumerate(n_send)],  # 1 node: causal
            taps=taps)

    def _rows_that_fit(self, batch: list[Request], rows: list[int]) -> list[int]:
        """The first of ``rows`` whose full trees the target's pool holds beside the root of every
        other row; with CUDA graphs, whose one shape pads the others to N, all of them or none.
        One pass over the batch: dropping one row at a time and checking the pool again cost
        O(B^2) a step under KV pressure (13 ms of host time a step at 256 requests)."""
        engine = self.engine
        if not rows:
            return rows
        cache, n = engine.runner.cache, engine.tree_builder.num_draft_tokens
        ids = [r.id for r in batch]
        kv = [engine.runner.kv_len(i) for i in ids]
        if engine.runner.graphs is not None:
            return rows if cache.fits(ids, [k + n for k in kv]) else []
        roots = cache.extra_pages(ids, [k + 1 for k in kv])                           # [B] root-only rows
        trees = cache.extra_pages([ids[i] for i in rows], [kv[i] + n for i in rows])  # [len(rows)] full trees
        room, fit = cache.num_available - sum(roots), 0
        for i, pages in zip(rows, trees):  # (a tree needs at least its root's pages)
            room -= pages - roots[i]
            if room < 0:
                break
            fit += 1
        return rows[:fit]

    def _tree_logits(self, tree: DraftTree, out: ExtendOutput) -> torch.Tensor:
        if out.offsets[-1] == tree.batch_size * tree.num_nodes:  # every node sent (CUDA graphs, full trees)
            return out.logits.view(tree.batch_size, tree.num_nodes, -1)                  # [B, N, V]
        logits = out.logits.new_zeros(tree.batch_size, tree.num_nodes, out.logits.shape[-1])
        for b in range(tree.batch_size):
            rows = out.rows(b)
            logits[b, : rows.stop - rows.start] = out.logits[rows]          # [n_b, V]
        return logits                                                        # [B, N, V]

    def _verify(self, tree: DraftTree, out: ExtendOutput, batch: list[Request], drafted: list[int]) -> Verdict:
        """The verifier's walk; a root-only tree (plain decoding) just samples the next token, as
        prefill does, with no tree to walk."""
        engine = self.engine
        sampling, penalties = engine._sampling(batch, drafted=drafted), engine._penalties(batch)
        if tree.num_nodes > 1:
            logits = self._tree_logits(tree, out)                                  # [B, N, V]
            if penalties is not None:  # every node by its own path
                logits = penalties.apply(logits, tree)
            return engine.verifier.verify(tree, logits, sampling)
        bonus = next_tokens(engine._adjusted(out.logits, penalties), sampling)
        zeros = torch.zeros(len(batch), 1, dtype=torch.long)
        return Verdict(zeros, zeros[:, 0], bonus)

    def _commit(self, batch: list[Request], tree: DraftTree, verdict: Verdict, tokens: list[list[int]],
                out: ExtendOutput, timings: dict[str, float], tried: list[int]) -> list[RequestOutput]:
        """Keep accepted K/V, append accepted tokens + bonus with stop checks, sync the drafter;
        ``verdict`` is on the host, ``tokens`` are the tree's and ``tried`` each row's
        ``tried_depth``."""
        engine = self.engine
        live, logprobs = [], []
        paths, lengths, bonus = verdict.accepted.tolist(), verdict.accept_len.tolist(), verdict.bonus_tokens.tolist()
        records = tree.to_json() if engine.record_steps else None
        accepted_paths = [path[: n + 1] for path, n in zip(paths, lengths)]
        bases = [r.seq_len - 1 for r in batch]
        engine.runner.commit([r.id for r in batch], bases, accepted_paths)
        rows = [[out.offsets[b] + i for i in acc] for b, acc in enumerate(accepted_paths)]  # flat rows of out
        engine._feed.committed(batch, bases, rows, out)
        for b, (req, accepted) in enumerate(zip(batch, accepted_paths)):
            new = [tokens[b][i] for i in accepted[1:]] + [bonus[b]]
            kept = req.append(new)
            req.accept_lengths.append(kept)
            req.tried_depths.append(tried[b])
            if req.logprobs is not None:  # token i was committed at node accepted[i]
                logprobs.append((req, rows[b][:kept], new[:kept]))
            if engine.record_steps:
                req.steps.append(StepRecord(req.id, len(req.steps), records[b], accepted,
                                            new[-1], kept, timings, len(batch)))
            if not req.finished:
                live.append(b)
        add_token_logprobs(out.logits, logprobs)
        finished = [engine._finish(req) for req in batch if req.finished]
        if live:
            sub = verdict if len(live) == len(batch) else \
                Verdict(verdict.accepted[live], verdict.accept_len[live], verdict.bonus_tokens[live])
            engine.drafter.commit(sub, engine._feed.layout([batch[b] for b in live], [rows[b] for b in live], out,
                                                           [len(rows[b]) + 1 for b in live]))
        return finished


def tried_depth(tree: DraftTree, verdict: Verdict) -> Tensor:
    """[B] the depth of the deepest draft the verifier tried on its accepted path: the accepted
    drafts, plus one where the last accepted node has a valid child (whose test failed). A path
    that ends at a leaf tried nothing deeper, however deep the tree's other branches go."""
    # (clamped: check_drafts has named a broken verdict; without it the commit refuses one)
    # (long: gather takes int32/int64 indices only, and check_verdict lets any integer dtype through)
    last = verdict.accepted.gather(1, verdict.accept_len.long().clamp(0, verdict.accepted.shape[1] - 1)[:, None])
    parents, valid = tree.parents.to(last.device), tree.valid.to(last.device)
    return verdict.accept_len + ((parents == last) & valid).any(1)                      # [B]
