"""EAGLE drafter: tree expansion equals the head run contiguously with EAGLE's alignment, across
steps with commits; generation is lossless with every tree; FR-Spec token maps; round trips."""

import json

import pytest
import torch

from drafters.eagle import EagleDrafter, load_token_map
from specflow import SamplingParams, SpecEngine
from specflow.models import CheckpointError, load_model
from specflow.models.eagle import load_eagle, save_eagle
from specflow.runtime.beam import Beam
from specflow.runtime.cuda_graph import PAD_REQUEST
from specflow.runtime.model_runner import RuntimeOptions
from tests.drafters.expansion import (CONTEXTS, PROMPTS, TREES, LevelByLevel, check_steps,
                                      contiguous_path_logprob, feature_table, roots_for, target_features)
from tests.drafters.fitted import fit, target_states, trajectories
from tests.models.random_heads import eagle_state, head_hf, write_checkpoint
from trees.chain import ChainBuilder
from trees.eagle2 import Eagle2Builder
from trees.growth import GrowingTree
from trees.static import StaticBuilder

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
BUILDERS = [ChainBuilder(depth=3), StaticBuilder(preset="mc_sim_7b_63"),
            Eagle2Builder(topk=3, depth=3, num_draft_tokens=10)]


@pytest.fixture(scope="module")
def target(tiny_target):
    return load_model(tiny_target)


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory, target):
    hf = head_hf(target.config)
    return write_checkpoint(tmp_path_factory.mktemp("eagle"), hf, eagle_state(hf, seed=1), "bin")


@pytest.fixture(scope="module")
def plain(target):
    return [o.token_ids for o in SpecEngine(target, kv_cache_tokens=1024).generate(PROMPTS, GREEDY)]


def engine(target, tree, **drafter):
    return SpecEngine(target, drafter={"type": "eagle", "kv_cache_tokens": 1024, **drafter}, tree=tree,
                      verifier={"type": "greedy"}, kv_cache_tokens=1024, record_steps=True)


def test_a_root_expanded_again_leaves_other_trees_intact(target, head_dir):
    """One request restarts its tree (its root fed again) while another's tree goes on: the
    other request's next level reads the head outputs of its own tree, as without the restart."""
    features = feature_table(target.config.hidden_size)

    def children_of_node_1(frontiers: list[list[list[int]]]):
        drafter = EagleDrafter(load_eagle(head_dir, target), kv_cache_tokens=512)
        drafter.begin(target_features(drafter, [0, 1], [c[:-1] for c in CONTEXTS], [0, 0],
                                      [c[-1] for c in CONTEXTS], features))
        grow = GrowingTree(roots_for(CONTEXTS), 8)
        for rows in frontiers:
            nodes = torch.tensor(rows)
            tokens, logprobs, sampled = grow.expand(drafter, nodes, 2)
            if grow.size == 1:  # the first expansion: the roots' children become nodes 1, 2
                grow.add(nodes.repeat_interleave(2, 1), tokens.flatten(1), logprobs.flatten(1), sampled.flatten(1))
        return tokens[1, 0], logprobs[1, 0]

    alone = children_of_node_1([[[0], [0]], [[-1], [1]]])
    restarted = children_of_node_1([[[0], [0]], [[0], [-1]], [[-1], [1]]])
    assert torch.equal(restarted[0], alone[0])
    torch.testing.assert_close(restarted[1], alone[1])


@pytest.mark.parametrize("page_size", [1, 4])  # EAGLE-2 runs its beam with pages of one slot, level by level else
@pytest.mark.parametrize("builder", BUILDERS, ids=["chain", "static", "eagle2"])
def test_tree_scores_match_contiguous_head(target, head_dir, builder, page_size):
    head = load_eagle(head_dir, target)
    drafter = EagleDrafter(head, kv_cache_tokens=512, page_size=page_size)
    check_steps(drafter, builder, CONTEXTS, contiguous_path_logprob(head, feature_table(64)), feature_table(64))
    assert drafter.runner.runner.cache.num_pages_used == 0


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("topk, depth, n, vocab", [(3, 3, 10, None), (4, 4, 16, None), (2, 5, 9, None),
                                                   (4, 3, 12, 3)])  # vocab: a token map smaller than topk
