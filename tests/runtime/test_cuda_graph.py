"""Padded fixed-shape forwards (the CUDA-graph path) equal plain forwards, and padding rows never
touch a real request's K/V. On a CPU the static path runs eagerly; the gpu test captures it."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specflow.engine import SpecEngine
from specflow.models import load_model
from specflow.runtime.cuda_graph import PAD_REQUEST, RowGraphs, capture_sizes, kv_bucket, record, token_bucket
from specflow.runtime.model_runner import ModelRunner
from specflow.sampling import SamplingParams
from specflow.tree import ancestor_mask

NODES = 4


def test_capture_sizes_and_buckets():
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert capture_sizes(1) == [1]
    assert [kv_bucket(n) for n in (1, 128, 129, 700)] == [128, 128, 256, 1024]
    assert [token_bucket(n, 48) for n in (1, 2, 3, 5, 33, 48)] == [1, 2, 4, 8, 48, 48]


def test_a_pool_too_small_for_the_padding_request_is_a_clear_error(tiny_target):
    model = load_model(tiny_target)
    with pytest.raises(ValueError, match="pad batches with a request of 64 tokens.*kv_cache_tokens"):
        ModelRunner(model, num_pages=32).enable_graphs(4, 64)


def test_row_graphs_pad_rows_and_drop_them():
    weight = torch.randn(6, 5, generator=torch.Generator().manual_seed(0))
    calls = []

    def fn(x):  # row-wise; records the padded row counts it runs on
        calls.append(len(x))
        return torch.log_softmax(x @ weight, -1)

    graphs = RowGraphs(fn, max_rows=8, capture=False)
    for rows in (3, 1, 4, 2, 3, 11):
        x = torch.randn(rows, 6)
        torch.testing.assert_close(graphs(x), fn(x))
    assert calls[::2] == [4, 1, 4, 2, 4, 11] and {key[0] for key in graphs.graphs} == {1, 2, 4}  # 11 > 8 rows: eager


def cached_kv(runner: ModelRunner, rid: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[L, kv_len, Hkv, D] K and V of a request, by logical index (page ids differ between runners)."""
    slots = runner.cache.slots(rid, 0, runner.kv_len(rid)).to(runner.cache.k.device)
    return runner.cache.k[:, slots], runner.cache.v[:, slots]


