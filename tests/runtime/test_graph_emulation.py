"""The CUDA-graph paths with capture emulated on a CPU (tests/runtime/graph_emulator.py): every
graph (GraphRunner's forwards, EAGLE-2 beams, RowGraphs) replays a recorded op list, with host
state frozen at capture as on a GPU, and must give the eager engine's output; no captured region
may sync with the host or draw random numbers."""

import pytest
import torch

from specflow.engine import SpecEngine
from specflow.models import load_model
from specflow.runtime.model_runner import ModelRunner
from specflow.sampling import SamplingParams
from tests.runtime import graph_emulator
from tests.runtime.graph_emulator import CaptureError, EmulatedGraph, record
from tests.runtime.test_cuda_graph import NODES, run_steps

ZOO = "zoo/tiny-code"


@pytest.fixture
def emulated(monkeypatch):
    graph_emulator.install(monkeypatch)
    graph_emulator.graphs.clear()
    return graph_emulator.graphs


def test_the_emulator_freezes_host_state_and_refuses_syncs():
    x, state = torch.zeros(3), {"scale": 2.0}
    graph, out = record(lambda: x * state["scale"], None)
    x.copy_(torch.tensor([1.0, 2.0, 3.0]))
    state["scale"] = 10.0  # host state read at capture: frozen
    graph.replay()
    assert out.tolist() == [2.0, 4.0, 6.0]
    with pytest.raises(CaptureError, match="waits for the device"):
        record(lambda: x * float(x.sum()), None)
    with pytest.raises(CaptureError, match="random"):
        record(lambda: x + torch.rand(3), None)
    with pytest.raises(CaptureError, match="boolean index"):
        record(lambda: x[x > 1], None)


@pytest.mark.parametrize("page_size", [1, 16])
def test_graph_runner_replays_equal_plain(emulated, tiny_target, page_size):
    model = load_model(tiny_target)
    plain = ModelRunner(model, num_pages=2048 // page_size, page_size=page_size)
    graphed = ModelRunner(model, num_pages=2048 // page_size, page_size=page_size)
    graphed.enable_graphs(max_batch_size=8, max_tokens_per_request=NODES)
    for seed in range(3):
        run_steps(plain, graphed, seed, steps=8)
    assert all(isinstance(g.graph, EmulatedGraph) for g in graphed.graphs.graphs.values())
    assert any(g.replays > 1 for g in emulated), "no graph was replayed for a later batch"


@pytest.mark.parametrize("drafter", ["draft", "eagle", "eagle3", "medusa", "ngram"])
def test_engine_through_emulated_graphs_matches_eager(emulated, drafter):
    node = {"draft": {"type": "draft_model", "path": f"{ZOO}/draft"},
            "eagle": {"type": "eagle", "path": f"{ZOO}/eagle"},
            "eagle3": {"type": "eagle3", "path": f"{ZOO}/eagle3"},
            "medusa": {"type": "medusa", "path": f"{ZOO}/medusa"},
            "ngram": {"type": "ngram"}}[drafter]
    tree = {"type": "eagle2", "topk": 4, "depth": 3, "num_draft_tokens": 8}
    prompts = ["def main(", "import os\nimport sys\n", "class Tree:\n    def __init__(self",
               "for i in range(10):\n    print(i)\n" * 8]  # 112 tokens: a graph outgrown at 128
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (20, 12, 6, 24)]
    engines = [SpecEngine(f"{ZOO}/target", node, tree, {"type": "greedy"}, device="cpu", dtype="float32",
                          cuda_graphs=graphs) for graphs in (False, True)]
    outs = [engine.generate(prompts, params) for engine in engines]
    assert [o.token_ids for o in outs[1]] == [o.token_ids for o in outs[0]]
    assert any(g.replays > 1 for g in emulated)


def test_plain_decoding_through_emulated_graphs_matches_eager(emulated):
    prompts = ["def main(", "import os\nimport sys\n", "class Tree:\n    def __init__(self"]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (20, 12, 6)]
    engines = [SpecEngine(f"{ZOO}/target", device="cpu", dtype="float32", cuda_graphs=graphs)
               for graphs in (False, True)]
    outs = [engine.generate(prompts, params) for engine in engines]
    assert [o.token_ids for o in outs[1]] == [o.token_ids for o in outs[0]]
