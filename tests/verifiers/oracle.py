"""Seeded random language models over a tiny vocabulary, as tables indexed by the token path,
and the sampler of "the first two committed tokens" that the losslessness tests count."""

from __future__ import annotations

import torch
from torch import Tensor

from specflow.sampling import SamplingBatch, SamplingParams, target_probs
from specflow.uniforms import make_generator
from specflow.tree import DraftTree, Expansion, Frontier, Roots
from tests.stateless import StatelessDrafter

START = 0  # every request starts from the context [START]


class PathOracle:
    """Logits for every sequence START, t1, ..., tL (L <= max_len): row ``code`` of a table, where
    code() = 0 and code(s + [t]) = code(s) * V + t + 1 (bijective base-V numbering)."""

    def __init__(self, vocab: int, max_len: int, seed: int, table: Tensor | None = None):
        self.vocab = vocab
        rows = sum(vocab ** n for n in range(max_len + 1))
        g = torch.Generator().manual_seed(seed)
        self.table = torch.randn(rows, vocab, generator=g) * 1.5 if table is None else table

    def code(self, context: list[int]) -> int:
        c = 0
        for t in context[1:]:
            c = c * self.vocab + t + 1
        return c

    def node_codes(self, tree: DraftTree, contexts: list[list[int]]) -> Tensor:
        """[B, N] code of each node's sequence (context + draft path)."""
        codes = torch.zeros_like(tree.tokens)
        codes[:, 0] = torch.tensor([self.code(c) for c in contexts])
        for i in range(1, tree.num_nodes):
            parent = codes.gather(1, tree.parents[:, i:i + 1].clamp(min=0))[:, 0]
            codes[:, i] = parent * self.vocab + tree.tokens[:, i] + 1
        return codes

    def tree_logits(self, tree: DraftTree, contexts: list[list[int]]) -> Tensor:
        return self.table[self.node_codes(tree, contexts)]  # [B, N, V]


class OracleDrafter(StatelessDrafter):
    """A drafter whose q(. | sequence) is softmax of a PathOracle's logits."""


    def __init__(self, oracle: PathOracle):
        self.oracle = oracle

    def expand(self, frontier: Frontier) -> Expansion:
        codes = self.oracle.node_codes(frontier.tree, frontier.roots.contexts)  # [B, n]
        logq = torch.log_softmax(self.oracle.table[codes.gather(1, frontier.nodes.clamp(min=0))], -1)  # [B, F, V]
        logprobs, tokens = logq.topk(frontier.k, dim=-1)
        return Expansion(tokens, logprobs, logq.exp() if frontier.want_probs else None)


def make_pair(vocab: int = 5, max_len: int = 5, seed: int = 0) -> tuple[PathOracle, OracleDrafter]:
    """A target and a drafter that roughly agrees with it (correlated logits)."""
    target = PathOracle(vocab, max_len, seed)
    noise = PathOracle(vocab, max_len, seed + 1).table
    return target, OracleDrafter(PathOracle(vocab, max_len, seed, table=0.7 * target.table + noise))


def speculative_step(builder, verifier, target: PathOracle, drafter: OracleDrafter,
                     contexts: list[list[int]], params: SamplingParams,
                     seeds: list[int], generators: list[torch.Generator] | None = None) -> list[list[int]]:
    """One build + verify for every request (request r seeded ``seeds[r]``, its sampled drafts
    from ``generators[r]``, by default a new generator of that seed: a later step of the same
    requests must pass the first step's on); returns the committed tokens of each."""
    b = len(contexts)
    generators = generators or [make_generator(s) for s in seeds]
    roots = Roots(list(range(b)), torch.tensor([c[-1] for c in contexts]),
                  torch.tensor([len(c) - 1 for c in contexts]), contexts, generators,
                  torch.full((b,), params.greedy))
    tree = builder.build(drafter, roots)
    verdict = verifier.verify(tree, target.tree_logits(tree, contexts),
                              SamplingBatch.from_params([params] * b, seeds, [len(c) for c in contexts]))
    tokens = tree.tokens.gather(1, verdict.accepted.clamp(min=0)).tolist()
    return [tokens[r][1:n + 1] + [bonus] for r, (n, bonus)
            in enumerate(zip(verdict.accept_len.tolist(), verdict.bonus_tokens.tolist()))]


def first_two_counts(builder, verifier, target: PathOracle, drafter: OracleDrafter,
                     params: SamplingParams, samples: int, seed: int) -> Tensor:
    """[V, V] counts of the first two committed tokens over ``samples`` requests from [START]."""
    seeds = [seed * 1_000_003 + r for r in range(samples)]
    generators = [make_generator(s) for s in seeds]
    committed = speculative_step(builder, verifier, target, drafter, [[START]] * samples, params, seeds, generators)
    short = [r for r, toks in enumerate(committed) if len(toks) < 2]  # rejected everything: one more step
    if short:
        more = speculative_step(builder, verifier, target, drafter, [[START, committed[r][0]] for r in short],
                                params, [seeds[r] for r in short], [generators[r] for r in short])
        for r, toks in zip(short, more):
            committed[r] = committed[r] + toks
    pairs = torch.tensor([toks[:2] for toks in committed])
    return torch.bincount(pairs[:, 0] * target.vocab + pairs[:, 1],
                          minlength=target.vocab ** 2).view(target.vocab, target.vocab)


def first_two_probs(target: PathOracle, params: SamplingParams) -> Tensor:
    """[V, V] p(x1) p(x2 | x1) of the processed target distribution."""
    v = target.vocab
    codes = [target.code([START])] + [target.code([START, x]) for x in range(v)]
    probs = target_probs(target.table[codes].unsqueeze(0),
                         SamplingBatch.from_params([params], [0]))[0]  # [1 + V, V]
    return probs[0].unsqueeze(1) * probs[1:]
