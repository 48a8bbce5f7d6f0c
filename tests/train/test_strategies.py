"""Scaling out is configuration only: the same recipe under Lightning's DDP strategy (two CPU
processes here; GPUs and nodes by ``trainer.devices`` / ``trainer.num_nodes``)."""

import subprocess
import sys

import pytest
import yaml

from specflow.models import load_model


@pytest.mark.slow
def test_ddp_on_two_cpu_processes_needs_no_code_change(tmp_path, tiny_target):
    config = tmp_path / "lm.yaml"
    config.write_text(yaml.safe_dump({
        "name": "ddp", "output_dir": str(tmp_path / "out"), "log_dir": str(tmp_path / "log"),
        "recipe": {"type": "lm", "tokenizer": str(tiny_target),
                   "model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2}},
        "data": {"max_files": 2, "seq_len": 64, "val_sequences": 4},
        "optim": {"batch_size": 4, "warmup_steps": 2},
        "trainer": {"max_steps": 6, "log_every_n_steps": 2, "enable_progress_bar": False}}))
    cmd = [sys.executable, "-m", "specflow.cli", "train", str(config),
           "trainer.accelerator=cpu", "trainer.devices=2", "trainer.strategy=ddp", "trainer.num_threads=1"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "tokens_seen: 3072" in done.stdout    # 6 steps x 2 processes x 4 sequences x 64 tokens
    assert load_model(tmp_path / "out").config.hidden_size == 32
    assert (tmp_path / "log" / "loss.png").is_file()
