"""Draft heads load the public layouts (written here by hand, as .bin and .safetensors), compute
what the published formulas say (a dense reference without the paged runtime), reject heads
that do not fit their target with the tensor and both shapes named, and save what they load."""

import json

import pytest
import torch
from safetensors.torch import load_file

from specflow.models import CheckpointError, load_model
from specflow.models.eagle import load_eagle, save_eagle
from specflow.models.eagle3 import eagle3_taps, load_eagle3, save_eagle3
from specflow.models.llama import checkpoint_state
from specflow.models.medusa import load_medusa, save_medusa
from specflow.models.rope import apply_rotary
from specflow.runtime.model_runner import ModelRunner
from tests.models.random_heads import eagle3_state, eagle_state, head_hf, medusa_state, write_checkpoint

TOKENS = torch.tensor([5, 17, 99, 3, 42, 8, 1])


@pytest.fixture(scope="module")
def target(tiny_target):
    return load_model(tiny_target)


def dense_attention(attn, x, cos, sin):
    """Causal attention of one sequence without any cache: the textbook formula."""
    t = x.shape[0]
    q, k, v = attn.unpack("qkv_proj", attn.qkv_proj(x))
    q = apply_rotary(q.reshape(t, attn.num_heads, -1), cos, sin).transpose(0, 1)     # [Hq, T, D]
    k = apply_rotary(k.reshape(t, attn.num_kv_heads, -1), cos, sin).transpose(0, 1)  # [Hkv, T, D]
    v = v.reshape(t, attn.num_kv_heads, -1).transpose(0, 1)
    rep = attn.num_heads // attn.num_kv_heads
    k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)                            # [Hq, T, D]
    scores = q @ k.transpose(1, 2) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    return attn.o_proj((scores.softmax(-1) @ v).transpose(0, 1).reshape(t, -1))


def run_head(head, features):
    """The head through the paged runtime (one request, positions 0..T-1)."""
    return ModelRunner(head, num_pages=64).extend([0], [TOKENS], logits="none",
                                                  inputs={"features": features}).hidden


@pytest.mark.parametrize("fmt", ["bin", "safetensors"])
def test_eagle_layout_loads_and_computes_cnets1(tmp_path, target, fmt):
    hf = head_hf(target.config)
    state = eagle_state(hf, seed=1)
    head = load_eagle(write_checkpoint(tmp_path, hf, state, fmt), target)
    assert set(checkpoint_state(head)) == set(state)  # no input_layernorm at layer 0, no norm, no lm_head
    torch.testing.assert_close(head.fc.weight, state["fc.weight"], rtol=0, atol=0)
    features = torch.randn(len(TOKENS), 64)
    with torch.no_grad():  # cnets1: fc(cat(embed, feature)); layer 0 without input_layernorm; no final norm
        x = head.fc(torch.cat([target.embed_tokens(TOKENS), features], -1))
        cos, sin = head.rotary_emb(torch.arange(len(TOKENS)), x.dtype)
        layer = head.layers[0]
        x = x + dense_attention(layer.self_attn, x, cos, sin)
        ref = x + layer.mlp(layer.post_attention_layernorm(x))
    torch.testing.assert_close(run_head(head, features), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(head.compute_logits(ref), target.compute_logits(ref))


@pytest.mark.parametrize("fmt", ["bin", "safetensors"])
def test_eagle3_layout_loads_and_computes_cnets(tmp_path, target, fmt):
    hot = torch.tensor(sorted(torch.randperm(320, generator=torch.Generator().manual_seed(0))[:100].tolist()))
    hf = head_hf(target.config, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=100,
                 eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 0, 0]})
    state = eagle3_state(hf, hot=hot, seed=2)
    head = load_eagle3(write_checkpoint(tmp_path, hf, state, fmt), target)
    assert set(checkpoint_state(head)) == set(state) and head.taps == (1, 1, 1)
    assert torch.equal(head.draft_to_target(torch.arange(100)), hot)
    taps = torch.randn(len(TOKENS), 3 * 64)
    with torch.no_grad():  # cnets.py: residual h = fc(taps); attention over cat(input_ln(embed), hidden_norm(h))
        mid = head.midlayer
        h = head.fc(taps)
        x = torch.cat([mid.input_layernorm(target.embed_tokens(TOKENS)), mid.hidden_norm(h)], -1)
        cos, sin = head.rotary_emb(torch.arange(len(TOKENS)), x.dtype)
        h = h + dense_attention(mid.self_attn, x, cos, sin)
        ref = h + mid.mlp(mid.post_attention_layernorm(h))
        logits = head.norm(ref) @ state["lm_head.weight"].T
    torch.testing.assert_close(run_head(head, taps), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(head.compute_logits(ref), logits)


def test_eagle3_same_vocabulary_needs_no_token_maps(tmp_path, target):
    hf = head_hf(target.config, eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 0, 0]})
    state = {k: v for k, v in eagle3_state(hf).items() if k not in ("d2t", "t2d")}
    head = load_eagle3(write_checkpoint(tmp_path, hf, state, "safetensors"), target)
    assert torch.equal(head.draft_to_target(torch.arange(320)), torch.arange(320)) and bool(head.t2d.all())


