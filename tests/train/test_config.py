"""``specflow train`` configs: every shipped one validates; mistakes fail naming the fix."""

import shutil
from pathlib import Path

import pytest

from specflow.cli import main
from specflow.config import ConfigError, validate
from specflow.models.random import make_random_checkpoint
from specflow.train import RECIPES, TrainConfig, load_train_config, train
from tests.train.runs import tiny_config

CONFIGS = sorted(Path(__file__).resolve().parents[2].glob("configs/train/*.yaml"))
ZOO_TARGET = Path(__file__).resolve().parents[2] / "zoo" / "tiny-code" / "target"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_shipped_train_configs_validate(path):
    cfg = load_train_config(path)
    assert cfg.recipe["type"] in RECIPES


def test_all_recipes_are_registered():
    assert RECIPES.names() == ["distill", "eagle", "eagle3", "lm", "medusa"]


@pytest.mark.parametrize("override, named", [
    ("trainr.max_steps=3", "valid keys: name, output_dir, target"),
    ("trainer.max_step=3", "valid keys: accelerator, devices, strategy"),
    ("optim.learning_rate=1", "valid keys: lr, min_lr_ratio"),
    ("recipe.unrol=3", "valid keys: draft_vocab_size, taps, unroll"),
    ("recipe.type=eagle4", "known: distill, eagle, eagle3, lm, medusa"),
])
def test_misspelt_keys_name_the_valid_ones(override, named):
    with pytest.raises(ConfigError, match=named):
        load_train_config(CONFIGS[0].parent / "eagle3.yaml", [override])


@pytest.mark.parametrize("config, override, named", [
    ("eagle", "recipe.save_dtype=fp16", "train.recipe.save_dtype: dtype 'fp16' is not supported"),  # (read after
    ("eagle", "target=no/such/target", "train.target: no/such/target is not a checkpoint directory"),  # training)
    ("medusa", "recipe.num_heads=0", r"train.recipe \(recipe 'medusa'\): num_heads must be >= 1, got 0"),
    ("eagle3", "recipe.draft_vocab_size=0", "draft_vocab_size must be >= 1, got 0"),
    ("eagle", "recipe.num_layers=0", "num_layers must be >= 1, got 0"),
    ("target", "recipe.model.num_heads=0", "num_heads must be >= 1, got 0"),
    ("eagle", "optim.batch_size=0", "train.optim: batch_size must be >= 1, got 0"),
    ("eagle", "data.seq_len=1", "train.data: seq_len must be >= 2, got 1"),
    ("eagle", "trainer.checkpoint_every_n_steps=0", "train.trainer: checkpoint_every_n_steps must be >= 1, got 0"),
    # (these failed only once training ran: an IndexError inside AdamW, a bare torch error, a silent
    # negative loss weight; draft_vocab_size and unroll after the target, the corpus and generation)
    ("eagle", "optim.betas=[0.9]", r"train.optim: betas must be two numbers in \[0, 1\)"),
    ("eagle", "optim.lr=-1", "train.optim: lr must be > 0, got -1"),
    ("eagle3", "recipe.decay=-1", "decay must be > 0"),
    ("medusa", "recipe.decay=0", "decay must be > 0"),
    ("eagle", "recipe.logit_weight=-1", r"feature_weight and logit_weight must be >= 0, one of them > 0"),
    ("eagle", ["recipe.feature_weight=0", "recipe.logit_weight=0"], r"one of them > 0 .*got 0.0 and 0.0"),
    ("eagle", "recipe.noise=-1", r"train.recipe \(recipe 'eagle'\): noise must be >= 0"),
    ("draft", "recipe.alpha=1.5", r"alpha must be in \[0, 1\]"),
    ("eagle3", "recipe.draft_vocab_size=100000", r"train.recipe.draft_vocab_size: 100000 is more than the "
                                                 r"target's vocabulary \(2048 tokens\); use 1..2048"),
    ("eagle3", "recipe.unroll=256", r"train.recipe.unroll: .*below data.seq_len \(256\)"),
    ("medusa", "data.seq_len=4", r"train.recipe.num_heads: .*below data.seq_len"),   # (a NaN loss)
    ("eagle3", "recipe.taps=[1,2,7]", r"train.recipe.taps: \[1, 2, 7\]: a 4-layer target has layer inputs 0..3"),
    ("eagle3", "recipe.taps=[]", r"train.recipe.taps: \[\]: give one or more distinct layer inputs \(0..3\)"),
    ("eagle3", "recipe.taps=[1,1]", r"train.recipe.taps: \[1, 1\]: give one or more distinct"),
    ("eagle", "trainer.val_check_interval=0", "train.trainer: val_check_interval must be >= 1, got 0"),
    ("eagle", "trainer.accumulate_grad_batches=0", "train.trainer: accumulate_grad_batches must be >= 1, got 0"),
    ("eagle", "trainer.max_steps=0", "train.trainer: max_steps must be >= 1, got 0"),
    ("medusa", "recipe.save_format=pt", "train.recipe.save_format: 'pt' is not one of safetensors, bin"),
    ("eagle", "data.source=no/such/dir", "train.data: source 'no/such/dir' is not a directory"),
])
def test_bad_values_fail_when_the_config_loads(config, override, named):
    with pytest.raises(ConfigError, match=named):
        load_train_config(CONFIGS[0].parent / f"{config}.yaml", override if isinstance(override, list) else [override])


