"""ModelConfig reads transformers 4 and 5 config dicts alike and writes what transformers reads back."""

import pytest
from transformers import CONFIG_MAPPING

from specflow.models import CheckpointError, ModelConfig

from tests.models.tiny_checkpoints import VARIANTS

LLAMA = dict(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
LLAMA3_SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_round_trip_through_transformers_configs(variant):
    cfg = ModelConfig.from_hf(VARIANTS[variant]().to_dict())
    hf = CONFIG_MAPPING[cfg.arch](**cfg.to_hf())
    assert ModelConfig.from_hf(hf.to_dict()) == cfg


def test_transformers_4_and_5_rope_forms_agree():
    v4 = ModelConfig.from_hf({**LLAMA, "rope_theta": 5e5,
                              "rope_scaling": {"type": "llama3", **LLAMA3_SCALING}})
    v5 = ModelConfig.from_hf({**LLAMA, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5,
                                                           **LLAMA3_SCALING}})
    assert v4 == v5
    assert v5.rope_theta == 5e5 and v5.rope_scaling == {"rope_type": "llama3", **LLAMA3_SCALING}
    plain = ModelConfig.from_hf({**LLAMA, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})
    assert (plain.rope_theta, plain.rope_scaling) == (1e6, None)


def test_rope_scaling_added_to_a_transformers_5_config_wins_as_in_transformers():
    # save_pretrained (5.x) writes rope_parameters; model cards tell users to add rope_scaling
    v5 = {**LLAMA, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}
    cfg = ModelConfig.from_hf({**v5, "rope_scaling": {"rope_type": "linear", "factor": 4.0}})
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    with pytest.raises(NotImplementedError, match="'yarn'"):
        ModelConfig.from_hf({**v5, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    assert ModelConfig.from_hf({**v5, "rope_scaling": None}).rope_scaling is None


def test_llama3_original_context_defaults_to_max_positions():
    scaling = {k: v for k, v in LLAMA3_SCALING.items() if k != "original_max_position_embeddings"}
    cfg = ModelConfig.from_hf({**LLAMA, "rope_scaling": {"rope_type": "llama3", **scaling}})
    assert cfg.rope_scaling["original_max_position_embeddings"] == 256


@pytest.mark.parametrize("rope_type", ["yarn", "dynamic", "longrope"])
def test_unimplemented_rope_types_are_named(rope_type):
    with pytest.raises(NotImplementedError, match=f"'{rope_type}'.*default, linear, llama3"):
        ModelConfig.from_hf({**LLAMA, "rope_scaling": {"rope_type": rope_type, "factor": 2.0}})


def test_rope_scaling_without_its_parameters():
    with pytest.raises(ValueError, match="lacks factor"):
        ModelConfig(arch="llama", vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                    num_attention_heads=2, rope_scaling={"rope_type": "linear"})


def test_qwen2_sliding_layers_are_refused_and_unused_windows_dropped():
    qwen2 = {**LLAMA, "model_type": "qwen2", "sliding_window": 4096}
    with pytest.raises(NotImplementedError, match="use_sliding_window"):
        ModelConfig.from_hf({**qwen2, "use_sliding_window": True, "max_window_layers": 2})
    for extra in ({"use_sliding_window": False}, {"use_sliding_window": True, "max_window_layers": 4}):
        cfg = ModelConfig.from_hf({**qwen2, **extra})
        assert cfg.sliding_window is None and cfg.qkv_bias and not cfg.attention_bias


def test_architecture_flags():
    mistral = ModelConfig.from_hf({**LLAMA, "model_type": "mistral"})
    assert mistral.sliding_window == 4096  # transformers' MistralConfig default when the key is absent
    no_window = ModelConfig.from_hf({**LLAMA, "model_type": "mistral", "sliding_window": None})
    assert no_window.sliding_window is None
    qwen3 = ModelConfig.from_hf({**LLAMA, "model_type": "qwen3", "head_dim": 32})
    assert qwen3.qk_norm and qwen3.head_dim == 32 and not qwen3.qkv_bias
    llama = ModelConfig.from_hf({**LLAMA, "attention_bias": True, "mlp_bias": True,
                                 "num_key_value_heads": None})
    assert (llama.attention_bias, llama.mlp_bias, llama.qkv_bias) == (True, True, True)
    assert llama.num_key_value_heads == 4


def test_arch_from_architectures_and_token_ids():
    hf = {k: v for k, v in LLAMA.items() if k != "model_type"}
    cfg = ModelConfig.from_hf({**hf, "architectures": ["Qwen2ForCausalLM"], "eos_token_id": [7, 9],
                               "bos_token_id": 3})
    assert (cfg.arch, cfg.eos_token_ids, cfg.bos_token_id) == ("qwen2", [7, 9], 3)
    assert ModelConfig.from_hf({**LLAMA, "eos_token_id": 5}).eos_token_ids == [5]
    assert ModelConfig.from_hf({**LLAMA, "eos_token_id": None}).eos_token_ids == []


def test_bad_configs_name_the_problem():
    with pytest.raises(CheckpointError, match="'gpt_neox'.*llama, mistral, qwen2, qwen3"):
        ModelConfig.from_hf({**LLAMA, "model_type": "gpt_neox"})
    with pytest.raises(CheckpointError, match="lacks intermediate_size"):
        ModelConfig.from_hf({k: v for k, v in LLAMA.items() if k != "intermediate_size"})
    with pytest.raises(NotImplementedError, match="'gelu'"):
        ModelConfig.from_hf({**LLAMA, "hidden_act": "gelu"})
    with pytest.raises(CheckpointError, match="multiple of num_key_value_heads"):
        ModelConfig.from_hf({**LLAMA, "num_key_value_heads": 3})


@pytest.mark.parametrize("change, message", [
    ({"hidden_size": "64"}, "hidden_size must be a positive integer, got '64'"),
    ({"num_hidden_layers": 2.0}, "num_hidden_layers must be a positive integer, got 2.0"),
    ({"vocab_size": 0}, "vocab_size must be a positive integer, got 0"),
    ({"rms_norm_eps": "1e-5"}, "rms_norm_eps must be a positive number, got '1e-5'"),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false, got 'false'"),
    ({"eos_token_id": [2, "3"]}, r"eos_token_id must be a token id or a list of them, got \[2, '3'\]"),
])
def test_values_of_the_wrong_type_name_the_key(change, message):
    with pytest.raises(CheckpointError, match=f"config.json: {message}"):
        ModelConfig.from_hf({**LLAMA, **change})
