"""EAGLE-1/2 recipe: the loss goes down, the trained head drafts far better than an untrained
one, and the exported head (SafeAILab/EAGLE layout) drafts exactly as the trained module did."""

import torch

from specflow.models import load_model
from specflow.models.eagle import load_eagle, save_eagle
from specflow.train import train
from specflow.train.attention import CausalAttention
from specflow.train.eagle import new_eagle_head
from tests.train.runs import GENERATED, HEAD_STEPS, logged, mean_accept_length, tiny_config


def test_trained_eagle_head_is_accepted_far_more_often(tmp_path, trained_target):
    cfg = tiny_config(tmp_path, {"type": "eagle", "noise": 0.0}, target=trained_target, steps=HEAD_STEPS,
                      data=GENERATED)
    result = train(cfg)
    feature, acc = logged(tmp_path / "log", "train/feature"), logged(tmp_path / "log", "train/acc")
    assert feature[-1] < 0.5 * feature[0], feature
    assert acc[-1] > acc[0] + 0.2, acc

    target = load_model(trained_target)
    untrained = tmp_path / "untrained"
    torch.manual_seed(cfg.seed)
    save_eagle(new_eagle_head(target, 1, bias=True), untrained)
    before = mean_accept_length(trained_target, {"type": "eagle", "path": str(untrained)})
    after = mean_accept_length(trained_target, {"type": "eagle", "path": cfg.output_dir})
    assert after > before + 1.0, (before, after)

    # the exported checkpoint is the trained head, bit for bit
    trained, loaded = result.module.head, load_eagle(cfg.output_dir, result.module.target)
    ids = torch.randint(0, target.config.vocab_size, (2 * 12,), generator=torch.Generator().manual_seed(0))
    features = torch.randn(2 * 12, target.config.hidden_size, generator=torch.Generator().manual_seed(1))
    positions = torch.arange(12).repeat(2)
    with torch.no_grad():
        a = trained.compute_logits(trained(ids, positions, CausalAttention(2, 12), features=features)[0])
        b = loaded.compute_logits(loaded(ids, positions, CausalAttention(2, 12), features=features)[0])
    assert torch.equal(a, b)
