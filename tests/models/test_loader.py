"""Checkpoint layouts, dtypes, errors that name the problem, and save_model -> transformers."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.testing import assert_close
from transformers import AutoModelForCausalLM

from specflow.models import CheckpointError, LlamaForCausalLM, ModelConfig, load_model, load_tokenizer, save_model
from specflow.models.llama import checkpoint_state
from specflow.models.loader import resolve_dtype
from specflow.runtime.model_runner import ModelRunner

from tests.models.tiny_checkpoints import PROMPTS


def assert_same_weights(model, hf):
    """Every native tensor equals transformers' tensor of the same name (and dtype)."""
    ours, theirs = checkpoint_state(model), hf.state_dict()
    assert set(ours) <= set(theirs)
    for name, tensor in ours.items():
        assert tensor.device.type == "cpu"
        assert_close(tensor, theirs[name], rtol=0, atol=0)
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight is model.embed_tokens.weight


def runner_logits(model, prompts=PROMPTS):
    out = ModelRunner(model, num_pages=64).extend(list(range(len(prompts))), prompts)
    return [out.logits[out.rows(r)] for r in range(len(prompts))]


def hf_logits(hf, prompts=PROMPTS):
    with torch.no_grad():
        return [hf(torch.tensor([p])).logits[0] for p in prompts]


@pytest.mark.parametrize("variant", ["llama", "tied"])
def test_sharded_safetensors(variant, tiny_checkpoint):
    hf, path = tiny_checkpoint(variant, max_shard_size="40KB")
    assert len(list(path.glob("model-*.safetensors"))) > 1
    model = load_model(path)
    assert_same_weights(model, hf)
    assert not model.training


def test_a_single_file_beside_shards_is_read_as_transformers_reads_it(tiny_checkpoint):
    hf, path = tiny_checkpoint("llama", max_shard_size="40KB")
    single = {k: v + 1 for k, v in hf.state_dict().items()}  # (other weights than the shards')
    save_file(single, path / "model.safetensors", metadata={"format": "pt"})
    assert_same_weights(load_model(path), AutoModelForCausalLM.from_pretrained(path))
    assert_close(load_model(path).embed_tokens.weight, single["model.embed_tokens.weight"])


@pytest.mark.parametrize("variant", ["llama", "tied"])
@pytest.mark.parametrize("sharded", [False, True])
def test_pytorch_bin(variant, sharded, tiny_checkpoint):
    """transformers 5 always writes safetensors, so the .bin layouts of older exporters are built here,
    including the rotary inv_freq buffers some of them saved."""
    hf, path = tiny_checkpoint(variant)
    (path / "model.safetensors").unlink()
    state = dict(hf.state_dict())
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    if sharded:
        names = sorted(state)
        shards = {"pytorch_model-00001-of-00002.bin": names[::2],
                  "pytorch_model-00002-of-00002.bin": names[1::2]}
        for file, keys in shards.items():
            torch.save({k: state[k].clone() for k in keys}, path / file)
        weight_map = {k: file for file, keys in shards.items() for k in keys}
        (path / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    else:
        torch.save(state, path / "pytorch_model.bin")
    assert_same_weights(load_model(path), hf)


def test_bfloat16(tiny_checkpoint):
    hf, path = tiny_checkpoint("qwen3")
    hf_bf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    for dtype in (torch.bfloat16, "bfloat16"):
        model = load_model(path, dtype=dtype)
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
        assert_same_weights(model, hf_bf16)
    for ours, ref in zip(runner_logits(model), hf_logits(hf_bf16)):
        assert ours.dtype == torch.bfloat16
        assert_close(ours, ref, rtol=0.05, atol=0.05)
    hf_bf16.save_pretrained(path / "bf16")
    assert next(load_model(path / "bf16", dtype="auto").parameters()).dtype == torch.bfloat16
    assert next(load_model(path, dtype="auto").parameters()).dtype == torch.float32


def test_generation_config_adds_stop_tokens(tiny_checkpoint):
    _, path = tiny_checkpoint("llama")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 9, 11]}))
    assert load_model(path).config.eos_token_ids == [2, 9, 11]


