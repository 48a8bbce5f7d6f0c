"""Grouped host <-> device transfers: every tensor comes back with its dtype, shape and values."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specflow.runtime.transfer import pack, to_device, to_host, unpack

DTYPES = [torch.bool, torch.uint8, torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float32,
          torch.float64]


def make(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) < 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(0, 100, shape, generator=g, dtype=dtype)


tensors = st.lists(st.tuples(st.sampled_from(DTYPES), st.lists(st.integers(0, 4), max_size=3).map(tuple)),
                   min_size=1, max_size=8)


@settings(max_examples=100, deadline=None)
@given(specs=tensors, seed=st.integers(0, 2**16))
def test_unpack_inverts_pack(specs, seed):
    xs = [make(dtype, shape, seed + i) for i, (dtype, shape) in enumerate(specs)]
    buffer = pack(xs)
    assert buffer.dtype == torch.uint8 and buffer.numel() == sum(x.nbytes for x in xs)
    for x, y in zip(xs, unpack(buffer, xs)):
        assert y.dtype == x.dtype and y.shape == x.shape and torch.equal(x, y)
        assert y.numel() == 0 or y.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()  # views


def test_pack_takes_strided_tensors():
    """Column views (SamplingBatch's per-request floats, of one request too), expanded scalars and
    transposes pack by value."""
    floats = torch.rand(4, 3)
    xs = [floats[:, 1], floats.t(), torch.arange(12).view(3, 4)[:, ::2], floats[:1, 2], torch.tensor(0.5).expand(1),
          floats[:0, 1]]
    assert [x.stride(-1) for x in xs[3:]] == [3, 0, 3]  # one element or none: "contiguous", stride not 1
    for x, y in zip(xs, unpack(pack(xs), xs)):
        assert y.shape == x.shape and torch.equal(x, y)


def test_to_host_copies_host_tensors():
    xs = [torch.arange(6).view(2, 3), torch.ones(3, dtype=torch.bool)]
    ys = to_host(xs)
    xs[0].zero_()
    assert torch.equal(ys[0], torch.arange(6).view(2, 3)) and torch.equal(ys[1], xs[1])
    assert to_device(xs, torch.device("cpu"))[0] is xs[0]  # already there


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_to_device_does_not_wait_for_the_gpu():
    """Host tensors reach the device with one copy that never synchronizes (sync debug mode
    raises on any), device ones pass through; to_host brings them all back in one copy."""
    xs = [make(dtype, (3, 5), i) for i, dtype in enumerate(DTYPES)] + [torch.rand(4, 3)[:, 1]]  # a strided one too
    on_gpu = torch.arange(7, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        moved = to_device([*xs, on_gpu], torch.device("cuda"))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert moved[-1] is on_gpu and all(y.is_cuda for y in moved)
    back = to_host(moved)
    for x, y in zip([*xs, on_gpu.cpu()], back):
        assert y.device.type == "cpu" and y.dtype == x.dtype and torch.equal(x, y)
