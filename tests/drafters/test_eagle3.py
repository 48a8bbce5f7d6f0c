"""EAGLE-3 drafter: reads the target's layer taps, drafts in its own vocabulary mapped through
d2t, expands trees exactly like the head run contiguously, and generates losslessly."""

import json
import pytest
import torch

from drafters.eagle3 import Eagle3Drafter
from specflow import SamplingParams, SpecEngine
from specflow.models import load_model
from specflow.models.eagle3 import load_eagle3, save_eagle3
from specflow.models.random import make_random_checkpoint
from tests.drafters.expansion import (CONTEXTS, PROMPTS, TREES, check_steps, contiguous_path_logprob,
                                      feature_table, roots_for, target_features)
from tests.drafters.fitted import fit, target_states, trajectories
from tests.models.random_heads import eagle3_state, head_hf, write_checkpoint
from trees.chain import ChainBuilder
from trees.eagle2 import Eagle2Builder
from trees.static import StaticBuilder

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
TAP_IDS = [0, 1, 2]  # SGLang's eagle_config ids (layer outputs): the hidden states entering layers 1, 2, 3


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A 4-layer target (EAGLE-3 taps three layers)."""
    path = make_random_checkpoint(tmp_path_factory.mktemp("target4"), hidden_size=64, num_layers=4, num_heads=4,
                                  num_kv_heads=2, vocab_size=320, initializer_range=0.3, seed=3, tokenizer=False)
    return load_model(path)


@pytest.fixture(scope="module")
def seqs(target):
    return trajectories(target, PROMPTS[:2], 16)


@pytest.fixture(scope="module")
def hot(seqs):
    """The draft vocabulary: every token of the greedy trajectories and every fifth id."""
    return torch.tensor(sorted(set(sum(seqs, [])) | set(range(0, 320, 5))))


def hf_for(target, hot):
    return head_hf(target.config, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=len(hot),
                   eagle_config={"eagle_aux_hidden_state_layer_ids": TAP_IDS, "use_aux_hidden_state": True})


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory, target, hot):
    hf = hf_for(target, hot)
    return write_checkpoint(tmp_path_factory.mktemp("eagle3"), hf, eagle3_state(hf, hot=hot, seed=4), "bin")


def engine(target, tree, path, verifier="greedy"):
    return SpecEngine(target, drafter={"type": "eagle3", "path": str(path), "kv_cache_tokens": 1024}, tree=tree,
                      verifier={"type": verifier}, kv_cache_tokens=1024, record_steps=True)


@pytest.mark.parametrize("builder", [ChainBuilder(depth=3), StaticBuilder(preset="mc_sim_7b_63"),
                                     Eagle2Builder(topk=3, depth=3, num_draft_tokens=10)],
                         ids=["chain", "static", "eagle2"])
@pytest.mark.parametrize("page_size", [1, 2])  # EAGLE-2 runs its beam with pages of one slot, level by level else
def test_tree_scores_match_contiguous_head(target, head_dir, builder, page_size):
    head = load_eagle3(head_dir, target)
    drafter = Eagle3Drafter(head, kv_cache_tokens=512, page_size=page_size)
    assert drafter.needs.layer_taps == (1, 2, 3)
    taps = feature_table(3 * 64, seed=1)  # target features are the three taps, concatenated
    check_steps(drafter, builder, CONTEXTS, contiguous_path_logprob(head, taps), taps)
    assert drafter.runner.runner.cache.num_pages_used == 0


@pytest.mark.parametrize("tree", TREES)
def test_greedy_generation_is_lossless_and_drafts_the_draft_vocabulary(target, head_dir, seqs, hot, tree):
    outs = engine(target, TREES[tree], head_dir).generate(PROMPTS[:2], GREEDY)
    assert [p + o.token_ids for p, o in zip(PROMPTS, outs)] == seqs
    drafted = {t for o in outs for s in o.steps for t, v in zip(s.tree["tokens"][1:], s.tree["valid"][1:]) if v}
    assert drafted and drafted <= set(hot.tolist())


def test_head_fitted_to_the_target_taps_has_its_first_draft_accepted(tmp_path, target, seqs, hot):
    """fc maps the taps of token t to the target's final hidden state at t + 1 (attention and MLP
    silent, unit norm, lm_head = the target's rows at the draft vocabulary): the root's children
    are then the target's own next tokens, if the engine taps the right layers in the right order."""
    states = target_states(target, seqs, taps=(1, 2, 3))
    x = torch.cat([taps[:-1] for _, taps in states])
    y = torch.cat([hidden[1:] for hidden, _ in states])
    hf = hf_for(target, hot)
    state = eagle3_state(hf, hot=hot)
    state["fc.weight"], _ = fit(x, y, bias=False)
    state["midlayer.self_attn.o_proj.weight"].zero_()
    state["midlayer.mlp.down_proj.weight"].zero_()
    state["norm.weight"] = torch.ones(64)
    state["lm_head.weight"] = target.lm_head.weight.detach()[hot]
    path = write_checkpoint(tmp_path, hf, state, "safetensors")
    outs = engine(target, TREES["chain"], path).generate(PROMPTS[:2], GREEDY)
    assert [p + o.token_ids for p, o in zip(PROMPTS, outs)] == seqs
    assert all(a >= 2 for o in outs for a in o.accept_lengths[:-1])


