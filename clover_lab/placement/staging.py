"""Experts copied from host memory onto a device in one copy per forward and layer.

``Staging`` (one per device that runs offloaded experts, shared by their layers): the experts a
forward needs are gathered, every per-expert tensor of them (gate_up, down, an FP8 layer's scales)
packed side by side, into one host staging buffer (page-locked on CUDA), and that buffer is
copied onto the device with one asynchronous copy on a side stream; the layer's compute waits for
that copy's event, not for the host. Two host buffers take turns, so the gather for the next
layer (a prefetch) never overwrites a buffer whose copy is still in flight. On a CPU "device" the
same gather and the same single copy run synchronously (what the CPU tests count).

Packed layout for n experts: each tensor's n rows [n, *shape] at an offset aligned to 256 bytes,
in the order of ``expert_tensors``; on the device each tensor is a contiguous view of the one
copied buffer.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

ALIGN = 256  # bytes: every packed tensor starts at an offset any dtype can view


@dataclass
class Staged:
    """A set of experts on the device: ``ids`` (global expert ids, slot j holds ids[j]), their
    tensors by name, and the copy's event (CUDA) the compute stream waits for before use."""

    ids: list[int]
    tensors: dict[str, torch.Tensor]
    nbytes: int = 0
    event: object = None
    _buffer: torch.Tensor | None = field(default=None, repr=False)

    def ready(self) -> "Staged":
        """Make the current stream wait for the copy (once) and keep the buffer from being reused
        by the copy stream before the current stream is done with it."""
        if self.event is not None:
            stream = torch.cuda.current_stream(self._buffer.device)
            stream.wait_event(self.event)
            self._buffer.record_stream(stream)
            self.event = None
        return self


def layout(host: dict[str, torch.Tensor], n: int) -> tuple[list[tuple[str, int, int]], int]:
    """[(name, byte offset, bytes per expert)] of n experts packed, and the total bytes."""
    out, offset = [], 0
    for name, t in host.items():
        row = t[0].numel() * t.element_size() if t.shape[0] else 0
        out.append((name, offset, row))
        offset += -(-n * row // ALIGN) * ALIGN
    return out, offset


def expert_bytes(host: dict[str, torch.Tensor]) -> int:
    """Bytes one expert's tensors take (unpadded)."""
    return sum(t[0].numel() * t.element_size() for t in host.values())


class Staging:
    """The host staging buffers and the copy stream of one device (see the module docstring).

    Counters: ``copies`` (host-to-device copies issued), ``bytes_copied``."""

    def __init__(self, device, pin_memory: bool = False):
        self.device = torch.device(device)
        self.pinned = bool(pin_memory) and self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._host: list[torch.Tensor | None] = [None, None]
        self._events: list = [None, None]
        self._turn = 0
        self.copies = 0
        self.bytes_copied = 0

    @property
    def host_bytes(self) -> int:
        """Host memory the staging buffers hold."""
        return sum(b.numel() for b in self._host if b is not None)

    def _host_buffer(self, nbytes: int) -> tuple[torch.Tensor, int]:
        turn = self._turn
        self._turn ^= 1
        if self._events[turn] is not None:  # the copy that last read this buffer is done
            self._events[turn].synchronize()
            self._events[turn] = None
        buf = self._host[turn]
        if buf is None or buf.numel() < nbytes:
            self._host[turn] = None  # the old buffer goes before the larger one is allocated
            buf = self._host[turn] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned)
        return buf[:nbytes], turn

    def stage(self, host: dict[str, torch.Tensor], ids: list[int]) -> Staged:
        """Experts ``ids`` of ``host`` (name -> [E, ...] host tensors) on the device: one gather into
        a staging buffer, one copy."""
        n = len(ids)
        parts, total = layout(host, n)
        buf, turn = self._host_buffer(total)
        index = torch.tensor(ids, dtype=torch.long)
        for name, offset, row in parts:  # the gather: rows of every tensor, as bytes
            rows = host[name].detach().reshape(host[name].shape[0], -1).view(torch.uint8)
            torch.index_select(rows, 0, index, out=buf[offset:offset + n * row].view(n, row))
        event = None
        if self.stream is None:
            device_buf = buf.to(self.device, copy=True)
        else:
            with torch.cuda.stream(self.stream):  # allocated and filled on the copy stream
                device_buf = torch.empty(total, dtype=torch.uint8, device=self.device)
                device_buf.copy_(buf, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.stream)
            self._events[turn] = event
        self.copies += 1
        self.bytes_copied += total
        tensors = {name: device_buf[offset:offset + n * row].view(host[name].dtype).view(n, *host[name].shape[1:])
                   for name, offset, row in parts}
        return Staged(list(ids), tensors, total, event, device_buf)


def pin_in_place(module: torch.nn.Module, names, pin=None) -> int:
    """Move ``module``'s tensors ``names`` (parameters or buffers) into page-locked memory in place:
    the pageable copy is released, so the host holds each offloaded expert once. Returns the bytes
    pinned. ``pin``: the copy to make (``Tensor.pin_memory``; tests pass another)."""
    pin = pin or torch.Tensor.pin_memory
    total = 0
    for name in names:
        if name in module._parameters:
            param = module._parameters[name]
            param.data = pin(param.data)
            total += param.numel() * param.element_size()
        else:
            module._buffers[name] = pin(module._buffers[name])
            total += module._buffers[name].numel() * module._buffers[name].element_size()
    return total