@pytest.mark.parametrize("override, named", [
    ({"precision": "17-bits"}, "train.trainer: Precision '17-bits' is invalid"),
    ({"accelerator": "abacus"}, "train.trainer: .*abacus"),
])
def test_lightning_settings_fail_before_the_recipe_setup(override, named, tmp_path):
    """(the eagle recipe's setup would fail for want of a target: the trainer's error comes first)"""
    cfg = validate(TrainConfig, {"output_dir": str(tmp_path), "recipe": {"type": "eagle"}, "trainer": override},
                   "train")
    with pytest.raises(ConfigError, match=named):
        train(cfg)


def test_data_that_fills_no_batch_fails_before_training(tmp_path):
    """(Lightning would only warn, and the untrained head be exported as the result)"""
    cfg = tiny_config(tmp_path, {"type": "medusa"}, target=ZOO_TARGET, data={"max_tokens": 300})  # 4 sequences
    with pytest.raises(ConfigError, match="train: 4 training sequences fill no batch of optim.batch_size=8"):
        train(cfg)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("recipe", ["distill", "eagle", "eagle3", "medusa"])
def test_recipes_that_read_a_target_say_so(recipe, tmp_path):
    cfg = validate(TrainConfig, {"output_dir": str(tmp_path), "recipe": {"type": recipe}}, "train")
    with pytest.raises(ConfigError, match=f"recipe '{recipe}' needs 'target'"):
        train(cfg)


def test_cli_reports_config_errors(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("output_dir: x\nrecipe: {type: medusa, heads: 3}\n")
    assert main(["train", str(bad)]) == 2
    assert "unknown key 'heads'; valid keys: num_heads" in capsys.readouterr().err


def test_gradients_can_be_clipped_by_value_as_eagle_does(tmp_path, tiny_target):
    """SafeAILab's EAGLE-1 recipe clips every gradient element to 0.5 (clip_grad_value_), not the
    global norm: the algorithm is a setting, and a bad one fails before the recipe's setup."""
    cfg = load_train_config(CONFIGS[0].parent / "eagle.yaml",
                            ["trainer.gradient_clip_algorithm=value", "trainer.gradient_clip_val=0.5"])
    assert (cfg.trainer.gradient_clip_algorithm, cfg.trainer.gradient_clip_val) == ("value", 0.5)
    shape = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64}
    run = tiny_config(tmp_path, {"type": "lm", "tokenizer": str(tiny_target), "model": shape}, steps=2,
                      trainer_extra={"gradient_clip_algorithm": "value", "gradient_clip_val": 0.5})
    assert train(run).module.trainer.gradient_clip_algorithm == "value"
    with pytest.raises(ConfigError, match="gradient_clip_algorithm 'elementwise' is not one of norm, value"):
        validate(TrainConfig, {"output_dir": str(tmp_path), "recipe": {"type": "eagle"},
                               "trainer": {"gradient_clip_algorithm": "elementwise"}}, "train")


def test_generation_prompts_longer_than_the_corpus_fail_naming_the_key(tmp_path, tiny_target):
    cfg = tiny_config(tmp_path, {"type": "eagle3", "taps": [1]}, target=tiny_target, steps=2,
                      data={"generated_tokens": 100, "generate_prompt_len": 10**7})
    with pytest.raises(ConfigError, match=r"train.data.generate_prompt_len: 10000000, but the corpus holds \d+ tokens"):
        train(cfg)


def test_resuming_another_recipe_s_checkpoint_fails_before_training(tmp_path, tiny_target):
    """(Lightning failed inside fit with a state-dict traceback, after the whole setup)"""
    eagle = tiny_config(tmp_path / "eagle", {"type": "eagle"}, target=tiny_target, steps=2,
                        trainer_extra={"checkpoint_every_n_steps": 1})
    train(eagle)
    ckpt = tmp_path / "eagle" / "log" / "checkpoints" / "last.ckpt"
    medusa = tiny_config(tmp_path / "medusa", {"type": "medusa", "num_heads": 2}, target=tiny_target, steps=2,
                         trainer_extra={"resume": str(ckpt)})
    with pytest.raises(ConfigError, match=r"train.trainer.resume: .*last.ckpt holds another model's weights"):
        train(medusa)
    wider = tiny_config(tmp_path / "wider", {"type": "eagle", "num_layers": 2}, target=tiny_target, steps=2,
                        trainer_extra={"resume": str(ckpt)})
    with pytest.raises(ConfigError, match=r"holds another model's weights|tensor .* has shape"):
        train(wider)


@pytest.mark.parametrize("recipe", ["distill", "eagle", "medusa"])
def test_a_target_whose_tokenizer_does_not_fit_fails_naming_it(recipe, tmp_path, tiny_target):
    """A target without tokenizer files failed with transformers' "Couldn't instantiate the backend
    tokenizer"; one whose tokenizer gives ids past its vocab_size, with an IndexError mid-training."""
    bare = make_random_checkpoint(tmp_path / "bare", hidden_size=32, num_layers=1, num_heads=2,
                                  vocab_size=200, tokenizer=False)
    cfg = tiny_config(tmp_path / "a", {"type": recipe}, target=bare, steps=2)
    with pytest.raises(ConfigError, match=r"train.target: .*bare has no tokenizer \(tokenizer.json"):
        train(cfg)
    for name in ("tokenizer.json", "tokenizer_config.json"):   # (a 320-token vocabulary)
        shutil.copy(tiny_target / name, bare / name)
    cfg = tiny_config(tmp_path / "b", {"type": recipe}, target=bare, steps=2)
    with pytest.raises(ConfigError, match=r"tokenizer of .*bare gives token id 3\d\d, but its config.json's "
                                          r"vocab_size is 200"):
        train(cfg)
    assert not (tmp_path / "b" / "out").exists()
