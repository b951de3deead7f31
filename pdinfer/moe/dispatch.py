"""Expert-parallel dispatch and combine: a MoE layer's (token, expert) pairs go to the ranks
holding their experts and come back, over the expert group's all-to-all.

Per layer and step, three exchanges:
1. counts: how many rows this rank sends to each slot of each rank ([N, S] int64);
2. dispatch: the rows (token hidden states, sorted by destination slot);
3. combine: the experts' outputs, back the way they came.
The routing weights never travel: the origin rank scales and sums its own rows.

Buffers are allocated once, sized from the role's MoE workspace (``MoEConfig``, seed 7.5): a
rank sends at most ``workspace_tokens * top_k`` rows and receives at most ``N`` times that. Each
batch is checked against its own bound (``max_tokens_per_rank(is_prompt)``), which the model
runner sets per step with ``step(is_prompt)``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from pdinfer.config import MoEConfig
from pdinfer.layers.moe import Experts, run_experts

if TYPE_CHECKING:
    from pdinfer.distributed.ep_group import TorchExpertGroup


class ExpertDispatcher:
    """Shared by every MoE layer of a model (the layers run one after another)."""

    def __init__(
        self,
        group: TorchExpertGroup,
        config: MoEConfig,
        top_k: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.group, self.config, self.top_k = group, config, top_k
        rows = config.workspace_tokens * top_k
        self.send_buffer = torch.empty(rows, hidden_size, dtype=dtype, device=device)
        self.recv_buffer = torch.empty(group.size * rows, hidden_size, dtype=dtype, device=device)
        self._max_tokens: int | None = None  # this step's bound; set by step()

    @property
    def workspace_bytes(self) -> int:
        return (self.send_buffer.numel() + self.recv_buffer.numel()) * self.send_buffer.element_size()

    @contextmanager
    def step(self, is_prompt: bool) -> Iterator[None]:
        """The scope of one step's forward: its batch kind picks the token bound."""
        self._max_tokens = self.config.max_tokens_per_rank(is_prompt)
        try:
            yield
        finally:
            self._max_tokens = None

    def dispatch_combine(
        self, x: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor, experts: Experts
    ) -> torch.Tensor:
        """sum_k weights[t, k] * slot_{slots[t, k]}(x[t]), the slots spread over the group."""
        if self._max_tokens is None:
            raise RuntimeError("an expert-parallel MoE layer ran outside ExpertDispatcher.step()")
        num_tokens, group = x.shape[0], self.group
        if num_tokens > self._max_tokens:
            raise RuntimeError(
                f"a batch of {num_tokens} tokens exceeds this step's MoE workspace bound of {self._max_tokens}"
            )
        num_ranks, per_rank = group.size, experts.gate_up_proj.shape[0]
        flat = slots.reshape(-1)
        order = flat.argsort(stable=True)  # by destination rank, then slot
        send_counts = torch.bincount(flat, minlength=num_ranks * per_rank)
        recv_counts = torch.empty_like(send_counts)
        group.all_to_all(recv_counts, send_counts, [per_rank] * num_ranks, [per_rank] * num_ranks)
        send_splits = send_counts.view(num_ranks, per_rank).sum(1).tolist()
        recv_splits = recv_counts.view(num_ranks, per_rank).sum(1).tolist()
        token_of = order // slots.shape[1]
        sent = self.send_buffer[: flat.numel()]
        torch.index_select(x, 0, token_of, out=sent)
        received = self.recv_buffer[: sum(recv_splits)]
        group.all_to_all(received, sent, recv_splits, send_splits)
        # Received rows are grouped by source rank, then slot: regroup them by slot.
        local_slot = torch.arange(per_rank, device=x.device).repeat(num_ranks)
        slot_of_row = local_slot.repeat_interleave(recv_counts)
        by_slot = slot_of_row.argsort(stable=True)
        per_slot = recv_counts.view(num_ranks, per_rank).sum(0).tolist()
        outputs = run_experts(received.index_select(0, by_slot), experts.gate_up_proj, experts.down_proj, per_slot)
        received.index_copy_(0, by_slot, outputs)
        group.all_to_all(sent, received, send_splits, recv_splits)  # back, in `order`
        sent.mul_(weights.reshape(-1).index_select(0, order).unsqueeze(1).to(sent.dtype))
        return torch.zeros_like(x).index_add_(0, token_of, sent)
