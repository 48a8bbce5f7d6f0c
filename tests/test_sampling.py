"""Target-logits processing against a per-row reference, and the inverse-CDF sampler."""

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from specflow.sampling import SamplingBatch, SamplingParams, next_tokens, sample_rows, target_probs
from specflow.uniforms import counter_uniforms


def reference_probs(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """One row [V] processed the textbook way, in float64: temperature, keep the tokens at least
    as likely as the top_k-th, keep the smallest prefix whose mass reaches top_p, drop tokens
    under min_p x the top one."""
    if p.temperature == 0:
        return np.eye(len(logits))[logits.argmax()]
    x = np.exp((logits - logits.max()) / p.temperature)
    order = np.argsort(-x, kind="stable")
    kept = x[order] / x.sum()
    if p.top_k > 0:
        kept[kept < kept[min(p.top_k, len(kept)) - 1]] = 0.0
    kept /= kept.sum()
    before = np.cumsum(kept) - kept
    if p.top_p < 1:
        kept[before >= p.top_p] = 0.0
    kept[kept < p.min_p * kept[0]] = 0.0
    out = np.zeros_like(kept)
    out[order] = kept / kept.sum()
    return out


def test_top_k_keeps_ties_whatever_the_batch():
    """Tokens tied with the k-th are all kept, alone or beside rows that sort (a row's
    distribution never depends on its batch); greedy rows take the first of tied maxima."""
    logits = torch.tensor([3.0, 1, 1, 1, 1, 0.5, 1, 1])
    top3 = SamplingParams(temperature=1.0, top_k=3)
    for others in ([], [SamplingParams(temperature=1.0, top_p=0.9)], [SamplingParams(temperature=0.0)]):
        batch = [top3] + others
        probs = target_probs(logits.expand(len(batch), 1, -1), SamplingBatch.from_params(batch, range(len(batch))))
        assert (probs[0, 0] > 0).tolist() == [True, True, True, True, True, False, True, True]
        np.testing.assert_allclose(probs[0, 0].numpy(), reference_probs(logits.double().numpy(), top3), atol=1e-6)
    tied = torch.tensor([0.0, 2.0, 2.0, 1.0]).expand(2, 1, -1)
    mixed = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)]
    assert target_probs(tied, SamplingBatch.from_params(mixed, [0, 1]))[0, 0].tolist() == [0.0, 1.0, 0.0, 0.0]


def test_top_p_cuts_tied_tokens_by_index_whatever_the_batch_shape():
    """(the sort was not stable: which of 1024 equally likely tokens top-p kept depended on where
    torch's sort put them, which depends on the tensor's shape: a tree's row could keep other tokens
    than plain decoding's, and a seeded draw differ)"""
    half = SamplingParams(temperature=1.0, top_p=0.5)
    for b, n in ((1, 1), (3, 64)):
        probs = target_probs(torch.zeros(b, n, 1024), SamplingBatch.from_params([half] * b, range(b)))
        assert ((probs > 0) == (torch.arange(1024) < 512)).all(), (b, n)


def test_extreme_filters_keep_the_top_token():
    """A top_p that float32 rounds to 0 keeps the top token (not none, which would sample from
    NaNs), and a top_k beyond int64 is refused up front (it failed the whole batch's step)."""
    logits = torch.tensor([[[0.5, 2.0, 1.0, -1.0]]])                                    # [1, 1, V]
    tiny = SamplingBatch.from_params([SamplingParams(temperature=1.0, top_p=1e-50)], [0])
    assert target_probs(logits, tiny)[0, 0].tolist() == [0.0, 1.0, 0.0, 0.0]
    assert next_tokens(logits[:, 0], tiny).tolist() == [1]
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=2**64)


row_params = st.builds(SamplingParams, temperature=st.sampled_from([0.0, 0.5, 1.0, 1.7]),
                       top_k=st.sampled_from([-1, 1, 3, 40]), top_p=st.sampled_from([1.0, 0.9, 0.5]),
                       min_p=st.sampled_from([0.0, 0.05, 0.3]))


