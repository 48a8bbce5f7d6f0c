"""The native model through the paged runtime equals transformers: logits, hidden states, taps,
and greedy generation, for every supported architecture variant."""

import pytest
import torch
from torch.testing import assert_close

from specflow.models import LlamaForCausalLM, ModelConfig, load_model
from specflow.models.llama import StackedState, checkpoint_state
from specflow.runtime.model_runner import ModelRunner

from tests.models.tiny_checkpoints import PROMPTS, VARIANTS

NEW_TOKENS = 20


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_hidden_and_taps_match_transformers(variant, tiny_checkpoint):
    hf, path = tiny_checkpoint(variant)
    model = load_model(path)
    num_layers = model.config.num_hidden_layers
    taps = (2, num_layers // 2, num_layers - 3, 0, num_layers)  # EAGLE-3 taps, embedding, final
    runner = ModelRunner(model, num_pages=64, page_size=1)
    out = runner.extend([7, 3], PROMPTS, taps=taps)  # two prompts of different lengths, one call
    assert len(out.taps) == len(taps)
    for r, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt]), output_hidden_states=True)
        rows = out.rows(r)
        assert_close(out.logits[rows], ref.logits[0])
        assert_close(out.hidden[rows], ref.hidden_states[-1][0])
        for layer, got in zip(taps, out.taps):
            assert_close(got[rows], ref.hidden_states[layer][0])


@pytest.mark.parametrize("variant", ["llama3_rope", "tied", "mistral", "qwen2", "qwen3"])
def test_greedy_decoding_matches_transformers_generate(variant, tiny_checkpoint):
    hf, path = tiny_checkpoint(variant)
    runner = ModelRunner(load_model(path), num_pages=128, page_size=1)
    rids = [0, 1]
    out = runner.extend(rids, PROMPTS, logits="last")
    generated = [[t] for t in out.logits.argmax(-1).tolist()]
    for _ in range(NEW_TOKENS - 1):  # decode both requests together, one token each
        out = runner.extend(rids, [[g[-1]] for g in generated], logits="last")
        for g, t in zip(generated, out.logits.argmax(-1).tolist()):
            g.append(t)
    runner.release(rids)
    for prompt, ours in zip(PROMPTS, generated):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)
        assert ref[0, len(prompt):].tolist() == ours


def test_taps_outside_the_model_are_rejected(tiny_checkpoint):
    _, path = tiny_checkpoint("llama")
    runner = ModelRunner(load_model(path), num_pages=16)
    with pytest.raises(ValueError, match="0..4"):
        runner.extend([0], [[1, 2]], taps=(5,))


def test_tied_head_shares_the_embedding_parameter():
    cfg = ModelConfig(arch="llama", vocab_size=32, hidden_size=16, intermediate_size=32,
                      num_hidden_layers=1, num_attention_heads=2, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg)
    assert model.lm_head.weight is model.embed_tokens.weight
    assert "lm_head.weight" in model.state_dict()
    assert len(list(model.parameters())) == len(list(model.named_parameters(remove_duplicate=False))) - 1


def test_packed_projections_keep_checkpoint_names():
    """q/k/v and gate/up run as one Linear each; checkpoint_state splits them into the checkpoint's
    names (copies), StackedState stacks them again."""
    cfg = ModelConfig(arch="qwen2", vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=4)  # qwen2: q/k/v biases
    model = LlamaForCausalLM(cfg)
    state = checkpoint_state(model)
    attn = "model.layers.0.self_attn."
    assert {f"{attn}{p}_proj.{kind}" for p in "qkv" for kind in ("weight", "bias")} <= set(state)
    assert {"model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"} <= set(state)
    assert not any("qkv_proj" in k or "gate_up_proj" in k for k in state)
    packed = model.model.layers[0].self_attn.qkv_proj
    torch.testing.assert_close(state[f"{attn}k_proj.weight"], packed.weight[16:24].detach())  # q is 4 x 4 rows
    torch.testing.assert_close(state[f"{attn}v_proj.bias"], packed.bias[24:].detach())
    other = LlamaForCausalLM(cfg)
    stacked = StackedState(other)
    for name, tensor in state.items():
        stacked.add(name, tensor)
    other.load_state_dict(stacked.state, strict=True)  # stacked again
    for (name, ours), theirs in zip(model.named_parameters(), other.parameters()):
        torch.testing.assert_close(theirs, ours, msg=name)
