"""Host <-> device transfers of several small tensors as one copy.

A copy from pageable host memory with ``non_blocking=False`` makes the host wait for all the
GPU work queued before it, and a device-to-host copy always does; a step that moves ten small
tensors one by one waits ten times. These helpers move a group of tensors as one buffer of
bytes: ``to_device`` packs the host ones into one pinned buffer and copies it without waiting,
``to_host`` packs the device ones on the device and copies them back once, and ``HostCopy``
does the same into pinned memory without waiting, until its results are asked for.

Bytes are packed largest element first, so every tensor starts at a multiple of its element
size and unpacks as a view.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor


def pack(tensors: Sequence[Tensor], out: Tensor | None = None) -> Tensor:
    """The bytes of ``tensors`` (one device) as one uint8 tensor [sum of nbytes], in the order
    ``unpack`` reads them (largest element first)."""
    parts = [_flat(t).view(torch.uint8) for t in sorted(tensors, key=lambda t: -t.element_size())]
    return torch.cat(parts, out=out)


def _flat(t: Tensor) -> Tensor:
    """``t``'s elements in order, 1-D with stride 1 (a view where ``t`` is contiguous). A tensor of
    at most one element counts as contiguous whatever its stride (a column of a one-row batch, an
    expanded scalar), and a byte view refuses a stride other than 1."""
    flat = t.contiguous().view(-1)
    return flat.as_strided((flat.numel(),), (1,))


def unpack(buffer: Tensor, like: Sequence[Tensor]) -> list[Tensor]:
    """Views of ``buffer`` (``pack``'s bytes) with the dtypes and shapes of ``like``, in order."""
    out: list[Tensor | None] = [None] * len(like)
    offset = 0
    for i in sorted(range(len(like)), key=lambda i: -like[i].element_size()):
        n = like[i].numel() * like[i].element_size()
        out[i] = buffer[offset : offset + n].view(like[i].dtype).view(like[i].shape)
        offset += n
    return out


def to_device(tensors: Sequence[Tensor], device: torch.device) -> list[Tensor]:
    """``tensors`` on ``device`` (those already there as they are), the host ones with one
    copy that does not wait for the GPU: packed into a pinned buffer, which the caching host
    allocator keeps until the copy has run."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # "cuda" is the current device: tensors say cuda:N
        device = torch.device("cuda", torch.cuda.current_device())
    moving = [t for t in tensors if t.device != device]
    if device.type != "cuda" or not moving:
        return [t if t.device == device else t.to(device) for t in tensors]
    assert all(t.device.type == "cpu" for t in moving), "to_device moves host tensors"
    staged = pack(moving, out=torch.empty(sum(t.nbytes for t in moving), dtype=torch.uint8, pin_memory=True))
    moved = iter(unpack(staged.to(device, non_blocking=True), moving))
    return [t if t.device == device else next(moved) for t in tensors]


def to_host(tensors: Sequence[Tensor]) -> list[Tensor]:
    """Host copies of ``tensors`` (host ones cloned), the device ones with one device-to-host
    copy of their packed bytes."""
    on_device = [t for t in tensors if t.device.type != "cpu"]
    if not on_device:
        return [t.clone() for t in tensors]
    moved = iter(unpack(pack(on_device).cpu(), on_device))
    return [t.clone() if t.device.type == "cpu" else next(moved) for t in tensors]


class HostCopy:
    """Device tensors on their way to the host: one copy into pinned memory, queued without
    waiting for the GPU; ``wait()`` returns the host tensors once it has run (host ones as they
    are). What overlaps a step's host work with the GPU's: the host queues the next forward
    before it waits for this one's results."""

    def __init__(self, tensors: Sequence[Tensor]):
        self.tensors = list(tensors)
        self.on_device = [t for t in self.tensors if t.device.type != "cpu"]
        self.staged = self.done = None
        if self.on_device:
            packed = pack(self.on_device)
            self.staged = torch.empty(packed.shape, dtype=torch.uint8, pin_memory=True)
            self.staged.copy_(packed, non_blocking=True)
            self.done = torch.cuda.Event()
            self.done.record(torch.cuda.current_stream(packed.device))  # the stream the copy runs on

    def wait(self) -> list[Tensor]:
        if self.done is not None:
            self.done.synchronize()
        moved = iter(unpack(self.staged, self.on_device) if self.on_device else [])
        return [t if t.device.type == "cpu" else next(moved) for t in self.tensors]