def test_beam_builds_the_trees_of_level_by_level_expansion(target, head_dir, monkeypatch, topk, depth, n, vocab,
                                                           graphs):
    """EAGLE-2 over the head's beam (branch K/V paths, no tree mask) equals the same build
    expanded level by level with tree masks: tokens, parents and validity exactly, scores to
    float tolerance, over steps with commits; with CUDA graphs on (the padded static path on a
    CPU) the builder's levels run as one beam graph."""
    levels = []
    expand = Beam.expand
    monkeypatch.setattr(Beam, "expand", lambda beam, choice: levels.append(choice) or expand(beam, choice))
    builder = Eagle2Builder(topk=topk, depth=depth, num_draft_tokens=n)
    trees = []
    for wrap in (lambda d: d, LevelByLevel):
        head = load_eagle(head_dir, target)
        if vocab is not None:
            head.set_token_map(torch.tensor([5, 17, 99][:vocab]))
        drafter = EagleDrafter(head, kv_cache_tokens=512, runtime=RuntimeOptions(cuda_graphs=graphs, max_batch_size=8))
        trees.append(check_steps(wrap(drafter), builder, CONTEXTS, None, feature_table(64)))
        cache = drafter.runner.runner.cache
        assert cache.num_pages_used == len(cache.block_tables.get(PAD_REQUEST, ()))  # the graphs' padding only
        if graphs and wrap is not LevelByLevel:  # one beam graph: (key, requests, ...)
            assert [key[:2] for key in drafter.runner.runner.graphs.beams] == [(("eagle2", topk, depth, n), 2)]
    # the beam ran every level after the root of 3 steps, then stood aside; with graphs, the first
    # build rehearses the recording first (a warm-up and a recorded pass)
    assert len(levels) == (3 + 2 * graphs) * (depth - 1)
    for beam, level in zip(*trees):
        for name in ("tokens", "parents", "valid"):
            assert torch.equal(getattr(beam, name), getattr(level, name)), name
        torch.testing.assert_close(beam.scores, level.scores)


@pytest.mark.parametrize("tree", TREES)
def test_greedy_generation_equals_plain_decoding(target, head_dir, plain, tree):
    eng = engine(target, TREES[tree], path=str(head_dir))
    assert [o.token_ids for o in eng.generate(PROMPTS, GREEDY)] == plain
    assert eng.drafter.runner.runner.cache.num_pages_used == 0


def test_lossless_when_speculation_pauses_and_inside_a_union(target, head_dir, plain):
    """Steps without drafting (batch above spec_max_batch_size) still commit features to the
    head; a union with an n-gram drafter hands it every begin / commit."""
    paused = SpecEngine(target, drafter={"type": "eagle", "path": str(head_dir), "kv_cache_tokens": 1024},
                        tree=TREES["chain"], verifier={"type": "greedy"}, kv_cache_tokens=1024, spec_max_batch_size=2)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (6, 20, 20)]
    assert [o.token_ids for o in paused.generate(PROMPTS, params)] == [p[:n] for p, n in zip(plain, (6, 20, 20))]
    union = SpecEngine(target, drafter={"type": "union", "drafters": [
        {"type": "ngram"}, {"type": "eagle", "path": str(head_dir), "kv_cache_tokens": 1024}]},
        tree=TREES["eagle2"], verifier={"type": "greedy"}, kv_cache_tokens=1024)
    assert [o.token_ids for o in union.generate(PROMPTS, GREEDY)] == plain


def seen_features(drafter) -> dict[int, tuple[list[int], list[torch.Tensor]]]:
    """Per request, the tokens and target hidden states ``drafter`` is handed by begin and
    commit, in order (its methods wrapped on the instance)."""
    seen = {}
    for name in ("begin", "commit"):
        def record(*args, method=getattr(drafter, name)):
            features = args[-1]
            for rid, tokens, hidden in zip(features.request_ids, features.tokens, features.hidden):
                toks, rows = seen.setdefault(rid, ([], []))
                toks += tokens.tolist()
                rows.append(hidden)
            return method(*args)
        setattr(drafter, name, record)
    return seen


@pytest.mark.parametrize("spec_max_batch_size, speculative", [(None, True), (2, True), (None, False)],
                         ids=["speculating", "paused-then-speculating", "plain"])
def test_every_committed_token_reaches_the_head_once_with_its_target_feature(target, head_dir, plain,
                                                                            spec_max_batch_size, speculative):
    """Speculative steps, plain steps (a batch above spec_max_batch_size, or no request that
    speculates: overlapped, the drafter fed as each token lands) and the switch between them all
    hand the head each committed token once, in order, with the target's hidden state there."""
    eng = SpecEngine(target, drafter={"type": "eagle", "path": str(head_dir), "kv_cache_tokens": 1024},
                     tree=TREES["chain"], verifier={"type": "greedy"}, kv_cache_tokens=1024,
                     spec_max_batch_size=spec_max_batch_size, record_steps=True)
    seen = seen_features(eng.drafter)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, speculative=speculative)
              for n in (6, 20, 20)]
    outs = eng.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == [p[:n] for p, n in zip(plain, (6, 20, 20))]
    nodes = [len(step.tree["tokens"]) for step in outs[1].steps]
    drafted = {(None, True): [4] * 20, (2, True): [1] * 6 + [4] * 14, (None, False): [1] * 20}
    assert nodes == drafted[spec_max_batch_size, speculative][:len(nodes)]
    for prompt, out in zip(PROMPTS, outs):
        assert_fed_every_token(target, seen, prompt, out)


