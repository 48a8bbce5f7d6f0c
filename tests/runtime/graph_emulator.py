"""A CPU stand-in for CUDA-graph capture, so the CPU suite can check what a captured graph
freezes, not only the padded static path that ``capture=False`` re-runs in Python.

``record(run, pool)`` (drop-in for ``specflow.runtime.cuda_graph.record``) runs a warm-up, then
runs ``run()`` once under a TorchDispatchMode that records every aten op with the very tensors it
read and wrote. ``replay()`` re-executes that op list, writing each op's results into the tensors
recorded at capture: Python control flow, host-side state, tensor identities and shapes are
frozen at capture exactly as a CUDA graph freezes them, and only the contents of the tensors
flow. Ops a CUDA capture refuses (host syncs: ``.item()``, ``bool(t)``, ``nonzero``, boolean
indexing, ``torch.tensor(host data)``) or that would replay the same numbers every time (RNG)
raise ``CaptureError``.

What it cannot see on a CPU: host (numpy-backed) tensors mixed into device ops, and memory
reuse between graphs sharing a pool.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

aten = torch.ops.aten


class CaptureError(RuntimeError):
    """Something a CUDA graph capture would refuse, or replay wrongly."""


# ops that wait for the device (CUDA raises "operation not permitted when stream is capturing")
SYNC = {"_local_scalar_dense", "nonzero", "nonzero_static", "masked_select", "unique_dim",
        "_unique2", "unique_consecutive", "equal", "is_nonzero", "_assert_async", "item"}
# random numbers: a captured philox draw replays fresh only through registered generators
RANDOM = {"uniform_", "normal_", "exponential_", "bernoulli_", "random_", "multinomial", "rand", "randn",
          "randint", "randperm", "rand_like", "randn_like", "randint_like", "geometric_", "cauchy_",
          "log_normal_", "bernoulli", "normal", "poisson"}
HOST_DATA = {"lift_fresh", "lift_fresh_copy"}
# allocations without a kernel: a replay leaves what the memory held
NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}


def _op_name(func) -> str:
    return func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else str(func)


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[tuple[Any, tuple, dict, Any]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _op_name(func)
        if name in SYNC or (name == "repeat_interleave" and kwargs.get("output_size") is None
                            and isinstance(args[0], torch.Tensor) and args[0].dim() == 1
                            and len(args) == 1):
            raise CaptureError(f"{func} waits for the device: not capturable")
        if name in RANDOM:
            raise CaptureError(f"{func} draws random numbers inside a captured region")
        if name in HOST_DATA and args[0].dim() > 0:  # (0-dim: a Python scalar, a fill on the device)
            raise CaptureError(f"{func}: a tensor made from host data inside a captured region")
        if name in ("index", "index_put", "index_put_", "_index_put_impl_"):
            indices = args[1] if len(args) > 1 else []
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices):
                raise CaptureError(f"{func} with a boolean index (nonzero: a host sync)")
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            and a.storage_offset() == b.storage_offset() and a.stride() == b.stride() and a.shape == b.shape)


class EmulatedGraph:
    def __init__(self, ops: list, inference: bool):
        self.ops, self.inference = ops, inference
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        with torch.inference_mode(self.inference):
            for func, args, kwargs, recorded in self.ops:
                if _op_name(func) in NO_KERNEL:
                    continue
                result = func(*args, **kwargs)
                new, _ = tree_flatten(result)
                old, _ = tree_flatten(recorded)
                for a, b in zip(old, new):
                    if not isinstance(a, torch.Tensor):
                        continue
                    if a.shape != b.shape:
                        raise CaptureError(f"{func} gave shape {tuple(b.shape)} at replay, {tuple(a.shape)} at capture")
                    if not _same_view(a, b):
                        a.copy_(b)


graphs: list[EmulatedGraph] = []  # every graph recorded (tests read how many replayed)


def record(run: Callable[[], Any], pool) -> tuple[EmulatedGraph, Any]:
    """``specflow.runtime.cuda_graph.record`` on a CPU: warm-up, capture (recording), one replay."""
    run()
    recorder = _Recorder()
    with recorder:
        outputs = run()
    graph = EmulatedGraph(recorder.ops, torch.is_inference_mode_enabled())
    graphs.append(graph)
    graph.replay()
    return graph, outputs


def install(monkeypatch) -> None:
    """Make every GraphRunner, Beam and RowGraphs 'capture' through ``record`` on a CPU."""
    from specflow.runtime import beam, cuda_graph

    monkeypatch.setattr(cuda_graph, "record", record)
    monkeypatch.setattr(beam, "record", record)
    monkeypatch.setattr(torch.cuda, "MemPool", lambda: object())  # (a dummy class in CPU builds)
    init = cuda_graph.GraphRunner.__init__
    rows_init = cuda_graph.RowGraphs.__init__

    def graph_runner_init(self, runner, max_batch_size, max_tokens_per_request=1, capture=True):
        init(self, runner, max_batch_size, max_tokens_per_request, capture=True)

    def row_graphs_init(self, fn, max_rows, capture=True):
        rows_init(self, fn, max_rows, capture=True)

    monkeypatch.setattr(cuda_graph.GraphRunner, "__init__", graph_runner_init)
    monkeypatch.setattr(cuda_graph.RowGraphs, "__init__", row_graphs_init)
