"""Copy training state to host memory, so a snapshot can be written while training goes on.

An asynchronous save stalls training only for this copy: every tensor of the state is copied
into host buffers that training never touches (optimizer steps change parameters in place, so
the originals cannot be written later). The buffers are kept and reused by the next save of a
state with the same tensor shapes, as PyTorch's async checkpointing does, because allocating
and first-touching gigabytes costs more than copying into memory that is already mapped; from a
GPU they are pinned, so the copies run at full PCIe speed and overlap.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

__all__ = ["HostStager", "host_storage_spans"]


class HostStager:
    """Copies a nested state (dicts, lists, tuples of tensors and plain data) to host memory."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []
        self._position = 0

    def stage(self, state: Any) -> Any:
        """A copy of ``state`` whose tensors live in this stager's host buffers.

        The copy stays valid until the next ``stage`` call (the buffers are then reused), so
        the caller must be done with it first: one save in flight at a time.
        """
        self._position = 0
        seen: dict[int, torch.Tensor] = {}  # tied tensors stay one tensor in the copy
        staged = self._copy(state, seen)
        del self._buffers[self._position :]  # a smaller state: let the rest go
        if any(buffer.is_pinned() for buffer in self._buffers) and torch.cuda.is_available():
            torch.cuda.synchronize()  # the non-blocking device-to-host copies must land
        return staged

    def _copy(self, value: Any, seen: dict[int, torch.Tensor]) -> Any:
        if isinstance(value, torch.Tensor):
            if id(value) not in seen:
                seen[id(value)] = self._copy_tensor(value)
            return seen[id(value)]
        if isinstance(value, dict):
            return type(value)((key, self._copy(item, seen)) for key, item in value.items())
        if isinstance(value, list):
            return [self._copy(item, seen) for item in value]
        if isinstance(value, tuple) and not hasattr(value, "_fields"):
            return tuple(self._copy(item, seen) for item in value)
        return copy.deepcopy(value)  # numbers, strings, numpy RNG states: small

    def _copy_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        source = tensor.detach()
        if not _is_plain(source):
            return source.to("cpu", copy=True)  # DTensors, sparse: the rare, slow path
        buffer = self._buffer_like(source)
        buffer.copy_(source, non_blocking=buffer.is_pinned())
        return buffer

    def _buffer_like(self, source: torch.Tensor) -> torch.Tensor:
        index = self._position
        self._position += 1
        if index < len(self._buffers):
            old = self._buffers[index]
            if old.shape == source.shape and old.dtype == source.dtype:
                return old
        pin = source.device.type == "cuda"
        buffer = torch.empty(source.shape, dtype=source.dtype, device="cpu", pin_memory=pin)
        if index < len(self._buffers):
            self._buffers[index] = buffer
        else:
            self._buffers.append(buffer)
        return buffer


def host_storage_spans(state: Any) -> list[tuple[int, int]]:
    """``(address, bytes)`` of the host memory behind every CPU tensor of a nested state.

    torch.save writes each tensor's storage straight from this memory, which the caller keeps
    alive and unchanged for the whole save; the snapshot writer hashes it in place.
    """
    spans: list[tuple[int, int]] = []
    pending = [state]
    while pending:
        value = pending.pop()
        if isinstance(value, torch.Tensor):
            if value.device.type == "cpu" and _is_plain(value):
                storage = value.untyped_storage()
                spans.append((storage.data_ptr(), storage.nbytes()))
        elif isinstance(value, dict):
            pending.extend(value.values())
        elif isinstance(value, (list, tuple)):
            pending.extend(value)
    return spans


def _is_plain(tensor: torch.Tensor) -> bool:
    """A dense tensor whose bytes are one storage. A DTensor or other tensor subclass keeps
    its own metadata, and a sparse one several storages: those take the generic way."""
    plain_type = type(tensor) is torch.Tensor or type(tensor) is torch.nn.Parameter
    return plain_type and tensor.layout == torch.strided and not tensor.is_sparse