def test_unsupported_dtype_names_the_choices(tiny_checkpoint):
    _, path = tiny_checkpoint("llama")
    with pytest.raises(ValueError, match="float32, bfloat16, float16"):
        load_model(path, dtype="int8")


def rewrite_weights(path, edit):
    state = load_file(path / "model.safetensors")
    edit(state)
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})


def test_wrong_shape_names_tensor_and_both_shapes(tiny_checkpoint):
    _, path = tiny_checkpoint("llama")
    name = "model.layers.1.self_attn.k_proj.weight"
    rewrite_weights(path, lambda s: s.update({name: s[name][:16]}))
    with pytest.raises(CheckpointError) as err:
        load_model(path)
    assert name in str(err.value) and "[16, 64]" in str(err.value) and "[32, 64]" in str(err.value)
    assert "missing" not in str(err.value)


def test_missing_and_unexpected_tensors_are_listed(tiny_checkpoint):
    _, path = tiny_checkpoint("llama")

    def edit(state):
        del state["model.norm.weight"], state["lm_head.weight"]
        state["model.layers.0.mlp.extra.weight"] = torch.zeros(2)

    rewrite_weights(path, edit)
    with pytest.raises(CheckpointError, match="missing tensors: lm_head.weight, model.norm.weight; "
                                              "unexpected tensors: model.layers.0.mlp.extra.weight"):
        load_model(path)


def test_tied_checkpoint_may_omit_or_include_lm_head(tiny_checkpoint):
    hf, path = tiny_checkpoint("tied")
    assert "lm_head.weight" not in load_file(path / "model.safetensors")
    rewrite_weights(path, lambda s: s.update({"lm_head.weight": s["model.embed_tokens.weight"].clone()}))
    assert_same_weights(load_model(path), hf)


def test_tied_checkpoint_with_its_own_lm_head_is_refused(tiny_checkpoint):
    """(transformers would tie it and drop the checkpoint's lm_head without a word)"""
    _, path = tiny_checkpoint("tied")
    rewrite_weights(path, lambda s: s.update({"lm_head.weight": s["model.embed_tokens.weight"] + 1}))
    with pytest.raises(CheckpointError, match="lm_head.weight differs from model.embed_tokens.weight but "
                                              "config.json says tie_word_embeddings: true"):
        load_model(path)


def test_integer_weights_are_refused(tiny_checkpoint):
    _, path = tiny_checkpoint("llama")
    rewrite_weights(path, lambda s: s.update({"model.norm.weight": s["model.norm.weight"].long()}))
    with pytest.raises(CheckpointError, match="model.norm.weight is int64 in the checkpoint; the model's "
                                              "weights are floating point"):
        load_model(path)


@pytest.mark.parametrize("weights", ["model.safetensors", "pytorch_model.bin"])
@pytest.mark.parametrize("damage", ["truncated", "not weights"])
def test_unreadable_files_are_named(tiny_checkpoint, weights, damage):
    hf, path = tiny_checkpoint("llama")
    if weights == "pytorch_model.bin":
        (path / "model.safetensors").unlink()
        torch.save(dict(hf.state_dict()), path / weights)
    file = path / weights
    if damage == "truncated":
        file.write_bytes(file.read_bytes()[:-100])
    else:
        file.write_bytes(b"hello")
    with pytest.raises(CheckpointError, match=f"{file} cannot be read"):
        load_model(path)
    (path / "config.json").write_text("{")
    with pytest.raises(CheckpointError, match="config.json is not valid JSON"):
        load_model(path)


def test_json_files_that_are_not_objects_are_named(tiny_checkpoint):
    """config.json, generation_config.json: a list or a mistyped stop token fails naming the file
    (not an AttributeError, nor a string eos id that never matches a token)."""
    _, path = tiny_checkpoint("llama")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": "2"}))
    with pytest.raises(CheckpointError, match="generation_config.json: eos_token_id must be a token id .* '2'"):
        load_model(path)
    (path / "generation_config.json").write_text("[2]")
    with pytest.raises(CheckpointError, match="generation_config.json must hold a JSON object"):
        load_model(path)
    (path / "config.json").write_text("[]")
    with pytest.raises(CheckpointError, match="config.json must hold a JSON object"):
        load_model(path)