def assert_fed_every_token(target, seen, prompt: list[int], out) -> None:
    """The head was handed ``prompt`` and ``out``'s tokens in order with the target's hidden
    states, all but the last step's (the drafter is not fed a finished request's)."""
    seq = prompt + out.token_ids
    tokens, rows = seen[out.request_id]
    assert tokens == seq[:len(tokens)] and len(tokens) >= len(seq) - 1 - max(out.accept_lengths)
    hidden, _ = target_states(target, [seq])[0]
    torch.testing.assert_close(torch.cat(rows), hidden[:len(tokens)], atol=1e-4, rtol=1e-4)


def test_features_cached_by_plain_steps_reach_a_later_request(target, head_dir):
    """With prefix caching, a request that did not speculate leaves its tokens' target features
    cached beside their K/V; a later request whose prompt extends into them begins its head
    with those features."""
    eng = SpecEngine(target, drafter={"type": "eagle", "path": str(head_dir), "kv_cache_tokens": 1024},
                     tree=TREES["chain"], verifier={"type": "greedy"}, kv_cache_tokens=1024, prefix_caching=True)
    first = eng.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                                                    speculative=False))[0]
    seen = seen_features(eng.drafter)
    prompt = PROMPTS[0] + first.token_ids[:15]
    second = eng.generate(prompt, GREEDY)[0]
    assert second.num_cached_tokens == len(prompt) - 1
    assert_fed_every_token(target, seen, prompt, second)


@pytest.fixture(scope="module")
def fitted(target, tmp_path_factory):
    """An EAGLE head whose fc maps (embed(x_{t+1}), f_t) to the target's f_{t+1} on two greedy
    trajectories (attention and MLP silent): it reproduces the target's features there."""
    seqs = trajectories(target, PROMPTS[:2], 16)
    x, y = [], []
    for seq, (hidden, _) in zip(seqs, target_states(target, seqs)):
        x.append(torch.cat([target.embed_tokens(torch.tensor(seq[1:])), hidden[:-1]], -1))
        y.append(hidden[1:])
    hf = head_hf(target.config)
    state = eagle_state(hf)
    state["fc.weight"], state["fc.bias"] = fit(torch.cat(x), torch.cat(y), bias=True)
    state["layers.0.self_attn.o_proj.weight"].zero_()
    state["layers.0.mlp.down_proj.weight"].zero_()
    return seqs, write_checkpoint(tmp_path_factory.mktemp("fitted-eagle"), hf, state, "safetensors")


@pytest.mark.parametrize("tree", ["chain", "static"])
def test_head_fitted_to_the_target_has_every_draft_accepted(target, fitted, tree):
    seqs, path = fitted
    outs = engine(target, TREES[tree], path=str(path)).generate(PROMPTS[:2], SamplingParams(
        temperature=0.0, max_tokens=16, ignore_eos=True))
    assert [p + o.token_ids for p, o in zip(PROMPTS, outs)] == seqs
    for o in outs:  # the top-1 path of depth 3 every step, but the last (cut at max_tokens)
        assert o.accept_lengths[:-1] == [4] * (len(o.accept_lengths) - 1)


@pytest.mark.parametrize("tree", [{"type": "chain", "depth": 3, "sample": True}, TREES["eagle2"]],
                         ids=["sampled-chain", "eagle2"])
def test_rejection_sampling_is_reproducible_with_seeds(target, head_dir, tree):
    eng = SpecEngine(target, drafter={"type": "eagle", "path": str(head_dir), "kv_cache_tokens": 1024},
                     tree=tree, verifier={"type": "rejection"}, kv_cache_tokens=1024)
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=5, max_tokens=16, ignore_eos=True)
    first = [o.token_ids for o in eng.generate(PROMPTS, params)]
    assert first == [o.token_ids for o in eng.generate(PROMPTS, params)]
    other = SamplingParams(temperature=0.8, top_p=0.95, seed=6, max_tokens=16, ignore_eos=True)
    assert first != [o.token_ids for o in eng.generate(PROMPTS, other)]


