"""Plain decoding one step ahead of the host, as SGLang's overlap scheduler runs it: the
engine's path when it has no drafter (the baseline of every speedup), and when no running
request speculates (above ``spec_max_batch_size``, or every request ``speculative=False``): a
drafter is then fed each landed token, as a speculative step that verifies its root feeds it."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from specflow.logprobs import logprob_rows, to_token_logprobs
from specflow.request import Request, RequestOutput, Status
from specflow.runtime.kv_cache import OutOfPages
from specflow.runtime.model_runner import ExtendOutput
from specflow.runtime.transfer import HostCopy, to_device
from specflow.sampling import next_tokens
from specflow.tree import StepRecord, Verdict

if TYPE_CHECKING:
    from specflow.engine import SpecEngine


@dataclass
class InFlight:
    """A plain decoding step whose tokens the host has not read yet."""

    batch: list[Request]
    rows: dict[int, int]     # request id -> its row
    tokens: Tensor           # [B] int64 on the device: the roots of the next step
    landing: HostCopy        # the same tokens on their way to the host, with logprob_rows' if asked for
    launched: float          # perf_counter at the launch (StepRecord timings)
    out: ExtendOutput        # the forward's outputs: the roots' target features for a drafter


class OverlapDecoding:
    """The engine's plain decoding steps, each launched before the previous one's tokens reach
    the host. It holds the step in flight; the engine's scheduler, runner, sampling, penalties
    and request lifecycle (finish, preempt) are its engine's."""

    def __init__(self, engine: SpecEngine):
        self.engine = engine
        self.in_flight: InFlight | None = None  # the step launched, not yet landed

    def step(self) -> list[RequestOutput]:
        """One plain decoding step, overlapped as SGLang's scheduler does: launch step t + 1 from
        step t's tokens while they are still on the device, then land step t's (append, stop
        checks, outputs) while the GPU runs t + 1, so the host's work hides behind the kernels.
        A request that step t finishes by a stop token or string has a row in t + 1 that is
        dropped unread; one that reaches max_tokens is not launched again."""
        finished = []
        while True:
            batch = [r for r in self.engine.scheduler.running if len(r.output_ids) + self._ahead(r) < r.params.max_tokens]
            try:
                launched = self._launch(batch) if batch else None
                break
            except OutOfPages:  # land what is in flight first: it may finish requests and free pages
                finished += self.land() if self.in_flight is not None else self.engine._preempt()
        flight, self.in_flight = self.in_flight, launched
        return finished + self._land(flight)

    def land(self) -> list[RequestOutput]:
        """Land the step in flight, if any, and launch none (before a speculative step)."""
        flight, self.in_flight = self.in_flight, None
        return self._land(flight)

    def _ahead(self, req: Request) -> int:
        """Tokens of ``req`` in flight (0 or 1)."""
        return int(self.in_flight is not None and req.id in self.in_flight.rows)

    def _launch(self, batch: list[Request]) -> InFlight:
        """Queue one target forward and sampling over ``batch``'s roots (the in-flight step's
        tokens where it has one, else the sequence's last); nothing is read back."""
        t0, ahead = time.perf_counter(), self.in_flight
        rows = [ahead.rows.get(r.id, -1) if ahead else -1 for r in batch]
        if ahead is not None and rows == list(range(len(ahead.batch))):  # the same batch as the last step
            roots = ahead.tokens
        else:  # in-flight tokens first, then the others' last tokens
            carried = ahead.tokens if ahead is not None else torch.empty(0, dtype=torch.long, device=self.engine.device)
            fresh, where = [], []
            for r, i in zip(batch, rows):
                where.append(i if i >= 0 else len(carried) + len(fresh))
                if i < 0:
                    fresh.append(r.seq[-1])
            where, fresh = to_device([torch.tensor(where), torch.tensor(fresh, dtype=torch.long)], self.engine.device)
            roots = torch.cat([carried, fresh])[where]                                 # [B]
        taps = self.engine.drafter.needs.layer_taps if self.engine.drafter is not None else ()
        out = self.engine.runner.extend([r.id for r in batch], roots.view(-1, 1), taps=taps)  # positions: each cache's
        if self.engine._feed is not None:  # the roots' features beside their K/V, as it is written: a request
            # ended before this step lands (a stop, an abort) leaves its root's K/V to the prefix cache
            self.engine._feed.committed(batch, [self.engine.runner.kv_len(r.id) - 1 for r in batch],
                                        [[out.offsets[b]] for b in range(len(batch))], out)
        in_flight, penalties = [i >= 0 for i in rows], self.engine._penalties(batch)
        if penalties is not None and ahead is not None:  # the roots in flight are generated tokens too
            penalties = penalties.after(roots, to_device([torch.tensor(in_flight)], self.engine.device)[0])
        tokens = next_tokens(self.engine._adjusted(out.logits, penalties), self.engine._sampling(batch, in_flight))  # [B]
        top_n = max((r.params.logprobs for r in batch if r.logprobs is not None), default=-1)
        logprobs = logprob_rows(out.logits, tokens, top_n) if top_n >= 0 else []
        return InFlight(batch, {r.id: b for b, r in enumerate(batch)}, tokens, HostCopy([tokens, *logprobs]), t0, out)

    def _land(self, flight: InFlight | None) -> list[RequestOutput]:
        """Commit ``flight``'s tokens on the host (appends, stop checks, logprobs, step records,
        the drafter's commit); requests finished or aborted since its launch are skipped."""
        if flight is None:
            return []
        tokens, *logprobs = flight.landing.wait()
        timings = {"draft": 0.0, "verify": time.perf_counter() - flight.launched}  # launch to landing
        landed = []  # (row, request)
        for b, (req, token) in enumerate(zip(flight.batch, tokens.tolist())):
            if req.status is not Status.RUNNING:
                continue
            root = req.seq[-1]
            landed.append((b, req))
            kept = req.append([token])
            req.accept_lengths.append(kept)
            req.tried_depths.append(0)  # (no draft)
            if req.logprobs is not None:
                req.logprobs += to_token_logprobs([token], [x[b:b + 1] for x in logprobs], req.params.logprobs)
            if self.engine.record_steps:  # the one-node tree of DraftTree.root_only
                tree = {"tokens": [root], "parents": [-1], "depth": [0], "scores": [1.0], "valid": [True]}
                req.steps.append(StepRecord(req.id, len(req.steps), tree, [0], token, kept, timings,
                                            len(flight.batch)))
        if self.engine.drafter is not None and landed:
            self._commit_drafter(flight.out, landed)
        return [self.engine._finish(req) for _, req in landed if req.finished]

    def _commit_drafter(self, out: ExtendOutput, landed: list[tuple[int, Request]]) -> None:
        """Feed the drafter each landed request's root with its target features, and the landed
        token as its next root: the commit of a speculative step that verified its root only."""
        engine = self.engine
        live = [(b, req) for b, req in landed if not req.finished]
        if live:
            zeros = torch.zeros(len(live), 1, dtype=torch.long)
            verdict = Verdict(zeros, zeros[:, 0], torch.tensor([req.seq[-1] for _, req in live]))
            features = engine._feed.layout([req for _, req in live], [[out.offsets[b]] for b, _ in live], out,
                                           [2] * len(live))
            engine.drafter.commit(verdict, features)