def random_tree(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A random tree of n nodes: its [n, n] ancestor mask and node depths."""
    parents = [-1] + [int(torch.randint(0, i, (), generator=g)) for i in range(1, n)]
    depth = [0] * n
    for i in range(1, n):
        depth[i] = depth[parents[i]] + 1
    return ancestor_mask(torch.tensor(parents)[None])[0], torch.tensor(depth)


def run_steps(plain: ModelRunner, graphed: ModelRunner, seed: int, steps: int = 6) -> None:
    g = torch.Generator().manual_seed(seed)
    vocab = plain.model.config.vocab_size
    rids = list(range(6))
    prompts = [torch.randint(1, vocab, (int(torch.randint(2, 40, (), generator=g)),), generator=g) for _ in rids]
    for runner in (plain, graphed):
        runner.extend(rids, prompts, logits="none")
    for _ in range(steps):
        batch = [r for r in rids if torch.rand((), generator=g) < 0.6] or [0]  # sizes that need padding
        if torch.rand((), generator=g) < 0.3:  # causal extends of uneven lengths (a drafter's catch-up)
            tokens = [torch.randint(1, vocab, (int(torch.randint(1, NODES + 1, (), generator=g)),), generator=g)
                      for _ in batch]
            outs = [runner.extend(batch, tokens) for runner in (plain, graphed)]
            torch.testing.assert_close(outs[1].hidden, outs[0].hidden, atol=1e-4, rtol=1e-4)
            continue
        n = 1 if torch.rand((), generator=g) < 0.5 else NODES
        trees = [random_tree(n, g) for _ in batch]
        tokens = [torch.randint(1, vocab, (n,), generator=g) for _ in batch]
        positions = [plain.kv_len(r) + depth for r, (_, depth) in zip(batch, trees)]
        masks = [mask if n > 1 else None for mask, _ in trees]
        outs = [plain.extend(batch, tokens, positions=positions, tree_masks=masks),  # rows, and one [B, N] tensor
                graphed.extend(batch, torch.stack(tokens), positions=torch.stack(positions), tree_masks=masks)]
        # padding the KV width changes the order of float sums, nothing else
        torch.testing.assert_close(outs[1].hidden, outs[0].hidden, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(outs[1].logits, outs[0].logits, atol=1e-4, rtol=1e-4)
        for r, (mask, _) in zip(batch, trees):  # accept a random root-to-node path
            node = int(torch.randint(0, n, (), generator=g))
            keep = mask[node].nonzero()[:, 0].tolist()
            base = plain.kv_len(r) - n
            for runner in (plain, graphed):
                runner.commit([r], [base], [keep])
        for r in rids:
            for ours, theirs in zip(cached_kv(graphed, r), cached_kv(plain, r)):
                torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def runners(path, page_size, device="cpu", sliding_window=None):
    model = load_model(path, device=device)
    model.config.sliding_window = sliding_window
    plain = ModelRunner(model, num_pages=2048 // page_size, page_size=page_size)
    graphed = ModelRunner(model, num_pages=2048 // page_size, page_size=page_size)
    graphed.enable_graphs(max_batch_size=8, max_tokens_per_request=NODES)
    return plain, graphed


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**16), page_size=st.sampled_from([1, 16]), window=st.sampled_from([None, 5]))
def test_padded_static_forward_equals_plain(tiny_target, seed, page_size, window):
    """(A sliding window: positions are laid out on the host, where the backends read them.)"""
    plain, graphed = runners(tiny_target, page_size, sliding_window=window)
    run_steps(plain, graphed, seed)
    assert graphed.graphs.graphs, "the graph path was never taken"
    assert {key[1] for key in graphed.graphs.graphs} <= {1, 2, NODES}, "causal extends pad to a power of two"
    assert graphed.cache.block_tables[PAD_REQUEST], "padding rows own their page"


@pytest.mark.parametrize("drafter", [None, {"type": "ngram"}])
def test_engine_with_graphs_matches(tiny_target, drafter):
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11, 12], [3, 4, 3, 4, 3]]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (24, 16, 8)]
    tree = {"type": "eagle2", "topk": 2, "depth": 3, "num_draft_tokens": 6} if drafter else None
    engines = [SpecEngine(tiny_target, drafter, tree, {"type": "greedy"} if drafter else None, device="cpu",
                          dtype="float32", cuda_graphs=graphs) for graphs in (False, True)]
    outs = [engine.generate(prompts, params) for engine in engines]
    assert [o.token_ids for o in outs[1]] == [o.token_ids for o in outs[0]]
    shapes = {key[:2] for key in engines[1].runner.graphs.graphs}  # (batch size, tokens per request)
    assert shapes >= ({(4, 6), (2, 6)} if drafter else {(4, 1), (2, 1)})  # 3 requests, then fewer


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captured_graphs_equal_plain_on_cuda(tiny_target):
    plain, graphed = runners(tiny_target, 1, device="cuda")
    for seed in range(4):
        run_steps(plain, graphed, seed, steps=8)
    assert all(g.graph is not None for g in graphed.graphs.graphs.values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_pool_takes_captures_after_its_only_graph_is_replaced(tiny_target):
    """A batch-1 decode graph outgrown by its context is its pool's only graph: replacing it must
    leave the pool open for the next capture (PyTorch refuses a pool whose last graph went while
    its memory lives on; that stopped the 8B decode benchmark)."""
    runner = ModelRunner(load_model(tiny_target, device="cuda"), num_pages=64)
    runner.enable_graphs(max_batch_size=1, max_tokens_per_request=1)
    x = torch.arange(4.0, device="cuda")
    graph, doubled = record(lambda: x * 2, runner.graphs.pool)
    del graph  # `doubled` still holds the pool's memory
    graph, shifted = record(lambda: x + 1, runner.graphs.pool)
    x.fill_(1.0)
    graph.replay()
    assert shifted.tolist() == [2.0] * 4 and doubled.tolist() == [0.0, 2.0, 4.0, 6.0]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
@pytest.mark.parametrize("drafter", ["draft", "eagle", "eagle3", "medusa"])
def test_drafter_expansions_through_graphs_match(drafter, device):
    """The shipped family: drafter expansions (catch-up extends of uneven lengths included) and
    Medusa's heads replay from graphs too (on a CPU: the padded static path), with the same
    greedy output as eager steps."""
    zoo = "zoo/tiny-code"
    node = {"draft": {"type": "draft_model", "path": f"{zoo}/draft"},
            "eagle": {"type": "eagle", "path": f"{zoo}/eagle"},
            "eagle3": {"type": "eagle3", "path": f"{zoo}/eagle3"},
            "medusa": {"type": "medusa", "path": f"{zoo}/medusa"}}[drafter]
    tree = {"type": "eagle2", "topk": 4, "depth": 3, "num_draft_tokens": 8}
    prompts = ["def main(", "import os\nimport sys\n", "class Tree:\n    def __init__(self"]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (20, 12, 6)]
    engines = [SpecEngine(f"{zoo}/target", node, tree, {"type": "greedy"}, device=device, dtype="float32",
                          cuda_graphs=graphs) for graphs in (False, True)]
    outs = [engine.generate(prompts, params) for engine in engines]
    assert [o.token_ids for o in outs[1]] == [o.token_ids for o in outs[0]]
    if drafter == "medusa":
        assert {key[0] for key in engines[1].drafter.run_heads.graphs} >= {2, 4}, "the heads never took the graph path"
        return
    graphs = engines[1].drafter.runner.runner.graphs
    shapes = {key[:2] for key in graphs.graphs}  # (batch size, tokens per request)
    # catch-ups of uneven lengths (the accepted tokens, then the root), padded
    assert any(size > 1 and n not in (1, 4) for size, n in shapes), shapes
    assert {key[1] for key in graphs.beams} >= {4, 2}  # EAGLE-2's levels after the root: 3 requests padded to 4


def test_tree_masked_forwards_of_uneven_sizes_run_eagerly_and_equal_plain(tiny_target):
    """A drafter expanding frontiers of different sizes per request sends tree masks of different
    sizes: the graph path cannot pad those (a tree mask covers a request's *last* m tokens, and
    padding would shift it), so they run eagerly, with the plain forward's outputs and K/V.
    (run_steps sends every request the same number of tree nodes.)"""
    plain, graphed = runners(tiny_target, 1)
    g = torch.Generator().manual_seed(3)
    vocab, rids = plain.model.config.vocab_size, [0, 1, 2]
    prompts = [torch.randint(1, vocab, (n,), generator=g) for n in (9, 5, 13)]
    for runner in (plain, graphed):
        runner.extend(rids, prompts, logits="none")
    sizes = [2, NODES, 3]
    trees = [random_tree(n, g) for n in sizes]
    tokens = [torch.randint(1, vocab, (n,), generator=g) for n in sizes]
    positions = [plain.kv_len(r) + depth for r, (_, depth) in zip(rids, trees)]
    masks = [mask for mask, _ in trees]
    assert graphed.graphs.tokens_per_request(sizes, masks) is None
    outs = [runner.extend(rids, tokens, positions=positions, tree_masks=masks) for runner in (plain, graphed)]
    torch.testing.assert_close(outs[1].logits, outs[0].logits, atol=1e-4, rtol=1e-4)
    for r in rids:
        for ours, theirs in zip(cached_kv(graphed, r), cached_kv(plain, r)):
            torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
