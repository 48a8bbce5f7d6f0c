"""SpecEngine: the engine's API and request lifecycle. Each step prefills admitted requests
(specflow.prefill), then runs a speculative step (specflow.spec_step: draft -> build tree ->
verify -> commit) or, when no request speculates, a plain decoding step (specflow.overlap)."""

from __future__ import annotations

import dataclasses
import itertools
import weakref
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch
from torch import Tensor

from specflow.config import ConfigError
from specflow.features import FeatureFeed
from specflow.models import LlamaForCausalLM, load_model, load_tokenizer
from specflow.overlap import OverlapDecoding
from specflow.penalties import History, Penalties, PenaltyState
from specflow.pipeline import EngineConfig, Pipeline, check_runtime, engine_config_from_yaml, resolve_device
from specflow.prefill import Prefill
from specflow.request import Request, RequestOutput
from specflow.runtime.model_runner import ModelRunner, RuntimeOptions
from specflow.sampling import SamplingBatch, SamplingParams
from specflow.scheduler import Scheduler
from specflow.spec_step import SpeculativeDecoding

# request ids are unique across engines: one drafter object (a global n-gram trie) may serve several
# engines, and drafters key their per-request state by request id
_REQUEST_IDS = itertools.count()
# the salts of requests whose drafter learns across requests (SamplingBatch.coin_walk): one sequence
# per drafter object, as two requests of one seed and one salt would share coins
_SALTS: dict[int, Iterator[int]] = {}


def _salts(drafter: Any) -> Iterator[int]:
    """``drafter``'s salt sequence, kept by identity (a dataclass drafter is unhashable) and
    dropped with the drafter (kept for the process where it takes no weak reference)."""
    key = id(drafter)
    if key not in _SALTS:
        _SALTS[key] = itertools.count(1)
        try:
            weakref.finalize(drafter, _SALTS.pop, key, None)
        except TypeError:
            pass
    return _SALTS[key]


