"""Training data: a deterministic corpus split with provenance, and next-token windows."""

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