@settings(max_examples=60, deadline=None)
@given(params=st.lists(row_params, min_size=1, max_size=4), n=st.integers(1, 3), seed=st.integers(0, 2**16))
@example(params=[SamplingParams(temperature=1.0)], n=2, seed=0)                    # no filter: no sort
@example(params=[SamplingParams(temperature=1.0, min_p=0.3)], n=2, seed=0)         # each filter alone
@example(params=[SamplingParams(temperature=1.0, top_p=0.5)], n=2, seed=0)
@example(params=[SamplingParams(temperature=1.0, top_k=3), SamplingParams(temperature=0.0)], n=2, seed=0)
@example(params=[SamplingParams(temperature=1.0, top_k=3), SamplingParams(temperature=1.0, top_p=0.9)], n=2, seed=0)
def test_target_probs_match_the_reference(params, n, seed):
    """Every mix of greedy rows and filters (none, each alone, together; only top-p sorts) gives
    the textbook distribution."""
    logits = torch.randn(len(params), n, 30, generator=torch.Generator().manual_seed(seed)) * 3  # [B, N, V]
    sampling = SamplingBatch.from_params(params, range(len(params)))
    got = target_probs(logits, sampling)
    want = np.stack([[reference_probs(row, p) for row in rows] for rows, p in zip(logits.double().numpy(), params)])
    np.testing.assert_allclose(got.numpy(), want, atol=1e-5)


def test_sample_rows_inverts_the_cdf():
    probs = torch.tensor([[0.2, 0.3, 0.0, 0.5, 0.0]] * 5, dtype=torch.float64)  # [5, V]
    u = torch.tensor([0.0, 0.19, 0.2, 0.5, 0.999999999], dtype=torch.float64)
    assert sample_rows(probs, u).tolist() == [0, 0, 1, 3, 3]  # never a zero-probability token
    assert sample_rows(probs * 7, u).tolist() == [0, 0, 1, 3, 3]  # any scale
    assert sample_rows(torch.zeros(1, 5, dtype=torch.float64), u[-1:]).tolist() == [0]  # no mass: token 0
    # u x mass lands on a block's lower edge up to rounding: the block's zero-probability first
    # token must not come out (a block's start is the earlier blocks' running total, not cdf - mass)
    edge = torch.tensor([[1.7891420e-10, 5.7997018e-05, 0.0, 0.19111027]])
    assert sample_rows(edge, torch.tensor([0.0003033829756501216], dtype=torch.float64), block=2).tolist() == [3]


@settings(max_examples=60, deadline=None)
@given(weights=st.lists(st.lists(st.integers(0, 3), min_size=12, max_size=12), min_size=1, max_size=4),
       grid=st.lists(st.integers(0, 63), min_size=4, max_size=4), block=st.sampled_from([1, 2, 5, 1024]))
def test_sample_rows_by_blocks_is_the_flat_inverse_cdf(weights, grid, block):
    """Block masses, then the tokens of one block (of 1, 2, 4 or all 12 tokens), find what one
    float64 CDF over the row finds (small integer weights and uniforms k / 64: exact arithmetic,
    boundaries included); all-zero rows and all-zero blocks too. Leading dimensions come back
    as they went in."""
    probs = torch.tensor(weights, dtype=torch.float32)                                 # [R, 12]
    u = torch.tensor(grid[: len(weights)], dtype=torch.float64) / 64
    cdf = probs.double().cumsum(-1)
    flat = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    positive = torch.where(probs > 0, torch.arange(12), 0).amax(-1)
    assert sample_rows(probs, u, block=block).tolist() == torch.minimum(flat, positive).tolist()
    assert sample_rows(probs[:, None], u[:, None], block=block).shape == (len(weights), 1)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8), SamplingParams(temperature=1.0, top_k=4),
                                    SamplingParams(temperature=1.2, top_p=0.8, min_p=0.02)])
def test_next_tokens_follow_the_processed_distribution(params):
    """4000 requests with one logits row each: one draw per request's generator, chi-square
    against target_probs; greedy requests in the batch still get their argmax."""
    from scipy.stats import chisquare  # (here: the GPU machine has no scipy)
    logits = torch.randn(1, 12, generator=torch.Generator().manual_seed(1)) * 2      # [1, V]
    greedy = SamplingParams(temperature=0.0)
    batch = [params] * 4000 + [greedy]
    sampling = SamplingBatch.from_params(batch, range(len(batch)))
    tokens = next_tokens(logits.expand(len(batch), -1), sampling).tolist()
    assert tokens[-1] == int(logits.argmax())
    probs = target_probs(logits[None], SamplingBatch.from_params([params], [0]))[0, 0].double()
    counts = np.bincount(tokens[:-1], minlength=12)
    assert counts[(probs == 0).numpy()].sum() == 0, "a filtered token was drawn"
    live = (probs > 0).numpy()
    expected = probs.numpy()[live] / probs.numpy()[live].sum() * counts.sum()
    assert chisquare(counts[live], expected).pvalue > 1e-3


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0),
                                    SamplingParams(temperature=0.7, top_k=3, top_p=0.9, min_p=0.1)])
