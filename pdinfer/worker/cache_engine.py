"""The KV cache tensor: ``[num_blocks, num_layers, 2, block_size, kv_heads, head_dim]``.

Block-major, so one block's K/V over all layers is a contiguous chunk: a hand-off or a store
write of a block is one memcpy.
"""

from __future__ import annotations

import numpy as np
import torch

from pdinfer.models.spec import ModelSpec

_NUMPY_DTYPES = {torch.float32: np.float32, torch.float16: np.float16}


def block_bytes(spec: ModelSpec, block_size: int, dtype: torch.dtype) -> int:
    itemsize = torch.empty((), dtype=dtype).element_size()
    return spec.num_layers * 2 * block_size * spec.num_kv_heads * spec.head_dim * itemsize


class CacheEngine:
    def __init__(self, spec: ModelSpec, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.device = device
        shape = (num_blocks, spec.num_layers, 2, block_size, spec.num_kv_heads, spec.head_dim)
        # Zeroed, so padding slots never hold NaN garbage. On CPU numpy's calloc-backed zeros
        # are mapped lazily by the OS (torch.zeros would touch every page: ~6 s for 4 GiB).
        if device.type == "cpu" and dtype in _NUMPY_DTYPES:
            self.kv = torch.from_numpy(np.zeros(shape, dtype=_NUMPY_DTYPES[dtype]))
        else:
            self.kv = torch.zeros(shape, dtype=dtype, device=device)
        self.bytes_per_block = self.kv[0].numel() * self.kv.element_size()

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], device=self.device)
        dst = torch.tensor([d for _, d in pairs], device=self.device)
        self.kv[dst] = self.kv[src]

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A contiguous copy of the given blocks, ``[len(block_ids), *block_shape]``."""
        index = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        return self.kv.index_select(0, index)

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        index = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        self.kv.index_copy_(0, index, data.to(device=self.device, dtype=self.dtype))

    @property
    def block_shape(self) -> tuple[int, ...]:
        return tuple(self.kv.shape[1:])
