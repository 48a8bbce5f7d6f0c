"""Training data: a deterministic corpus split with provenance, and next-token windows."""

import torch

from specflow.train.data import ChunkDataset, DataConfig, load_corpus


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