def test_eagle3_taps_follow_sglang_and_vllm_conventions():
    assert eagle3_taps({}, 32) == (2, 16, 29)  # the hidden states entering layers 2, L // 2, L - 3
    assert eagle3_taps({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 15, 28]}}, 32) == (2, 16, 29)
    assert eagle3_taps({"eagle_aux_hidden_state_layer_ids": [2, 16, 29]}, 32) == (2, 16, 29)
    with pytest.raises(CheckpointError, match="eagle_aux_hidden_state_layer_ids"):
        eagle3_taps({}, 2)  # L - 3 < 0: a tiny target needs explicit taps


@pytest.mark.parametrize("file", ["medusa_lm_head.pt", "medusa_lm_head.safetensors", "pytorch_model.bin",
                                  "model.safetensors"])
def test_medusa_layout_loads_and_computes_resblocks(tmp_path, target, file):
    state = medusa_state(64, 320, num_heads=3, num_layers=2, seed=3)
    fmt = "safetensors" if file.endswith("safetensors") else "bin"
    hf = {"medusa_num_heads": 3, "medusa_num_layers": 2} if "medusa" in file else {}  # else inferred
    heads = load_medusa(write_checkpoint(tmp_path, hf, state, fmt, names=(file, file)), target)
    assert set(heads.state_dict()) == set(state) and (heads.num_heads, heads.num_layers) == (3, 2)
    h = torch.randn(4, 64)
    ref = []
    for i in range(3):  # head i: ResBlock x2 (x + SiLU(Wx + b)), then the vocabulary projection
        x = h
        for j in range(2):
            x = x + torch.nn.functional.silu(x @ state[f"{i}.{j}.linear.weight"].T + state[f"{i}.{j}.linear.bias"])
        ref.append(x @ state[f"{i}.2.weight"].T)
    with torch.no_grad():
        torch.testing.assert_close(heads(h), torch.stack(ref))


def test_shape_mismatch_names_the_tensor_and_both_shapes(tmp_path, target):
    hf = head_hf(target.config)
    state = eagle_state(hf)
    state["layers.0.mlp.up_proj.weight"] = torch.zeros(100, 64)
    with pytest.raises(CheckpointError, match=r"layers\.0\.mlp\.up_proj\.weight has shape \[100, 64\] .* needs \[128, 64\]"):
        load_eagle(write_checkpoint(tmp_path, hf, state, "bin"), target)
    state = medusa_state(64, 320, num_heads=2)
    state["1.1.weight"] = torch.zeros(300, 64)
    with pytest.raises(CheckpointError, match=r"1\.1\.weight has shape \[300, 64\] .* needs \[320, 64\]"):
        load_medusa(write_checkpoint(tmp_path / "m", {}, state, "safetensors"), target)


def test_integer_weights_are_refused(tmp_path, target):  # (EAGLE-3's integer d2t / t2d tables load)
    hf = head_hf(target.config)
    state = eagle_state(hf)
    state["fc.weight"] = state["fc.weight"].long()
    with pytest.raises(CheckpointError, match="fc.weight is int64 in the checkpoint; the head's weights are floating"):
        load_eagle(write_checkpoint(tmp_path, hf, state, "safetensors"), target)


def test_eagle3_token_maps_must_be_integers_and_load_in_their_own_dtype(tmp_path, target):
    """d2t / t2d are token ids: a float d2t (a float16 one cannot hold ids past 2048 exactly) is
    refused naming both dtypes; integers of another width load as the head's int64 / bool."""
    hf = head_hf(target.config, draft_vocab_size=50, eagle_aux_hidden_state_layer_ids=[0, 1, 0])
    state = eagle3_state(hf, hot=torch.arange(50) * 3)
    with pytest.raises(CheckpointError, match="d2t is float32 in the checkpoint but the head needs int64"):
        load_eagle3(write_checkpoint(tmp_path / "f", hf, {**state, "d2t": state["d2t"].float()}, "bin"), target)
    head = load_eagle3(write_checkpoint(tmp_path / "i", hf, {**state, "d2t": state["d2t"].int(),
                                                               "t2d": state["t2d"].to(torch.uint8)}, "bin"), target)
    assert head.d2t.dtype == torch.long and head.t2d.dtype == torch.bool
    assert torch.equal(head.draft_to_target(torch.arange(50)), torch.arange(50) * 3)


