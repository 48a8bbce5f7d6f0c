"""EAGLE-1/2 recipe: the loss goes down, the trained head drafts far better than an untrained
one, and the exported head (SafeAILab/EAGLE layout) drafts exactly as the trained module did."""

import pytest
import torch

from specflow.models import LlamaForCausalLM, ModelConfig, load_model
from specflow.models.eagle import load_eagle, save_eagle
from specflow.models.eagle3 import load_eagle3, save_eagle3
from specflow.train import train
from specflow.train.attention import CausalAttention
from specflow.train.eagle import new_eagle_head
from specflow.train.eagle3 import default_taps, new_eagle3_head
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


@pytest.mark.parametrize("family", [{"model_type": "qwen2"}, {"model_type": "qwen3"},
                                    {"model_type": "llama", "attention_bias": True}], ids=str)
def test_heads_made_for_any_target_family_load_back(tmp_path, family):
    """A head's layers are plain Llama layers whatever the target's family (q/k/v bias, q/k norm):
    the layout loads them so, and a head trained with the target's extras could not be loaded."""
    target = LlamaForCausalLM(ModelConfig.from_hf({
        **family, "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}))
    heads = [(new_eagle_head(target, 1, bias=True), save_eagle, load_eagle),
             (new_eagle3_head(target, torch.arange(40), default_taps(4)), save_eagle3, load_eagle3)]
    for i, (head, save, load) in enumerate(heads):
        loaded = load(save(head, tmp_path / str(i)), target)
        assert loaded.state_dict().keys() == head.state_dict().keys()
        for name, tensor in head.state_dict().items():
            assert torch.equal(tensor, loaded.state_dict()[name]), name
