"""The KV cache tensor: ``[num_blocks, num_layers, parts, block_size, heads, dim]``.

The model's ``KVCacheSpec`` says what a token holds: K and V (``parts`` 2, ``kv_heads x
head_dim``) for dense attention, one latent vector for MLA (``parts`` 1, ``1 x (kv_lora_rank +
qk_rope_head_dim)``). Block-major, so one block over all layers is a contiguous chunk: a
hand-off or a store write of a block is one memcpy, whatever the layout.
"""

from __future__ import annotations

import numpy as np
import torch

from pdinfer.models.spec import ModelSpec

# numpy twins of the CPU cache dtypes (bfloat16 as its 16 bits: zero bits are 0.0 either way)
_NUMPY_DTYPES = {torch.float32: np.float32, torch.float16: np.float16, torch.bfloat16: np.uint16}
# Cache dtypes that torch's indexing kernels may not cover: blocks move as their bytes.
_BYTE_MOVED = (torch.float8_e4m3fn,)


def block_bytes(spec: ModelSpec, block_size: int, dtype: torch.dtype) -> int:
    itemsize = torch.empty((), dtype=dtype).element_size()
    return block_size * spec.kv_cache.bytes_per_token(itemsize)


class CacheEngine:
    def __init__(self, spec: ModelSpec, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.device = device
        shape = (num_blocks, *spec.kv_cache.block_shape(block_size))
        # Zeroed, so padding slots never hold NaN garbage. On CPU numpy's calloc-backed zeros
        # are mapped lazily by the OS (torch.zeros would touch every page: ~6 s for 4 GiB).
        if device.type == "cpu" and dtype in _NUMPY_DTYPES:
            self.kv = torch.from_numpy(np.zeros(shape, dtype=_NUMPY_DTYPES[dtype])).view(dtype)
        elif dtype in _BYTE_MOVED:  # e4m3's zero is the zero byte
            self.kv = torch.zeros(shape, dtype=torch.uint8, device=device).view(dtype)
        else:
            self.kv = torch.zeros(shape, dtype=dtype, device=device)
        # what block copies index: the cache itself, or its bytes (an FP8 cache)
        self._moved = self.kv.view(torch.uint8) if dtype in _BYTE_MOVED else self.kv
        self.bytes_per_block = self.kv[0].numel() * self.kv.element_size()
        self.states: torch.Tensor | None = None

    def init_states(self, num_slots: int, state_shape: tuple[int, ...]) -> None:
        """Per-sequence state slots for models that carry state beside their paged K/V."""
        self.states = torch.zeros((num_slots, *state_shape), dtype=self.dtype, device=self.device)

    def copy_states(self, pairs: list[tuple[int, int]]) -> None:
        """Clone state slots (a fork's state starts as its parent's)."""
        if not pairs:
            return
        if self.states is None:
            raise RuntimeError("state slots cloned, but this model has no per-sequence state")
        src = torch.tensor([s for s, _ in pairs], device=self.device)
        dst = torch.tensor([d for _, d in pairs], device=self.device)
        self.states[dst] = self.states[src]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], device=self.device)
        dst = torch.tensor([d for _, d in pairs], device=self.device)
        self._moved[dst] = self._moved[src]

    def clone_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """``copy_blocks`` with the block ids already on the device (the GPU step path)."""
        self._moved.index_copy_(0, dst, self._moved.index_select(0, src))

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A contiguous copy of the given blocks, ``[len(block_ids), *block_shape]``."""
        index = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        return self._moved.index_select(0, index).view(self.dtype)

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        index = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        data = data.to(device=self.device, dtype=self.dtype)
        self._moved.index_copy_(0, index, data.view(self._moved.dtype))

    @property
    def block_shape(self) -> tuple[int, ...]:
        return tuple(self.kv.shape[1:])

    # --- pinned-host staging for the KV hand-off (asynchronous on CUDA) -------------------------
    def read_blocks_async(
        self, block_ids: list[int], out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, CopyEvent]:
        """Copy blocks to host memory without blocking: ``(host [n, *block_shape], event)``.

        On CUDA the host tensor is pinned and filled on a side stream that first waits for the
        work already queued (the steps that wrote these blocks); it is valid once
        ``event.synchronize()`` returns. Block-major: each run of consecutive block ids is one
        device-to-host copy, with no device-side gather buffer. ``out``: a pinned buffer to fill
        (reuse one: pinning fresh host memory costs far more than the copy). On CPU: a copy,
        already done.
        """
        if self.device.type != "cuda":
            return self.read_blocks(block_ids), CopyEvent(None)
        host = (
            out[: len(block_ids)]
            if out is not None
            else torch.empty((len(block_ids), *self.block_shape), dtype=self.dtype, pin_memory=True)
        )
        stream = self._copy_stream()
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for dst, src, n in _runs(block_ids):
                host[dst : dst + n].copy_(self.kv[src : src + n], non_blocking=True)
            return host, CopyEvent(_recorded(stream))

    def write_blocks_async(self, block_ids: list[int], host: torch.Tensor) -> CopyEvent:
        """Copy host blocks ``[n, *block_shape]`` into the cache without blocking.

        On CUDA ``host`` should be pinned and must stay alive and unchanged until the event
        completes; a step that reads these blocks must come after ``event.synchronize()`` (or
        ``torch.cuda.current_stream().wait_event(event.event)``). On CPU: done on return.
        """
        if self.device.type != "cuda":
            self.write_blocks(block_ids, host)
            return CopyEvent(None)
        if host.dtype != self.dtype:
            host = host.to(self.dtype)
        stream = self._copy_stream()
        # A reused block may still be read by a step in flight: write after queued work.
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for src, dst, n in _runs(block_ids):
                self.kv[dst : dst + n].copy_(host[src : src + n], non_blocking=True)
            return CopyEvent(_recorded(stream))

    def _copy_stream(self):
        if getattr(self, "_stream", None) is None:
            self._stream = torch.cuda.Stream(self.device)
        return self._stream


class CopyEvent:
    """Completion of an asynchronous block copy (a CUDA event; None: already complete)."""

    def __init__(self, event):
        self.event = event

    def synchronize(self) -> None:
        if self.event is not None:
            self.event.synchronize()

    def query(self) -> bool:
        return self.event is None or self.event.query()


def _recorded(stream) -> torch.cuda.Event:
    event = torch.cuda.Event()
    event.record(stream)
    return event


def _runs(block_ids: list[int]) -> list[tuple[int, int, int]]:
    """(index in block_ids, first block id, length) of each run of consecutive block ids."""
    runs: list[tuple[int, int, int]] = []
    for i, block in enumerate(block_ids):
        if runs and runs[-1][1] + runs[-1][2] == block:
            start, first, n = runs[-1]
            runs[-1] = (start, first, n + 1)
        else:
            runs.append((i, block, 1))
    return runs
