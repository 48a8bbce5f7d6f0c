"""Medusa recipe: every head's cross-entropy goes down with the base frozen, the export loads in
Medusa's layout with the trained weights, and the trained heads draft far better than the
Medusa initialisation (every head a copy of the target's lm_head)."""

from pathlib import Path

import torch

from specflow.models import load_model
from specflow.models.medusa import load_medusa, save_medusa
from specflow.train import train
from specflow.train.medusa import new_medusa_heads
from tests.train.runs import GENERATED, logged, mean_accept_length, tiny_config


def test_trained_medusa_heads_are_accepted_far_more_often(tmp_path, trained_target):
    cfg = tiny_config(tmp_path, {"type": "medusa", "num_heads": 3, "save_format": "bin"}, target=trained_target,
                      steps=60, lr=1e-2, data=GENERATED)
    result = train(cfg)
    # no checkpoint_every_n_steps: no training state is saved
    assert "training_state" not in result.summary and not (tmp_path / "log" / "checkpoints").exists()
    for i in range(3):
        ce = logged(tmp_path / "log", f"train/ce_{i}")
        assert ce[-1] < 0.7 * ce[0], (i, ce)
    target = load_model(trained_target)
    assert all(not p.requires_grad for p in result.module.target.parameters())
    torch.testing.assert_close(result.module.target.lm_head.weight, target.lm_head.weight, rtol=0, atol=0)

    # save_format: bin writes the torch file Medusa's own MedusaModel.from_pretrained reads
    assert sorted(p.name for p in Path(cfg.output_dir).iterdir()) == ["config.json", "medusa_lm_head.pt"]
    heads = load_medusa(cfg.output_dir, target)
    assert (heads.num_heads, heads.num_layers) == (3, 1)
    for name, tensor in result.module.heads.state_dict().items():
        assert torch.equal(tensor, heads.state_dict()[name]), name

    untrained = tmp_path / "untrained"
    save_medusa(new_medusa_heads(target, 3, 1), untrained)
    before = mean_accept_length(trained_target, {"type": "medusa", "path": str(untrained)})
    after = mean_accept_length(trained_target, {"type": "medusa", "path": cfg.output_dir})
    assert after > before + 0.5, (before, after)