def test_non_finite_logits_do_not_break_the_batch(params):
    """(a float16 overflow in one request must not fail every request in the step)"""
    inf, nan = float("inf"), float("nan")
    logits = torch.tensor([[0.0, 1.0, 2.0, 0.5],       # finite
                           [0.0, 1.0, inf, 0.5],       # +inf: that token takes the mass
                           [0.0, nan, 2.0, 0.5],       # NaN: that token gets none
                           [-inf, -inf, -inf, -inf]])  # no mass: token 0
    tokens = torch.stack([next_tokens(logits, SamplingBatch.from_params([params] * 4, [s + 4 * r for r in range(4)]))
                          for s in range(200)])        # [200, 4]
    assert set(tokens[:, 1].tolist()) == {2} and 1 not in tokens[:, 2].tolist() and set(tokens[:, 3].tolist()) == {0}
    assert len(set(tokens[:, 0].tolist())) > 1


def test_counter_uniforms_are_uniform_and_independent_across_seeds_positions_and_streams():
    from scipy.stats import chisquare, kstest
    n = 100_000
    seeds = np.arange(n, dtype=np.uint64) + np.uint64(12345)  # neighbouring seeds, as choice_seed gives
    u = {key: counter_uniforms(seeds, np.full(n, key[0]), key[1]).numpy() for key in [(7, 0), (8, 0), (7, 1), (7, 2)]}
    for key, x in u.items():
        assert kstest(x, "uniform").pvalue > 1e-3, key
        assert x.min() >= 0.0 and x.max() < 1.0
    for a, b in [((7, 0), (8, 0)), ((7, 0), (7, 1)), ((7, 1), (7, 2))]:  # pairs: 10 x 10 bins, flat
        joint, _, _ = np.histogram2d(u[a], u[b], bins=10, range=[[0, 1], [0, 1]])
        assert chisquare(joint.ravel()).pvalue > 1e-3, (a, b)
    shifted = counter_uniforms(seeds[1:], np.full(n - 1, 7), 0).numpy()  # seed s + 1 against seed s
    joint, _, _ = np.histogram2d(u[(7, 0)][:-1], shifted, bins=10, range=[[0, 1], [0, 1]])
    assert chisquare(joint.ravel()).pvalue > 1e-3


def test_a_positions_draw_is_the_same_whichever_step_draws_it():
    batch = SamplingBatch.from_params([SamplingParams(temperature=1.0)] * 2, [3, 4], [5, 9])
    later = SamplingBatch.from_params([SamplingParams(temperature=1.0)] * 2, [3, 4], [7, 9])
    assert torch.equal(batch.draws(3, "cpu")[0, 2:], later.draws(1, "cpu")[0])  # position 7, 8: the same
    assert not torch.equal(batch.draws(3, "cpu")[0], batch.draws(3, "cpu")[1])  # another seed: others
    coins, draws = batch.coins(4, "cpu"), batch.draws(3, "cpu")
    assert len(set(coins.flatten().tolist()) | set(draws.flatten().tolist())) == coins.numel() + draws.numel()


def test_a_rows_probabilities_do_not_depend_on_its_batch_mates():
    """(bit for bit: a seeded draw near a CDF step would otherwise differ between batchings)"""
    for seed in range(40):
        logits = torch.randn(2, 1, 50, generator=torch.Generator().manual_seed(seed)) * 3
        alone = target_probs(logits[:1], SamplingBatch.from_params([SamplingParams(temperature=0.8)], [0]))
        mixed = target_probs(logits, SamplingBatch.from_params([SamplingParams(temperature=0.8),
                                                                SamplingParams(temperature=0.8, top_k=5)], [0, 1]))
        assert torch.equal(alone[0], mixed[0]), seed


def test_top_p_and_min_p_at_their_exact_boundaries():
    """Equal logits give probabilities exact in binary, so the boundaries are met exactly:
    top_p keeps the smallest prefix whose mass *reaches* top_p (four tokens of 0.25 and top_p 0.5:
    two, not three), and min_p keeps the tokens *at least* min_p x the top one (min_p 1 keeps the
    tied top tokens, not none, which would leave no mass and give token 0)."""
    four = torch.zeros(1, 1, 4)
    probs = target_probs(four, SamplingBatch.from_params([SamplingParams(temperature=1.0, top_p=0.5)], [0]))[0, 0]
    assert int((probs > 0).sum()) == 2 and sorted(probs.tolist()) == [0.0, 0.0, 0.5, 0.5]
    tied = torch.tensor([[[-1.0, 1.0, 1.0, 0.0]]])
    top = SamplingBatch.from_params([SamplingParams(temperature=1.0, min_p=1.0)], [0])
    assert target_probs(tied, top)[0, 0].tolist() == [0.0, 0.5, 0.5, 0.0]
    draws = {int(next_tokens(tied[:, 0], SamplingBatch.from_params([SamplingParams(temperature=1.0, min_p=1.0)],
                                                                    [s]))[0]) for s in range(40)}
    assert draws == {1, 2}