@pytest.mark.parametrize("change, message", [
    ({"hidden_size": 32}, "hidden_size is 32 but the target's is 64"),
    ({"vocab_size": 1000}, "vocab_size is 1000 but the target's is 320"),
])
def test_head_for_another_target_is_rejected(tmp_path, target, change, message):
    hf = head_hf(target.config)
    state = eagle_state(head_hf(target.config, **change))
    for i, (load, layout) in enumerate([(load_eagle, hf), (load_eagle3, {**hf, "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": [0, 0, 0]}})]):
        with pytest.raises(CheckpointError, match=message):
            load(write_checkpoint(tmp_path / str(i), {**layout, **change}, state, "bin"), target)


def test_missing_and_unexpected_tensors_are_listed(tmp_path, target):
    hf = head_hf(target.config)
    state = eagle_state(hf, bias=False)  # the config says bias (the default): fc.bias is missing
    state["layers.0.input_layernorm.weight"] = torch.ones(64)  # layer 0 has none in this layout
    with pytest.raises(CheckpointError,
                       match="missing tensors: fc.bias.*unexpected tensors: layers.0.input_layernorm"):
        load_eagle(write_checkpoint(tmp_path, hf, state, "bin"), target)
    assert load_eagle(write_checkpoint(tmp_path / "nobias", {**hf, "bias": False}, eagle_state(hf, bias=False),
                                       "bin"), target).fc.bias is None
    state = {**eagle_state(hf), "layers.0.self_attn.q_proj.bias": torch.zeros(64)}  # (EAGLE heads of Qwen2)
    with pytest.raises(CheckpointError, match='q_proj.bias .*"qkv_bias": true in its config.json'):
        load_eagle(write_checkpoint(tmp_path / "qkv", hf, state, "bin"), target)


def test_save_writes_the_layout_it_loads(tmp_path, target):
    hf = head_hf(target.config)
    eagle = load_eagle(write_checkpoint(tmp_path / "e", hf, eagle_state(hf), "bin"), target)
    save_eagle(eagle, tmp_path / "e2")
    assert set(load_file(tmp_path / "e2" / "model.safetensors")) == set(eagle_state(hf))
    assert json.loads((tmp_path / "e2" / "config.json").read_text())["bias"] is True
    again = load_eagle(tmp_path / "e2", target)
    assert all(torch.equal(a, b) for a, b in zip(eagle.state_dict().values(), again.state_dict().values()))

    hf3 = head_hf(target.config, draft_vocab_size=50, eagle_aux_hidden_state_layer_ids=[0, 1, 0])  # vLLM style
    eagle3 = load_eagle3(write_checkpoint(tmp_path / "3", hf3, eagle3_state(hf3, hot=torch.arange(50) * 3), "bin"),
                         target)
    save_eagle3(eagle3, tmp_path / "32", format="bin")
    saved = torch.load(tmp_path / "32" / "pytorch_model.bin", weights_only=True)
    assert set(saved) == set(eagle3_state(hf3)) and saved["d2t"].dtype == torch.long
    assert load_eagle3(tmp_path / "32", target).taps == (0, 1, 0)  # tap 0 (the embedding) kept as vLLM says it

    medusa = load_medusa(write_checkpoint(tmp_path / "m", {}, medusa_state(64, 320, 2), "bin"), target)
    save_medusa(medusa, tmp_path / "m2")
    assert set(load_file(tmp_path / "m2" / "medusa_lm_head.safetensors")) == set(medusa_state(64, 320, 2))
    assert json.loads((tmp_path / "m2" / "config.json").read_text())["medusa_num_heads"] == 2


def test_medusa_head_in_the_legacy_torch_save_format_loads(tmp_path, target):
    state = medusa_state(64, 320, num_heads=2, seed=4)
    (tmp_path / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 1}))
    torch.save(state, tmp_path / "medusa_lm_head.pt", _use_new_zipfile_serialization=False)
    assert all(torch.equal(a, state[k]) for k, a in load_medusa(tmp_path, target).state_dict().items())
