"""Training data: a deterministic corpus split with provenance, and next-token windows."""

import torch

from specflow.request import RequestOutput
from specflow.train.data import ChunkDataset, DataConfig, load_corpus, sample_text


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
