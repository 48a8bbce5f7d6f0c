"""Causal-LM pretraining and draft-model distillation: the loss goes down and the export is a
plain Hugging Face Llama checkpoint."""

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specflow.models import load_model
from specflow.train import train
from specflow.train.data import load_corpus, tokenize_files
from specflow.train.lm import ModelShape, build_llama, causal_forward
from tests.train.runs import logged, tiny_config

SHAPE = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64}


def test_lm_recipe_learns_and_exports_a_transformers_checkpoint(tmp_path, tiny_target):
    cfg = tiny_config(tmp_path, {"type": "lm", "tokenizer": str(tiny_target), "model": SHAPE}, steps=40)
    train(cfg)
    losses = logged(tmp_path / "log", "train/ce")
    assert losses[-1] < losses[0] - 0.5, losses
    assert (tmp_path / "log" / "loss.png").is_file()
    ours, theirs = load_model(tmp_path / "out"), AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert ours.config.eos_token_ids == [theirs.config.eos_token_id] == [0]
    ids = torch.tensor([[5, 17, 33, 2, 90]])
    hidden, _ = causal_forward(ours, ids)
    torch.testing.assert_close(ours.compute_logits(hidden), theirs(ids).logits, atol=1e-5, rtol=1e-5)


def kl_to(teacher, student, ids) -> float:
    """Mean KL(teacher || student) of the next-token distributions over ``ids [B, S]``."""
    t = teacher.compute_logits(causal_forward(teacher, ids)[0]).log_softmax(-1)
    s = student.compute_logits(causal_forward(student, ids)[0]).log_softmax(-1)
    return float((t.exp() * (t - s)).sum(-1).mean())


@torch.no_grad()
def test_distill_recipe_moves_the_draft_towards_the_target(tmp_path, tiny_target):
    # 80 steps: the KL ratio is 0.82-0.86 on Python 3.10-3.12's stdlib corpora (40 gave 0.87-0.90)
    cfg = tiny_config(tmp_path, {"type": "distill", "model": SHAPE}, target=tiny_target, steps=80)
    result = train(cfg)
    target, draft = load_model(tiny_target), load_model(tmp_path / "out")
    untrained = build_llama(ModelShape(**SHAPE), target.config.vocab_size, 0, cfg.seed)
    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    ids = tokenize_files(tokenizer, load_corpus(cfg.data).train_files[:1], 4 * 32).view(4, 32)
    assert kl_to(target, draft, ids) < 0.9 * kl_to(target, untrained, ids)
    assert result.summary["params"] == sum(p.numel() for p in draft.parameters())
