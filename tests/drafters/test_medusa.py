"""Medusa drafter: a node at depth d is drafted by head d - 1 (all heads computed once, from the
target feature of the token before the root), so trees are Medusa's; generation is lossless."""

import pytest
import torch

from drafters.medusa import MedusaDrafter
from specflow import SamplingParams, SpecEngine
from specflow.models import load_model
from specflow.models.medusa import load_medusa, save_medusa
from tests.drafters.expansion import CONTEXTS, PROMPTS, TREES, check_steps, feature_table, roots_for, target_features
from tests.drafters.fitted import fit, target_states, trajectories
from tests.models.random_heads import medusa_state, write_checkpoint
from trees.chain import ChainBuilder
from trees.eagle2 import Eagle2Builder
from trees.static import StaticBuilder

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
MEDUSA_TREES = {**TREES, "medusa_63": {"type": "static", "preset": "medusa_63"}}


@pytest.fixture(scope="module")
def target(tiny_target):
    return load_model(tiny_target)


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory):
    state = medusa_state(64, 320, num_heads=3, seed=5)
    return write_checkpoint(tmp_path_factory.mktemp("medusa"), {"medusa_num_heads": 3, "medusa_num_layers": 1},
                            state, "bin", names=("medusa_lm_head.safetensors", "medusa_lm_head.pt"))


@pytest.fixture(scope="module")
def seqs(target):
    return trajectories(target, PROMPTS[:2], 16)


def engine(target, tree, path, verifier="greedy"):
    return SpecEngine(target, drafter={"type": "medusa", "path": str(path)}, tree=tree,
                      verifier={"type": verifier}, kv_cache_tokens=1024)


@pytest.mark.parametrize("builder", [ChainBuilder(depth=3), StaticBuilder(preset="mc_sim_7b_63"),
                                     Eagle2Builder(topk=3, depth=3, num_draft_tokens=10)],
                         ids=["chain", "static", "eagle2"])
def test_node_at_depth_d_gets_head_d_minus_1(target, head_dir, builder):
    heads = load_medusa(head_dir, target)
    features = feature_table(64, seed=2)

    @torch.inference_mode()
    def path_logprob(b, ctx, path):  # every head reads the feature of the token before the root
        logprobs = torch.log_softmax(heads(features(b, torch.tensor([len(ctx) - 2]))), -1)[:, 0]  # [heads, V]
        return sum(float(logprobs[d, tok]) for d, tok in enumerate(path))

    check_steps(MedusaDrafter(heads), builder, CONTEXTS, path_logprob, features)
    drafter = MedusaDrafter(heads)
    drafter.begin(target_features(drafter, [0, 1], [c[:-1] for c in CONTEXTS], [0, 0], [c[-1] for c in CONTEXTS],
                                  features))
    tree = StaticBuilder(preset="mc_sim_7b_63").build(drafter, roots_for(CONTEXTS))
    assert int(tree.depth[tree.valid].max()) == 3  # 3 heads: nothing deeper than depth 3


@pytest.mark.parametrize("tree", MEDUSA_TREES)
def test_greedy_generation_equals_plain_decoding(target, head_dir, seqs, tree):
    outs = engine(target, MEDUSA_TREES[tree], head_dir).generate(PROMPTS[:2], GREEDY)
    assert [p + o.token_ids for p, o in zip(PROMPTS, outs)] == seqs


@pytest.fixture(scope="module")
def fitted(tmp_path_factory, target, seqs):
    """Heads where head i maps the target's hidden state at t to its logits at t + 1 + i on two
    greedy trajectories (ResBlocks silent): it predicts token t + 2 + i, as Medusa's heads are
    trained to."""
    states = [hidden for hidden, _ in target_states(target, seqs)]
    state = medusa_state(64, 320, num_heads=3)
    for i in range(3):
        x = torch.cat([h[: len(h) - 1 - i] for h in states])
        y = torch.cat([h[1 + i:] for h in states])
        mapping, _ = fit(x, y, bias=False)                                   # [H, H]: h_t -> h_{t+1+i}
        state[f"{i}.0.linear.weight"].zero_()
        state[f"{i}.0.linear.bias"].zero_()
        state[f"{i}.1.weight"] = target.lm_head.weight.detach() @ mapping   # [V, H]
    return write_checkpoint(tmp_path_factory.mktemp("fitted-medusa"), {"medusa_num_heads": 3}, state, "safetensors")


