"""`specflow bench`: plain decoding against transformers generate, timed over the same work."""

import json

import torch

from specflow import SpecEngine
from specflow.bench.provenance import device_name
from specflow.cli import main


def test_the_decode_bench_times_specflow_and_transformers_generating_the_same_tokens(tiny_target, tmp_path, capsys):
    out = tmp_path / "decode.json"
    main(["bench", str(tiny_target), "--batch-sizes", "1", "3", "--max-tokens", "6", "--prompt-len", "5",
          "--repeats", "1", "--out", str(out)])
    result = json.loads(out.read_text())
    assert [r["batch_size"] for r in result["rows"]] == [1, 3]
    assert (result["max_tokens"], result["prompt_len"]) == (6, 5)
    # where the numbers come from (the committed results had no commit, torch or CPU)
    assert result["device_name"] == device_name(torch.device("cpu")) and result["torch_version"] == torch.__version__
    assert {"git_commit", "git_dirty"} <= result.keys()
    for row in result["rows"]:
        assert row["same_tokens"] is True
        assert abs(row["ratio"] - row["specflow_tok_s"] / row["transformers_tok_s"]) < 1e-9 * row["ratio"]
    assert "same tokens" in capsys.readouterr().out


def test_the_decode_bench_says_when_the_two_generated_different_tokens(tiny_target, tmp_path, monkeypatch):
    """same_tokens compares the two outputs: a specflow that generated other tokens is reported."""
    generate = SpecEngine.generate

    def off_by_one(self, prompts, params):
        outs = generate(self, prompts, params)
        for o in outs:
            o.token_ids = [t + 1 for t in o.token_ids]
        return outs

    monkeypatch.setattr(SpecEngine, "generate", off_by_one)
    out = tmp_path / "decode.json"
    main(["bench", str(tiny_target), "--batch-sizes", "1", "--max-tokens", "4", "--prompt-len", "5",
          "--repeats", "1", "--out", str(out)])
    assert [r["same_tokens"] for r in json.loads(out.read_text())["rows"]] == [False]
