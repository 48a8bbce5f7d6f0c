"""The training attention backends against dense attention with explicit masks."""

import torch
import torch.nn.functional as F

from specflow.models import load_model
from specflow.runtime.model_runner import ModelRunner
from specflow.train.attention import UnrolledAttention
from specflow.train.lm import causal_forward
from tests.models.tiny_checkpoints import build_hf_model


def test_causal_forward_matches_the_inference_runtime(tiny_target):
    """Training's dense causal pass gives the logits the paged-cache prefill gives."""
    model = load_model(tiny_target)
    ids = torch.randint(0, model.config.vocab_size, (3, 20), generator=torch.Generator().manual_seed(0))
    hidden, _ = causal_forward(model, ids)
    runner = ModelRunner(model, num_pages=128)
    out = runner.extend([0, 1, 2], list(ids))
    torch.testing.assert_close(model.compute_logits(hidden).reshape(60, -1), out.logits)


def test_causal_forward_keeps_a_sliding_window_as_inference_does(tmp_path):
    """A Mistral target whose window (4) is shorter than the sequence: training's pass gives the
    logits of the paged-cache prefill and of transformers, so head features match inference."""
    hf = build_hf_model("mistral")
    hf.save_pretrained(tmp_path)
    model = load_model(tmp_path)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    logits = model.compute_logits(causal_forward(model, ids)[0])                      # [2, 12, V]
    out = ModelRunner(model, num_pages=64).extend([0, 1], list(ids))
    torch.testing.assert_close(logits.reshape(24, -1), out.logits)
    with torch.no_grad():
        torch.testing.assert_close(logits, hf(ids).logits, atol=1e-4, rtol=1e-4)


def test_unrolled_attention_is_the_draft_tree_mask():
    """Step k, row j attends to step-0 rows <= j and to row j of steps 1..k: the mask a depth-k
    chain node has under its root j, written out densely over all steps' keys."""
    g = torch.Generator().manual_seed(0)
    b, s, hq, hkv, d, steps = 2, 5, 4, 2, 8, 3
    attn = UnrolledAttention(b, s)
    qs, ks, vs = ([torch.randn(b * s, h, d, generator=g) for _ in range(steps)] for h in (hq, hkv, hkv))
    outs = [attn.forward(0, q, k, v) for q, k, v in zip(qs, ks, vs)]

    def heads(x):  # [B*S, H, D] -> [B, Hq, S, D]
        x = x.view(b, s, -1, d).transpose(1, 2)
        return x.repeat_interleave(hq // x.shape[1], dim=1)

    keys = torch.cat([heads(k) for k in ks], 2)        # [B, Hq, steps*S, D]
    values = torch.cat([heads(v) for v in vs], 2)
    for step in range(steps):
        mask = torch.zeros(s, steps * s, dtype=torch.bool)
        for j in range(s):
            mask[j, : j + 1] = True                                  # step-0 context
            for i in range(1, step + 1):
                mask[j, i * s + j] = True                            # own ancestors (and itself)
        want = F.scaled_dot_product_attention(heads(qs[step]), keys, values, attn_mask=mask)
        torch.testing.assert_close(outs[step], want.transpose(1, 2).reshape(b * s, hq, d))