def test_saved_and_reloaded_head_drafts_the_same_trees(tmp_path, target, head_dir):
    trees = []
    for path in (head_dir, save_eagle(load_eagle(head_dir, target), tmp_path / "again")):
        drafter = EagleDrafter(load_eagle(path, target), kv_cache_tokens=256)
        drafter.begin(target_features(drafter, [0, 1], [c[:-1] for c in CONTEXTS], [0, 0],
                                      [c[-1] for c in CONTEXTS], feature_table(64)))
        trees.append(Eagle2Builder(topk=3, depth=3, num_draft_tokens=10).build(drafter, roots_for(CONTEXTS)))
    assert torch.equal(trees[0].tokens, trees[1].tokens) and torch.equal(trees[0].scores, trees[1].scores)


def test_token_map_restricts_drafts_and_stays_lossless(tmp_path, target, head_dir, plain):
    hot = sorted(set(sum(plain, [])) | set(range(0, 320, 7)))
    (tmp_path / "hot.json").write_text(json.dumps(hot))
    eng = engine(target, TREES["eagle2"], path=str(head_dir), token_map=str(tmp_path / "hot.json"))
    outs = eng.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == plain
    drafted = {t for o in outs for s in o.steps for t, v in zip(s.tree["tokens"][1:], s.tree["valid"][1:]) if v}
    assert drafted and drafted <= set(hot)
    assert eng.drafter.head.draft_vocab_size == len(hot)


def test_token_map_expansion_matches_contiguous_head(tmp_path, target, head_dir):
    head = load_eagle(head_dir, target)
    head.set_token_map(torch.arange(0, 320, 3))
    check_steps(EagleDrafter(head, kv_cache_tokens=512), Eagle2Builder(topk=3, depth=3, num_draft_tokens=10),
                CONTEXTS, contiguous_path_logprob(head, feature_table(64)), feature_table(64), steps=2)


def test_token_map_files(tmp_path):
    torch.save(torch.tensor([3, 1, 2]), tmp_path / "hot.pt")
    (tmp_path / "hot.txt").write_text("3 1\n2\n")
    for name in ("hot.pt", "hot.txt"):
        assert load_token_map(tmp_path / name, 10).tolist() == [3, 1, 2]
    (tmp_path / "bad.json").write_text("[1, 1, 99]")
    with pytest.raises(CheckpointError, match="distinct token ids in 0..9"):
        load_token_map(tmp_path / "bad.json", 10)
    torch.save(torch.tensor([0.5, 1.7]), tmp_path / "float.pt")  # (.long() would make it [0, 1])
    (tmp_path / "float.json").write_text("[1.5, 2]")
    for name in ("float.pt", "float.json"):
        with pytest.raises(CheckpointError, match=f"token_map .*{name} must hold integer token ids, got float32"):
            load_token_map(tmp_path / name, 10)
    (tmp_path / "dict.json").write_text('{"ids": [1, 2]}')
    (tmp_path / "words.txt").write_text("1 2 three")
    for name in ("dict.json", "words.txt"):
        with pytest.raises(CheckpointError, match=f"token_map .*{name} is not a list of token ids"):
            load_token_map(tmp_path / name, 10)


@pytest.mark.parametrize("end", ["stop", "abort"])
def test_a_plain_request_ended_with_its_step_in_flight_caches_features_beside_all_its_kv(target, head_dir,
                                                                                        plain, end):
    """A plain request that a stop token or an abort ends while its next step is in flight
    leaves that step's root K/V (its last token's) to the prefix cache: its feature is cached
    beside it, so a later request whose prompt runs past that token begins its head with it."""
    eng = SpecEngine(target, drafter={"type": "eagle", "path": str(head_dir), "kv_cache_tokens": 1024},
                     tree=TREES["chain"], verifier={"type": "greedy"}, kv_cache_tokens=1024, prefix_caching=True)
    ref = plain[0]
    k = next(i for i in range(8, 20) if ref[i] not in ref[:i])  # a token first produced at k
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, speculative=False,
                            stop_token_ids=[ref[k]] if end == "stop" else [])
    rid = eng.add_request(PROMPTS[0], params)
    for _ in range(k):
        eng.step()
    first = eng.snapshot([rid])[0].token_ids
    if end == "abort":
        eng.abort(rid)
    else:
        first = eng.step()[0].token_ids
        assert first == ref[:k + 1]
    seen = seen_features(eng.drafter)
    prompt = PROMPTS[0] + first + ref[len(first):len(first) + 3]
    second = eng.generate(prompt, GREEDY)[0]
    assert second.num_cached_tokens == len(PROMPTS[0]) + len(first)
    assert_fed_every_token(target, seen, prompt, second)