def test_rejection_sampling_is_reproducible_with_seeds(target, head_dir):
    eng = engine(target, {"type": "chain", "depth": 3, "sample": True}, head_dir, verifier="rejection")
    params = SamplingParams(temperature=0.9, seed=11, max_tokens=12, ignore_eos=True)
    assert [o.token_ids for o in eng.generate(PROMPTS, params)] == [o.token_ids for o in eng.generate(PROMPTS, params)]


def test_saved_and_reloaded_head_drafts_the_same_trees(tmp_path, target, head_dir):
    trees = []
    for path in (head_dir, save_eagle3(load_eagle3(head_dir, target), tmp_path / "again")):
        drafter = Eagle3Drafter(load_eagle3(path, target), kv_cache_tokens=256)
        drafter.begin(target_features(drafter, [0, 1], [c[:-1] for c in CONTEXTS], [0, 0],
                                      [c[-1] for c in CONTEXTS], feature_table(3 * 64)))
        trees.append(Eagle2Builder(topk=3, depth=3, num_draft_tokens=10).build(drafter, roots_for(CONTEXTS)))
    assert torch.equal(trees[0].tokens, trees[1].tokens) and torch.equal(trees[0].scores, trees[1].scores)
    # the taps in both conventions: vLLM reads the top-level ids (layer inputs), SGLang eagle_config's
    # (layer outputs: one less)
    hf = json.loads((tmp_path / "again" / "config.json").read_text())
    taps = list(load_eagle3(head_dir, target).taps)
    assert hf["eagle_aux_hidden_state_layer_ids"] == taps
    assert [i + 1 for i in hf["eagle_config"]["eagle_aux_hidden_state_layer_ids"]] == taps


def test_the_head_s_pool_takes_the_configured_size_and_page_size(target, head_dir):
    """An eagle3 drafter node's kv_cache_tokens and page_size reach the head's own KV pool."""
    eng = SpecEngine(target, drafter={"type": "eagle3", "path": str(head_dir), "kv_cache_tokens": 96, "page_size": 4},
                     tree={"type": "chain", "depth": 2}, verifier={"type": "greedy"}, kv_cache_tokens=1024)
    cache = eng.drafter.runner.runner.cache
    assert cache.page_size == 4 and cache.allocator.num_pages * cache.page_size == 96
    default = engine(target, {"type": "chain", "depth": 2}, head_dir)
    assert eng.generate([PROMPTS[0]], GREEDY)[0].token_ids == default.generate([PROMPTS[0]], GREEDY)[0].token_ids
