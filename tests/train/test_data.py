"""Training data: a deterministic corpus split with provenance, and next-token windows."""

import shutil

import torch

from specflow.request import RequestOutput
from specflow.train.data import ChunkDataset, DataConfig, generate_continuations, load_corpus, sample_text


def test_corpus_split_is_deterministic_and_disjoint():
    corpus = load_corpus(DataConfig(held_out_every=20))
    again = load_corpus(DataConfig(held_out_every=20))
    assert corpus.train_files == again.train_files and corpus.held_out_files == again.held_out_files
    assert not set(corpus.train_files) & set(corpus.held_out_files)
    files = sorted(corpus.train_files + corpus.held_out_files)
    assert corpus.held_out_files == files[19::20]
    manifest = corpus.manifest()
    assert manifest["licence"].endswith("LICENSE.txt")
    assert [r["path"] for r in manifest["held_out"]] == [f.name for f in corpus.held_out_files]
    assert all(len(r["sha256"]) == 16 for r in manifest["train"])


def test_chunks_are_consecutive_windows_with_their_next_token():
    data = ChunkDataset(torch.arange(10), seq_len=3)
    assert len(data) == 3
    assert [data[i].tolist() for i in range(3)] == [[0, 1, 2, 3], [3, 4, 5, 6], [6, 7, 8, 9]]


def test_a_continuation_ends_with_one_eos():
    """A continuation the target ended itself keeps its EOS in its token ids: no second one, an
    "EOS EOS" the target never writes; one cut by the length limit gets one appended."""
    stopped = RequestOutput(0, [5, 6], [7, 2], None, "stop", [1, 1])
    cut = RequestOutput(1, [5, 6], [7, 8, 9], None, "length", [1, 1, 1])
    assert sample_text([5, 6], stopped, eos=2) == [5, 6, 7, 2]
    assert sample_text([5, 6], cut, eos=2) == [5, 6, 7, 8, 9, 2]


def test_sampled_continuations_of_one_window_differ(tiny_target):
    """Every continuation was sampled with the same seed: requests of one seed share their
    uniforms, so windows alike (here all of them) got the very same continuation, and any two
    windows got correlated ones."""
    from specflow.models import load_tokenizer

    cfg = DataConfig(generated_tokens=6 * 11, generate_prompt_len=2, generate_len=8, generate_temperature=1.0,
                     generate_batch_size=4)
    out = generate_continuations(tiny_target, torch.full((40,), 7), cfg, seed=0, device="cpu").tolist()
    eos = load_tokenizer(tiny_target).eos_token_id
    samples, sample = [], []
    for t in out:   # each sample: the window, its continuation, one EOS (the stream's last may be cut)
        sample.append(t)
        if t == eos:
            samples.append(tuple(sample))
            sample = []
    assert len(samples) >= 4 and len(set(samples)) > 1, samples


def test_continuations_are_kept_for_a_resumed_run_and_made_anew_when_what_they_depend_on_changes(
        tiny_target, tmp_path, monkeypatch):
    """(a resumed EAGLE-3 run generated its data again: hours for a real target, and on a GPU
    not bit for bit the tokens the interrupted run trained on)"""
    from specflow.train import data

    tiny_target = shutil.copytree(tiny_target, tmp_path / "target")   # (its files' times change below)
    made = []
    generate = data.generate_continuations
    monkeypatch.setattr(data, "generate_continuations",
                        lambda *a, **kw: made.append(a[3]) or generate(*a, device="cpu", **kw))
    cfg = DataConfig(generated_tokens=40, generate_prompt_len=2, generate_len=8, generate_temperature=1.0)
    tokens, cache = torch.arange(3, 60), tmp_path / "generated"
    first, info = data.cached_continuations(tiny_target, tokens, cfg, 0, cache)
    again, info_again = data.cached_continuations(tiny_target, tokens, cfg, 0, cache)
    assert made == [0] and torch.equal(first, again) and len(first) == 40
    assert info["generated_cache"] == info_again["generated_cache"] and "generate_s" not in info_again
    data.cached_continuations(tiny_target, tokens, cfg, 1, cache)             # another seed
    data.cached_continuations(tiny_target, tokens[1:], cfg, 0, cache)         # another corpus
    data.cached_continuations(tiny_target, tokens, DataConfig(generated_tokens=40, generate_prompt_len=2,
                                                              generate_len=9, generate_temperature=1.0), 0, cache)
    data.cached_continuations(tiny_target, tokens, cfg, 0, cache, torch.bfloat16)  # (trainer.precision bf16-*)
    (tiny_target / "config.json").touch()                                     # the target changed (its files)
    data.cached_continuations(tiny_target, tokens, cfg, 0, cache)
    assert made == [0, 1, 0, 0, 0, 0] and len(list(cache.glob("*.pt"))) == 6 and not list(cache.glob("*.part"))
    data.cached_continuations(tiny_target, tokens, cfg, 0, None)              # no cache: made, nothing kept
    assert len(made) == 7 and len(list(cache.iterdir())) == 6