def test_quantized_checkpoint_is_refused_naming_its_method(tiny_checkpoint):
    """(an FP8 checkpoint's weight_scale tensors would be listed as unexpected; without them its
    weights would load as they are, scaled wrong)"""
    _, path = tiny_checkpoint("llama")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(NotImplementedError, match="quantized checkpoints .* quant_method 'fbgemm_fp8'"):
        load_model(path)


def test_tokenizer_config_without_a_vocabulary_is_named(tiny_checkpoint):
    """transformers builds an empty tokenizer from a tokenizer_config.json alone (every text then
    encodes to no tokens): a vocabulary file left behind is named at load time."""
    _, path = tiny_checkpoint("llama")
    assert load_tokenizer(path) is None
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizerFast"}))
    with pytest.raises(CheckpointError, match=r"has no vocabulary \(only 3 special token\(s\)\): .*tokenizer.json"):
        load_tokenizer(path)


def test_unsupported_model_type_names_it_and_the_supported_ones(tiny_checkpoint):
    _, path = tiny_checkpoint("llama")
    config = json.loads((path / "config.json").read_text())
    config.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="'gpt2'.*llama, mistral, qwen2, qwen3"):
        load_model(path)


def test_directory_without_config_or_weights(tiny_checkpoint, tmp_path):
    with pytest.raises(CheckpointError, match="nowhere does not exist"):
        load_model(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match="no config.json"):
        load_model(tmp_path)
    _, path = tiny_checkpoint("llama")
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_model(path)


@pytest.mark.parametrize("variant", ["llama3_rope", "tied", "llama_bias", "mistral", "qwen2", "qwen3"])
def test_save_model_loads_in_transformers(variant, tiny_checkpoint, tmp_path):
    hf, path = tiny_checkpoint(variant)
    model = load_model(path)
    save_model(model, tmp_path / "saved")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved").eval()
    assert type(reloaded) is type(hf)
    for ours, ref in zip(hf_logits(reloaded), hf_logits(hf)):
        assert_close(ours, ref, rtol=0, atol=0)
    assert load_model(tmp_path / "saved").config == model.config


def test_save_model_of_a_freshly_built_model(tmp_path):
    """The training path: a model built from a ModelConfig, saved, then run by transformers."""
    cfg = ModelConfig(arch="llama", vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, eos_token_ids=[2, 3], bos_token_id=1)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    save_model(model, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert hf.config.eos_token_id == [2, 3]
    for ours, ref in zip(runner_logits(model), hf_logits(hf)):
        assert_close(ours, ref)


def test_legacy_torch_save_format_loads(tiny_checkpoint):
    """A pytorch_model.bin in torch.save's pre-1.6 (non-zip) format, which torch.load and transformers
    read, loads too (it cannot be memory-mapped)."""
    hf, path = tiny_checkpoint("llama")
    (path / "model.safetensors").unlink()
    torch.save(dict(hf.state_dict()), path / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    assert_same_weights(load_model(path), hf)


def test_bin_cut_short_in_its_last_64k_is_named(tiny_checkpoint):
    hf, path = tiny_checkpoint("llama")
    (path / "model.safetensors").unlink()
    torch.save(dict(hf.state_dict()), path / "pytorch_model.bin")
    data = (path / "pytorch_model.bin").read_bytes()
    (path / "pytorch_model.bin").write_bytes(data[:5000])  # torch's zip reader: OSError EINVAL
    with pytest.raises(CheckpointError, match="pytorch_model.bin cannot be read"):
        load_model(path)


def test_index_without_weight_map_and_unsupported_auto_dtype_are_named(tiny_checkpoint):
    _, path = tiny_checkpoint("llama", max_shard_size="20KB")
    (path / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(CheckpointError, match="no weight_map"):
        load_model(path)
    with pytest.raises(ValueError, match="config.json's dtype 'float64'"):
        resolve_dtype("auto", {"torch_dtype": "float64"})
