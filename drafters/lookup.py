"""For drafters that look children up (n-gram tables, suffix tries, retrieval stores) instead of
running a model: each frontier node's draft path, and the Expansion of ranked (token, weight)
answers."""

from __future__ import annotations

import math

import torch

from specflow.tree import Expansion, Frontier

Ranked = list[tuple[int, float]]  # (token, weight > 0), best first


def draft_paths(frontier: Frontier) -> list[list[list[int] | None]]:
    """[B][F] the draft tokens from below the root down to each frontier node ([] for the root
    itself, which is its context's last token), None where the slot is padding (node -1): a
    node's context is ``frontier.roots.contexts[b] + path``."""
    parents, tokens = frontier.tree.parents.tolist(), frontier.tree.tokens.tolist()
    paths = []
    for b, nodes in enumerate(frontier.nodes.tolist()):
        row = []
        for node in nodes:
            path = None
            if node >= 0:
                path = []
                while parents[b][node] >= 0:
                    path.append(tokens[b][node])
                    node = parents[b][node]
                path.reverse()
            row.append(path)
        paths.append(row)
    return paths


def ranked_expansion(answers: list[list[Ranked]], frontier: Frontier, vocab_size: int | None) -> Expansion:
    """[B][F] ranked answers -> the Expansion of their first ``frontier.k``: log q = log(weight /
    the answer's total weight), and with ``frontier.want_probs`` q over the vocabulary (rows of
    empty answers all zero; ``vocab_size`` needed then)."""
    (b, f), k = frontier.nodes.shape, frontier.k
    tokens = [[[0] * k for _ in row] for row in answers]
    logprobs = [[[-math.inf] * k for _ in row] for row in answers]
    q_index, q_value = [], []  # (b, f, token) entries of q and their probabilities
    for i, row in enumerate(answers):
        for j, ranked in enumerate(row):
            total = sum(weight for _, weight in ranked)
            for rank, (token, weight) in enumerate(ranked[:k]):
                tokens[i][j][rank], logprobs[i][j][rank] = token, math.log(weight / total)
            if frontier.want_probs:  # (q over every follower: only when asked, they can be many)
                q_index += [(i, j, token) for token, _ in ranked]
                q_value += [weight / total for _, weight in ranked]
    device = frontier.nodes.device
    probs = None
    if frontier.want_probs:
        if vocab_size is None:
            raise ValueError("want_probs needs the vocabulary size: build the drafter with vocab_size=V")
        probs = torch.zeros((b, f, vocab_size), device=device)
        if q_index:
            at = torch.tensor(q_index, device=device).T  # [3, entries]
            probs[at[0], at[1], at[2]] = torch.tensor(q_value, device=device)
    return Expansion(tokens=torch.tensor(tokens, dtype=torch.long, device=device).view(b, f, k),
                     logprobs=torch.tensor(logprobs, device=device).view(b, f, k), probs=probs)