class SpecEngine:
    """Speculative decoding over a target model with continuous batching.

    ``drafter=None`` decodes autoregressively through the same runtime (the baseline of every
    speedup), one step ahead of the host (specflow.overlap), as an engine with a drafter does
    while no running request speculates. Component nodes are
    ``{"type": name, **params}`` mappings (see ``specflow list``). ``check_drafts`` checks every
    drafted tree (structure, token ids in the vocabulary, finite non-negative q) and every verdict
    (a path of the tree, a bonus token in the vocabulary) and names the component that broke one:
    for developing components (it waits for the device every step).
    ``prefix_caching`` shares the K/V of common prefixes between requests (README: Python API).
    """

    def __init__(self, target: str | Path | LlamaForCausalLM, drafter: Any = None, tree: Any = None,
                 verifier: Any = None, *, tokenizer: Any = None,
                 device: str = "auto", dtype: str | torch.dtype = "auto", backend: str = "auto",
                 page_size: int = 1, kv_cache_tokens: int = 65536, max_batch_size: int = 32,
                 spec_max_batch_size: int | None = None, max_prefill_tokens: int | None = 16384,
                 prefix_caching: bool = False, cuda_graphs: bool | None = None, record_steps: bool = False,
                 check_drafts: bool = False):
        tree = tree if tree is not None else {"type": "chain"}
        verifier = verifier if verifier is not None else {"type": "rejection"}
        Pipeline.check(drafter, tree, verifier)  # before the target loads (minutes for an 8B)
        check_runtime(backend, page_size, kv_cache_tokens, max_batch_size, spec_max_batch_size,
                      max_prefill_tokens)
        if isinstance(target, LlamaForCausalLM):  # an already loaded target, shared between engines
            self.model, self.tokenizer = target, tokenizer
            param = next(target.parameters())
            self.device, self.dtype = param.device, param.dtype
        else:
            self.device, self.dtype = resolve_device(device, dtype)
            self.model = load_model(target, device=self.device, dtype=self.dtype)
            self.tokenizer = tokenizer or load_tokenizer(target)
        self.runner = ModelRunner(self.model, num_pages=max(1, kv_cache_tokens // page_size),
                                  page_size=page_size, backend=backend, prefix_caching=prefix_caching)
        graphable = self.runner.attn.supports_graphs
        if cuda_graphs and not graphable:
            raise ConfigError(f"cuda_graphs: the {type(self.runner.attn).__name__} cannot be replayed from "
                              f"CUDA graphs yet; use backend: torch or cuda_graphs: false")
        if cuda_graphs is None:
            cuda_graphs = graphable and self.device.type == "cuda"
        # drafters build their own runners with the target's backend and graph settings
        self.runtime = RuntimeOptions(backend, cuda_graphs, max_batch_size, max_prefill_tokens, prefix_caching)
        self.pipeline = Pipeline.from_config(
            drafter, tree, verifier, target=self.runner, vocab_size=self.model.config.vocab_size,
            device=self.device, dtype=self.dtype, runtime=self.runtime, tokenizer=self.tokenizer)
        self.drafter = self.pipeline.drafter
        self.tree_builder = self.pipeline.tree
        self.verifier = self.pipeline.verifier
        # a drafter that learns across requests salts coin walks apart per request (SamplingBatch.coin_walk)
        self._salted = bool(getattr(self.drafter, "learns_across_requests", False))
        num_draft_tokens = self.tree_builder.num_draft_tokens if self.drafter is not None else 1
        if cuda_graphs:
            self.runner.enable_graphs(max_batch_size, num_draft_tokens)
        self.scheduler = Scheduler(self.runner.cache, max_batch_size, num_draft_tokens, max_prefill_tokens)
        self.spec_max_batch_size = spec_max_batch_size
        self.record_steps = record_steps
        self.check_drafts = check_drafts
        self.eos_token_ids = list(self.model.config.eos_token_ids)
        self._requests: dict[int, Request] = {}
        self._unclaimed: list[RequestOutput] = []  # finished inside generate() but not its own
        self._drafting: set[int] = set()  # requests the drafter has begun and not yet released
        self._adjustments = PenaltyState(self.model.config.vocab_size, self.device)  # (specflow.penalties)
        self._prefill = Prefill(self)
        self._plain = OverlapDecoding(self)
        self._spec = SpeculativeDecoding(self) if self.drafter is not None else None
        self._feed = None if self.drafter is None else \
            FeatureFeed(self.drafter.needs, self.runner.cache, self.model.config.hidden_size, self.dtype)

    @classmethod
    def from_config(cls, cfg: EngineConfig) -> "SpecEngine":
        """Build from an EngineConfig (a YAML's ``engine`` section): a bad value names its key
        from there (``engine.tree: ...``)."""
        # (not dataclasses.asdict: it deep-copies the values, a component already built among them)
        node = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
        try:
            return cls(node.pop("target"), **node)
        except ConfigError as e:  # (the constructor names keys of its own arguments)
            raise ConfigError(f"engine.{e}") from None

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: list[str] | None = None,
                  pipeline: str | None = None) -> "SpecEngine":
        """Build from an engine YAML: a bare one, a serve file's ``engine:`` section, or an
        experiment's with one of its ``pipelines`` (``pipeline``: its name; "baseline": plain
        decoding), whose drafter, tree and verifier replace the engine's."""
        return cls.from_config(engine_config_from_yaml(path, overrides, pipeline))

    # ----------------------------------------------------------------------------------------
    # public API

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None) -> int:
        """Queue a request; it joins the running batch at the next step that has room."""
        params = params or SamplingParams()
        ids = self.encode(prompt)
        limit = self.model.config.max_position_embeddings
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.model.config.vocab_size
        if not all(0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab}), the target's vocabulary")
        params.check_vocab(vocab)
        if params.stop and self.tokenizer is None:  # (stop strings match decoded text)
            raise ValueError("stop strings need a tokenizer and this target has none; "
                             "use stop_token_ids instead")
        if len(ids) + params.max_tokens > limit:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                             f"the model's context length ({limit})")
        rid = next(_REQUEST_IDS)
        salt = next(_salts(self.drafter)) if self._salted else 0
        req = Request(rid, ids, params, self.eos_token_ids, self.tokenizer, salt=salt)
        if not self.scheduler.fits_alone(req):
            raise ValueError(f"the prompt ({len(ids)} tokens) does not fit in the KV cache; "
                             f"raise kv_cache_tokens")
        self.scheduler.add(req)
        self._requests[req.id] = req
        return req.id

    def abort(self, request_id: int) -> None:
        """Cancel a request and free its KV pages and drafter state at once."""
        req = self._requests.pop(request_id, None)
        if req is not None and not req.finished:
            self._finish(req)

    def has_unfinished(self) -> bool:
        """Whether ``step()`` has outputs still to return (requests running or waiting, or
        finished inside another call's ``generate`` and not yet returned)."""
        return bool(self._unclaimed) or self.scheduler.has_unfinished()

    def snapshot(self, request_ids: list[int], since: Mapping[int, tuple[int, int]] | None = None
                 ) -> list[RequestOutput]:
        """The output so far (committed tokens, text, accept lengths, logprobs) of each unfinished
        request among ``request_ids``, for streaming between steps; finished ids are skipped.
        ``since`` maps a request to the (tokens, steps) its caller has seen: its output then lists
        only what came after them (``Request.output``)."""
        since = since or {}
        return [self._requests[i].output(since.get(i, (0, 0))) for i in request_ids if i in self._requests]

    def generate(self, prompts: list[str] | list[list[int]] | str,
                 params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for every prompt with continuous batching; outputs in prompt order.

        Requests added earlier with ``add_request`` keep running alongside; their outputs are
        handed back by the next ``step()`` call, never dropped. A call that raises (a refused
        prompt, an interrupt) aborts the requests it added.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} SamplingParams")
        ids, outputs = [], {}
        try:
            for p, sp in zip(prompts, params):
                ids.append(self.add_request(p, sp))
            pending = set(ids)
            bar = None
            if use_tqdm:
                from tqdm.auto import tqdm

                bar = tqdm(total=len(ids), desc="generate", unit="req")
            while pending:
                for out in self.step():
                    if out.request_id not in pending:
                        self._unclaimed.append(out)
                        continue
                    pending.discard(out.request_id)
                    outputs[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
            if bar is not None:
                bar.close()
        except BaseException:  # (no caller would claim them: they would run on, their outputs unreturned)
            for i in ids:
                self.abort(i)
            raise
        return [outputs[i] for i in ids]

    def synchronize(self) -> None:
        """Wait for the device work queued so far: plain decoding returns from ``step()`` with
        the next forward still queued, so a timer reads its clock after this."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this target has no tokenizer: pass token ids instead of text")
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            raise ValueError("this target has no tokenizer: its outputs are token ids only")
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # ----------------------------------------------------------------------------------------
    # the step

    def step(self) -> list[RequestOutput]:
        """One engine step: prefill newly admitted requests, then one speculative step over the
        running batch, or a plain decoding step when no request speculates (no drafter, a batch
        above ``spec_max_batch_size``, or only ``speculative=False`` requests). Returns the
        outputs of requests that finished in it (plain decoding: whose last tokens landed in it,
        one step after their forward)."""
        finished, self._unclaimed = self._unclaimed + self._prefill.step(self.scheduler.admit()), []
        if self._spec is None or not self._spec.speculating(self.scheduler.running):
            return finished + self._plain.step()
        return finished + self._plain.land() + self._spec.step()

    def _sampling(self, batch: list[Request], ahead: list[bool] | None = None,
                  drafted: list[int] | None = None) -> SamplingBatch:
        """The batch's sampling, each row drawing the token after its sequence (and after its
        token in flight, where ``ahead``). Rows ``drafted`` are salted (``SamplingBatch.coin_walk``)
        when the drafter learns across requests; a row verifying its root only draws as plain
        decoding does, whatever walk its batch-mates take."""
        positions = [r.seq_len + a for r, a in zip(batch, ahead or [0] * len(batch))]
        drafted = set(drafted or ())
        salts = [r.salt if b in drafted else 0 for b, r in enumerate(batch)] if self._salted else None
        return SamplingBatch.from_params([r.params for r in batch], [r.seed for r in batch], positions, salts)

    def _penalties(self, batch: list[Request]) -> Penalties | None:
        """The batch's history-dependent logit adjustments (specflow.penalties), None without any."""
        if not any(r.params.adjusts_logits for r in batch):
            return None
        return self._adjustments.gather(
            [r.id for r in batch], [History(r.params, r.distinct_prompt_ids if r.params.repetition_penalty != 1 else (),
                                            r.output_ids, r.stop_ids) for r in batch])

    @staticmethod
    def _adjusted(logits: Tensor, penalties: Penalties | None) -> Tensor:
        """[B, V] logits of the token after each sequence, adjusted by ``penalties``."""
        return logits if penalties is None else penalties.apply(logits[:, None])[:, 0]

    def _preempt(self) -> list[RequestOutput]:
        """Out of pages mid-step: requeue the request being prefilled in chunks, else the newest
        running one; a request that could never be admitted again (or a lone one that cannot
        grow) stops with finish_reason "length"."""
        req = self.scheduler.prefilling or self.scheduler.running[-1]
        if req is not self.scheduler.prefilling and (len(self.scheduler.running) == 1
                                                     or not self.scheduler.fits_alone(req)):
            req.finish_reason = "length"
            return [self._finish(req)]
        self.scheduler.preempt()
        self._release(req)  # (its adjustments' rows are made again from its history when it resumes)
        if not req.output_ids and req.prompt_logprobs is not None:  # (recomputed with its prefill)
            req.prompt_logprobs.clear()
        return []

    def _release(self, req: Request) -> None:
        """Free what a request holds beside its scheduler entry: KV pages (with prefix caching, full
        pages of committed tokens stay cached first), drafter state and features, adjustments' rows."""
        if self.runner.cache.prefix is not None:
            self.runner.cache.insert(req.id, req.seq)
        self.runner.release([req.id])
        if self._feed is not None:
            self._feed.release(req.id)
        if req.id in self._drafting:
            self._drafting.discard(req.id)
            self.drafter.release([req.id])
        self._adjustments.release(req.id)

    def _finish(self, req: Request) -> RequestOutput:
        self.scheduler.finish(req)
        self._release(req)
        self._requests.pop(req.id, None)
        return req.output()
