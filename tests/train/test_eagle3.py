"""EAGLE-3 recipe: training-time test lowers every unrolled step's loss, the draft vocabulary is
the most frequent tokens (d2t / t2d agree), and the trained head drafts far better than an
untrained one."""

import torch

from specflow.models import load_model
from specflow.models.eagle3 import load_eagle3, save_eagle3
from specflow.train import train
from specflow.train.eagle3 import draft_vocab, new_eagle3_head
from tests.train.runs import GENERATED, HEAD_STEPS, logged, mean_accept_length, tiny_config


def test_draft_vocab_is_the_most_frequent_tokens():
    tokens = torch.tensor([5, 5, 5, 2, 2, 7, 7, 1, 9])
    assert draft_vocab(tokens, 10, 3).tolist() == [2, 5, 7]    # 7 and 2 beat 1 and 9; ties: lower id


def test_trained_eagle3_head_is_accepted_far_more_often(tmp_path, trained_target):
    recipe = {"type": "eagle3", "draft_vocab_size": 160, "taps": [0, 1], "unroll": 3}
    cfg = tiny_config(tmp_path, recipe, target=trained_target, steps=HEAD_STEPS, data=GENERATED)
    result = train(cfg)
    assert result.summary["generated_cache"].startswith(str(tmp_path / "log" / "generated"))  # (for a resume)
    for k in range(3):
        ce = logged(tmp_path / "log", f"train/ce_{k}")
        assert ce[-1] < 0.8 * ce[0], (k, ce)

    target = load_model(trained_target)
    head = load_eagle3(cfg.output_dir, target)
    hot = head.d2t + torch.arange(160)
    assert torch.equal(hot, result.module.head.d2t + torch.arange(160))
    assert head.t2d.sum() == 160 and bool(head.t2d[hot].all())
    assert head.taps == (0, 1)
    for name, tensor in result.module.head.state_dict().items():
        assert torch.equal(tensor, head.state_dict()[name]), name

    untrained = tmp_path / "untrained"
    torch.manual_seed(cfg.seed)
    save_eagle3(new_eagle3_head(target, hot, (0, 1)), untrained)
    before = mean_accept_length(trained_target, {"type": "eagle3", "path": str(untrained)})
    after = mean_accept_length(trained_target, {"type": "eagle3", "path": cfg.output_dir})
    assert after > before + 1.0, (before, after)


def test_one_tap_head_trains_and_drafts_through_fc(tiny_target):
    """With one tap the taps are [T, H], as wide as a projected feature: fc must still be the
    projection training learns and the drafter applies (it was skipped by width, so the exported
    fc was never trained and never read)."""
    from drafters.eagle3 import Eagle3Drafter
    from specflow.protocols import TargetFeatures
    from specflow.train.config import OptimConfig
    from specflow.train.eagle3 import Eagle3Module

    target = load_model(tiny_target)
    torch.manual_seed(0)
    head = new_eagle3_head(target, torch.arange(160), (1,))
    assert tuple(head.fc.weight.shape) == (64, 64)
    batch = torch.randint(320, (2, 17), generator=torch.Generator().manual_seed(0))
    Eagle3Module(head, target, OptimConfig(), unroll=2).losses(batch)["loss"].backward()
    assert head.fc.weight.grad is not None and head.fc.weight.grad.abs().sum() > 0   # training reads fc

    taps = torch.randn(5, 64)
    features = TargetFeatures([0], [torch.arange(5)], [torch.arange(5)], [1], taps=[taps])
    with torch.no_grad():
        torch.testing.assert_close(head.fc(taps), taps)      # a new one-tap head starts from the tap itself
        head.fc.weight.normal_(0, 0.1)                       # ... and once fc is trained, drafting reads it
        projected = Eagle3Drafter(head, kv_cache_tokens=64).projected(features)[0]
        torch.testing.assert_close(projected, head.fc(taps))


def test_step_accuracy_counts_targets_outside_the_draft_vocab_as_misses(tiny_target):
    """acc_k is the fraction of rows whose drafted token is the target's argmax, as SafeAILab's
    traineagle3 reports it (correct / loss_mask.sum()): a row whose target argmax lies outside the
    draft vocabulary can never be drafted, so it is a miss, not a row left out. A head that drafts
    the target's best in-vocabulary token everywhere scores the in-vocabulary fraction, not 1."""
    import torch.nn.functional as F

    from specflow.train.config import OptimConfig
    from specflow.train.eagle3 import Eagle3Module
    from specflow.train.heads import target_pass

    target = load_model(tiny_target)
    hot = torch.arange(0, 320, 2)                                        # half the vocabulary
    head = new_eagle3_head(target, hot, (0, 1))
    batch = torch.randint(320, (2, 17), generator=torch.Generator().manual_seed(0))
    _, probs, _ = target_pass(target, batch, head.taps)
    steps = iter(range(3))

    def oracle(hidden):   # step k, row j: the target's distribution over the draft vocab at j + 1 + k
        k = next(steps)
        return F.pad(probs[:, 1 + k:, hot], (0, 0, 0, k)).reshape(hidden.shape[0], -1)

    head.compute_logits = oracle
    with torch.no_grad():
        out = Eagle3Module(head, target, OptimConfig(), unroll=3).eval().losses(batch)
    for k in range(3):
        in_vocab = head.t2d[probs[:, 1 + k:].argmax(-1)].float().mean()
        assert 0 < in_vocab < 1
        torch.testing.assert_close(out[f"acc_{k}"], in_vocab)