def test_heads_fitted_to_the_target_have_every_draft_accepted(target, seqs, fitted):
    outs = engine(target, TREES["chain"], fitted).generate(PROMPTS[:2], GREEDY)
    assert [p + o.token_ids for p, o in zip(PROMPTS, outs)] == seqs
    for o in outs:  # depth 3 = all three heads, every step but the last (cut at max_tokens)
        assert o.accept_lengths[:-1] == [4] * (len(o.accept_lengths) - 1)


def test_heads_run_once_per_drafted_tree_and_never_for_a_plain_step(target, seqs, fitted):
    """Three requests above spec_max_batch_size decode plainly until the third ends: the heads
    do not run for those steps, then once per step for the trees drafted, from the last plain
    step's hidden state: every draft is accepted again."""
    eng = SpecEngine(target, drafter={"type": "medusa", "path": str(fitted)}, tree=TREES["chain"],
                     verifier={"type": "greedy"}, kv_cache_tokens=1024, spec_max_batch_size=2, record_steps=True)
    runs, run_heads = [], eng.drafter.run_heads
    eng.drafter.run_heads = lambda last: runs.append(len(last)) or run_heads(last)
    params = [GREEDY, GREEDY, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)]
    outs = eng.generate(PROMPTS[:2] + PROMPTS[:1], params)
    assert [p + o.token_ids for p, o in zip(PROMPTS, outs[:2])] == seqs
    drafted = [[len(s.tree["tokens"]) > 1 for s in o.steps] for o in outs[:2]]
    assert all(d[:3] == [False] * 3 and d[-2] for d in drafted)  # plain steps, then trees
    assert sum(runs) == sum(map(sum, drafted)) and set(runs) == {2}
    for o, d in zip(outs, drafted):  # every tree's drafts accepted, but the last (cut at max_tokens)
        assert [n for n, tree in zip(o.accept_lengths[:-1], d) if tree] == [4] * (sum(d[:-1]))


def test_rejection_sampling_is_reproducible_with_seeds(target, head_dir):
    eng = engine(target, {"type": "chain", "depth": 3, "sample": True}, head_dir, verifier="rejection")
    params = SamplingParams(temperature=0.9, seed=3, max_tokens=12, ignore_eos=True)
    assert [o.token_ids for o in eng.generate(PROMPTS, params)] == [o.token_ids for o in eng.generate(PROMPTS, params)]


def test_saved_and_reloaded_heads_draft_the_same_trees(tmp_path, target, head_dir):
    trees = []
    for path in (head_dir, save_medusa(load_medusa(head_dir, target), tmp_path / "again", format="bin")):
        drafter = MedusaDrafter(load_medusa(path, target))
        drafter.begin(target_features(drafter, [0, 1], [c[:-1] for c in CONTEXTS], [0, 0],
                                      [c[-1] for c in CONTEXTS], feature_table(64)))
        trees.append(StaticBuilder(preset="medusa_63").build(drafter, roots_for(CONTEXTS)))
    assert torch.equal(trees[0].tokens, trees[1].tokens) and torch.equal(trees[0].scores, trees[1].scores)


def test_sampled_drafting_records_the_heads_distribution_as_q(target, head_dir):
    """With want_probs (sampled drafting), each drafted node's q is the distribution of the head
    for its depth, whose draws are the children: rows of probabilities over the vocabulary."""
    heads = load_medusa(head_dir, target)
    drafter = MedusaDrafter(heads)
    features = feature_table(64, seed=2)
    drafter.begin(target_features(drafter, [0, 1], [c[:-1] for c in CONTEXTS], [0, 0], [c[-1] for c in CONTEXTS],
                                  features))
    roots = roots_for(CONTEXTS)
    roots.generators = [torch.Generator().manual_seed(b) for b in range(len(CONTEXTS))]
    tree = ChainBuilder(depth=3, sample=True).build(drafter, roots)
    probs = tree.draft_probs[:, :3]                                          # [B, 3, V]: the nodes expanded
    torch.testing.assert_close(probs.sum(-1), torch.ones(len(CONTEXTS), 3))
    with torch.inference_mode():
        for b, ctx in enumerate(CONTEXTS):
            logprobs = torch.log_softmax(heads(features(b, torch.tensor([len(ctx) - 2]))), -1)[:, 0]  # [heads, V]
            torch.testing.assert_close(probs[b], logprobs.exp())
