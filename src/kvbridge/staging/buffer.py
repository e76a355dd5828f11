"""A rank's staging memory — prefill's buffer that chunks are gathered into, decode's ring that
they land in — together with the kernels that fill and empty it, in the memory the KV cache is
in: numpy on host memory, torch on the cache's own tensors (a GPU's, on a stream of their own;
or CPU tensors when asked).

`open_staging` picks the kind: ``auto`` uses numpy for host memory and torch for GPU memory
(which needs the tensors, i.e. `KVArgs.from_torch`); ``numpy`` and ``torch`` force one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import numpy as np
import numpy.typing as npt

from kvbridge.cache.regions import MemoryRegion
from kvbridge.cache.spec import KVArgs
from kvbridge.staging import kernels
from kvbridge.wire.messages import MemoryKind

KERNELS = ("auto", "numpy", "torch")


class StagingUnavailable(ValueError):
    """This cache cannot use the staging path with these kernels (the reason says why)."""


class StagingBuffer(ABC):
    """`length` bytes at `ptr` (in the KV cache's memory) and the gather/scatter between them
    and the KV buffers' token rows."""

    ptr: int
    length: int
    memory_kind: MemoryKind
    device_id: int

    @property
    def region(self) -> MemoryRegion:
        return MemoryRegion(self.ptr, self.length, self.memory_kind, self.device_id)

    @abstractmethod
    def gather(self, rows: npt.NDArray[np.int64], column: int, width: int, offset: int = 0) -> int:
        """Bytes ``[column, column + width)`` of the token rows of every KV buffer into this
        buffer from `offset` on, buffer-major; the bytes staged."""

    @abstractmethod
    def scatter(
        self, offset: int, end: int, rows: npt.NDArray[np.int64], column: int, width: int
    ) -> None:
        """The staged bytes at ``[offset, end)`` into the token rows of every KV buffer."""


class HostStaging(StagingBuffer):
    """Host memory, numpy kernels (views of the KV buffers made from their addresses)."""

    def __init__(self, kv_args: KVArgs, length: int) -> None:
        self._bytes = np.empty(length, dtype=np.uint8)
        self._bytes.fill(0)  # touch it: no page faults inside a transfer
        self.ptr, self.length = int(self._bytes.ctypes.data), length
        self.memory_kind, self.device_id = MemoryKind.DRAM, 0
        self._rows = [kernels.buffer_rows(b, kv_args.token_bytes) for b in kv_args.kv_buffers]
        self._page_size = kv_args.page_size

    def gather(self, rows: npt.NDArray[np.int64], column: int, width: int, offset: int = 0) -> int:
        return kernels.gather(
            self._rows, rows, column, width, self._bytes[offset:], self._page_size
        )

    def scatter(
        self, offset: int, end: int, rows: npt.NDArray[np.int64], column: int, width: int
    ) -> None:
        kernels.scatter(self._bytes[offset:end], self._rows, rows, column, width, self._page_size)


class TorchStaging(StagingBuffer):
    """The cache's own torch tensors and a staging tensor beside them (same device); on a GPU
    the kernels run on this buffer's stream."""

    def __init__(self, kv_args: KVArgs, length: int) -> None:
        import torch  # type: ignore[import-not-found,unused-ignore]

        from kvbridge.staging import torch_kernels

        self._torch, self._kernels = torch, torch_kernels
        first = kv_args.kv_tensors[0]
        self._device = first.device
        self._bytes = torch.zeros(length, dtype=torch.uint8, device=self._device)
        self.ptr, self.length = int(self._bytes.data_ptr()), length
        self.memory_kind, self.device_id = kv_args.memory_kind, kv_args.device_id
        self._rows = [torch_kernels.byte_rows(t, kv_args.token_bytes) for t in kv_args.kv_tensors]
        self._stream = torch_kernels.side_stream(self._device)
        torch_kernels.prepare(self._device)

    def _on_device(self, rows: npt.NDArray[np.int64]) -> Any:
        return self._torch.from_numpy(np.ascontiguousarray(rows)).to(self._device)

    def gather(self, rows: npt.NDArray[np.int64], column: int, width: int, offset: int = 0) -> int:
        size: int = self._kernels.gather(
            self._rows, self._on_device(rows), column, width, self._bytes[offset:], self._stream
        )
        return size

    def scatter(
        self, offset: int, end: int, rows: npt.NDArray[np.int64], column: int, width: int
    ) -> None:
        self._kernels.scatter(
            self._bytes[offset:end], self._rows, self._on_device(rows), column, width, self._stream
        )


def open_staging(kv_args: KVArgs, length: int, kernels_name: str) -> StagingBuffer:
    """The staging buffer for this cache, or `StagingUnavailable` with the reason."""
    if kernels_name not in KERNELS:
        raise StagingUnavailable(f"staging kernels {kernels_name!r}: one of {', '.join(KERNELS)}")
    on_gpu = kv_args.memory_kind == MemoryKind.VRAM
    use_torch = kernels_name == "torch" or (kernels_name == "auto" and on_gpu)
    if not use_torch:
        if on_gpu:
            raise StagingUnavailable("numpy staging kernels cannot reach GPU memory")
        return HostStaging(kv_args, length)
    if not kv_args.kv_tensors:
        raise StagingUnavailable(
            "torch staging kernels need the cache's tensors (build KVArgs with from_torch)"
        )
    return TorchStaging(kv_args, length)
