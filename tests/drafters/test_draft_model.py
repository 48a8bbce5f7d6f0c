"""draft_model expands trees with tree attention over its own paged KV: every node's draft
log-probability equals the draft model run contiguously over the node's whole path."""

import pytest
import torch

from drafters.draft_model import DraftModelDrafter
from specflow import SamplingParams, SpecEngine
from specflow.models import CheckpointError, load_model
from specflow.runtime.model_runner import ModelRunner
from specflow.tree import DraftTree, Frontier
from tests.drafters.expansion import check_steps, roots_for, target_features
from trees.chain import ChainBuilder
from trees.eagle2 import Eagle2Builder
from trees.static import StaticBuilder

CONTEXTS = [[5, 17, 99, 3, 42, 8, 1, 77, 23], [9, 31, 7, 120, 56]]


def reference_logprobs(model, context: list[int]) -> torch.Tensor:
    """[V] next-token log-probs of the draft model over a fresh contiguous cache."""
    runner = ModelRunner(model, num_pages=512)
    return torch.log_softmax(runner.extend([0], [context], logits="last").logits[0].float(), -1)


@pytest.mark.parametrize("builder", [ChainBuilder(depth=3), StaticBuilder(preset="mc_sim_7b_63"),
                                     Eagle2Builder(topk=3, depth=3, num_draft_tokens=10)],
                         ids=["chain", "static", "eagle2"])
@pytest.mark.parametrize("page_size", [1, 4])  # EAGLE-2 runs its beam with pages of one slot, level by level else
def test_tree_scores_match_contiguous_draft_model(tiny_target, builder, page_size):
    model = load_model(tiny_target)
    drafter = DraftModelDrafter(model, page_size=page_size)

    def path_logprob(b, ctx, path):
        return sum(float(reference_logprobs(model, ctx + path[:d])[path[d]]) for d in range(len(path)))

    check_steps(drafter, builder, CONTEXTS, path_logprob)
    assert drafter.runner.runner.cache.num_pages_used == 0


def test_vocabulary_mismatch_is_rejected(tiny_target):
    from specflow.models import CheckpointError

    with pytest.raises(CheckpointError, match="vocabulary"):
        DraftModelDrafter(load_model(tiny_target), target_vocab_size=999)


@pytest.mark.parametrize("nodes", [torch.zeros(2, 0, dtype=torch.long), torch.full((2, 2), -1)], ids=["F=0", "none"])
def test_a_frontier_without_nodes_feeds_nothing(tiny_target, nodes):
    drafter = DraftModelDrafter(load_model(tiny_target))
    rids, roots = [0, 1], roots_for(CONTEXTS)
    drafter.begin(target_features(drafter, rids, [c[:-1] for c in CONTEXTS], [0, 0], [c[-1] for c in CONTEXTS], None))
    out = drafter.expand(Frontier(roots, DraftTree.root_only(roots), nodes, 2, want_probs=False))
    assert out.tokens.shape == (2, nodes.shape[1], 2) and (out.logprobs == float("-inf")).all()
    assert drafter.runner.runner.cache.num_pages_used == 0  # nothing fed: the prompts are still pending


def test_a_pool_short_of_a_whole_tree_fails_before_any_draw(tiny_target):
    """The draft model's pages for a whole tree are reserved when it starts: a pool without them
    gives up the tree before drawing from it (a failure that depended on the draws would bias
    sampled drafts). Every step is then plain, and a seeded request samples what plain decoding
    samples with that seed."""
    prompt, params = [5, 17, 42, 9, 7], SamplingParams(temperature=1.0, max_tokens=6, seed=3, ignore_eos=True)
    tree = {"type": "static", "choices": [[0], [1], [0, 0], [0, 1]], "sample": True}
    short = SpecEngine(tiny_target, {"type": "draft_model", "path": str(tiny_target), "kv_cache_tokens": 9},
                       tree, {"type": "rejection"})
    out = short.generate([prompt], params)[0]
    assert out.accept_lengths == [1] * 5  # (9 slots: a prompt of 5 and a tree of 5 do not fit)
    assert out.token_ids == SpecEngine(tiny_target).generate([prompt], params)[0].token_ids


def test_a_pool_holding_exactly_a_whole_tree_drafts_it(tiny_target):
    """A tree's start reserves the pending tokens, the root and the rest of its budget: a pool of
    exactly that many slots (a prompt of 5, a root, 4 more nodes: 10) drafts the first tree."""
    prompt, params = [5, 17, 42, 9, 7], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    tree = {"type": "static", "choices": [[0], [1], [0, 0], [0, 1]]}
    exact = SpecEngine(tiny_target, {"type": "draft_model", "path": str(tiny_target), "kv_cache_tokens": 10},
                       tree, {"type": "greedy"})
    out = exact.generate([prompt], params)[0]
    assert out.tried_depths[0] > 0  # the first step drafted
    assert out.token_ids == SpecEngine(tiny_target).generate([prompt], params)[0].token_ids


def test_a_draft_model_with_a_larger_vocabulary_than_the_target_s_is_rejected(tiny_target):
    """Sharing the tokenizer means the same vocabulary: a draft model with more ids than the target
    (it could draft ids the target has no logits for) is refused as one with fewer is."""
    model = load_model(tiny_target)
    with pytest.raises(CheckpointError, match="vocabulary"):
        DraftModelDrafter(model, target_vocab_size=model.config.vocab_size - 1)


def test_the_draft_model_s_pool_holds_kv_cache_tokens_tokens_whatever_the_page_size(tiny_target):
    """kv_cache_tokens counts tokens: a pool of 64 tokens in pages of 4 is 16 pages."""
    drafter = DraftModelDrafter(load_model(tiny_target), kv_cache_tokens=64, page_size=4)
    cache = drafter.runner.runner.cache
    assert cache.page_size == 4 and cache.allocator.num_pages * cache.page_size == 64
