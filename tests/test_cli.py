"""The command line: `specflow list` and `specflow make-model`."""

from specflow.cli import main
from specflow.models import load_model


def test_list_prints_components_with_parameters(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "== drafters ==" in out and "== trees ==" in out and "== verifiers ==" in out
    assert "eagle2       topk=8, depth=5, num_draft_tokens=32" in out
    assert "threshold    threshold_single=1.0, threshold_acc=1.0  [lossless at threshold_single = threshold_acc = 1.0" in out
    assert "greedy       [lossless]" in out and "typical      epsilon=0.09, delta=0.3  [lossy]" in out
    assert "expand(frontier) -> Expansion" in out  # the registry's contract


def test_make_model_writes_a_loadable_checkpoint(tmp_path):
    out = tmp_path / "m"
    assert main(["make-model", str(out), "--hidden-size", "32", "--num-layers", "1", "--vocab-size", "300"]) == 0
    model = load_model(out)
    assert model.config.vocab_size == 300 and (out / "tokenizer.json").exists()


def test_make_model_refuses_a_directory_that_is_not_empty(tmp_path, capsys):
    out = tmp_path / "checkpoint"
    out.mkdir()
    (out / "config.json").write_text("{}")
    args = ["make-model", str(out), "--hidden-size", "32", "--num-layers", "1", "--vocab-size", "300"]
    assert main(args) == 2
    assert "--force" in capsys.readouterr().err and (out / "config.json").read_text() == "{}"
    assert main(args + ["--force"]) == 0
    assert load_model(out).config.vocab_size == 300


def test_run_sets_the_torch_threads_it_is_given(tmp_path, capsys):
    import torch

    before = torch.get_num_threads()
    try:
        assert main(["run", "missing.yaml", "--threads", "0"]) == 2
        assert "--threads must be >= 1" in capsys.readouterr().err
        main(["run", str(tmp_path / "missing.yaml"), "--threads", "1"])
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_bench_refuses_threads_below_one_as_run_does(capsys):
    """`bench --threads 0` ran with torch's default threads (its check was `if threads:`), while
    `run` and `sweep` refuse it."""
    assert main(["bench", "missing-checkpoint", "--threads", "0"]) == 2
    assert "--threads must be >= 1" in capsys.readouterr().err
