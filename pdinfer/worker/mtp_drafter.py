"""The MTP drafter: DeepSeek-V3's multi-token-prediction layer proposes k tokens
(``models/deepseek_mtp.py`` has the layer; ``core/spec_decode.DraftPool`` calls ``draft``).

Decisions:
- **Its own latent cache, the main cache's block ids.** The MTP layer's MLA entries live in a
  tensor of their own, ``[num_blocks + scratch, 1, 1, block_size, 1, latent + rope]``, indexed
  by the sequence's block table: a position's MTP entry sits in the same block and slot as its
  main K/V, so allocation, rollback (``BlockManager.trim``) and freeing need nothing new, and
  the KV hand-off, the KV store and the connector handshake see the main layers only.
- **Entries are written lazily, at the next draft.** The MTP entry of position i needs the
  target's hidden state h_i and the token t_{i+1}, known only once the step's tokens are
  accepted. The engine hands each step's hidden states over (``observe``, from the output
  processor); ``draft`` then runs the MTP layer once over the positions not written yet (a
  prefill chunk: the prompt at the first draft, 1 + accepted rows after a verifying step), and
  its last row gives draft 1. A sequence that does not draft (backing off, or in a batch too
  large to draft) writes its entries in chunks of ``catch_up_rows`` (``catch_up``), so its
  context stays whole at a small cost (one layer over each token, once). Constrained
  sequences never draft and are not observed. As a last bound, at most ``max_pending_rows``
  hidden states wait; beyond that the oldest are dropped and the MTP context restarts after
  them.
- **k drafts = k sequential steps of the one MTP layer** (as vLLM does): step j reads the
  previous step's output h' and draft j at the next position. Those speculative entries go into
  the sequence's blocks where it has them, else into scratch blocks past the cache's end; the
  next catch-up overwrites them before anything reads them (a position is read only once it
  is written from verified tokens, or within the chain that wrote it).
- **A context window.** A sequence's MTP context starts where it first had hidden states:
  position 0 after its own prefill; after a prefix-cache hit, the first recomputed position;
  on a COMPLETION engine, its first decode position (the PE never runs the MTP layer, so the CE
  has no MTP entries for the prompt: drafting starts one step after the hand-off, and its
  first drafts do not see the prompt through the MTP layer; the main model verifies them
  against the full context, so output is unchanged). If the blocks under its entries change
  (copy-on-write after a fork), the context restarts there too.
- **Per sequence, greedy, on the host thread.** Drafts are the MTP argmax (a point-mass draft,
  which the acceptance rule needs); one sequence's steps run at a time, in the scheduler's
  loop. On CUDA the layer runs its plain torch path (MLA over its own cache, the MoE's fused
  experts) on the engine's device and stream, after the step whose hidden states it reads
  (the host has waited for that step); each draft reads its argmax back to the host, so a
  draft costs k small forwards and k device round trips.

Entries in a block shared with another sequence (a fully cached prompt that recomputes its last
token) may be overwritten by the other sharer: that changes drafts, never output.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from pdinfer.layers.attention.mla import MLAMetadata, MLASeq
from pdinfer.models.decoder import DecoderLM
from pdinfer.models.deepseek_mtp import DeepseekMTP
from pdinfer.sequence import Sequence


@dataclass
class _MTPState:
    start: int  # first position of the sequence's MTP context
    written: int  # MTP entries exist for positions [start, written)
    blocks: list[int] = field(default_factory=list)  # the block ids under [start, written)
    pending: list[torch.Tensor] = field(default_factory=list)  # hidden rows from ``written`` on
    num_pending: int = 0


class MTPDrafter:
    needs_hidden_states = True

    def __init__(
        self,
        mtp: DeepseekMTP,
        main: DecoderLM,
        num_blocks: int,
        block_size: int,
        max_draft_tokens: int,
        max_pending_rows: int = 4096,
        catch_up_rows: int = 64,
    ):
        mla = mtp.spec.mla
        assert mla is not None  # DeepseekMTP refuses a spec without MLA
        self.mtp, self.main = mtp, main
        self.block_size = block_size
        self.max_pending_rows = max_pending_rows
        self.catch_up_rows = catch_up_rows
        param = next(mtp.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.scratch = list(range(num_blocks, num_blocks + -(-max_draft_tokens // block_size) + 1))
        entry = mla.kv_lora_rank + mla.qk_rope_head_dim
        self.kv = torch.zeros(
            num_blocks + len(self.scratch), 1, 1, block_size, 1, entry, dtype=self.dtype, device=self.device
        )
        self._states: dict[int, _MTPState] = {}

    # --- what the engine tells it -------------------------------------------------------------
    def observe(self, seq: Sequence, first_position: int, hidden: torch.Tensor) -> None:
        """The main model's last-layer hidden states (before its final norm) of positions
        ``first_position`` on, each of whose next token is known."""
        if hidden.shape[0] == 0:
            return
        state = self._states.get(seq.seq_id)
        if state is None or first_position != state.written + state.num_pending:
            state = self._states[seq.seq_id] = _MTPState(first_position, first_position)  # (re)start
        state.pending.append(hidden)
        state.num_pending += hidden.shape[0]
        if state.num_pending > self.max_pending_rows:
            rows = torch.cat(state.pending)[-self.max_pending_rows :]
            first = state.written + state.num_pending - rows.shape[0]
            self._states[seq.seq_id] = _MTPState(first, first, [], [rows], rows.shape[0])

    def forget(self, seq: Sequence) -> None:
        self._states.pop(seq.seq_id, None)

    @property
    def num_tracked(self) -> int:
        return len(self._states)

    # --- drafting -----------------------------------------------------------------------------
    @torch.inference_mode()
    def draft(self, seq: Sequence, k: int) -> list[int]:
        """Up to ``k`` greedy MTP drafts after ``seq``'s tokens ([] without fresh hidden states)."""
        state = self._states.get(seq.seq_id)
        last = len(seq.token_ids) - 1  # the newest token's position: its hidden is not known yet
        if k <= 0 or state is None or state.num_pending == 0 or state.written + state.num_pending != last:
            return []
        with self._on_device():
            return self._draft(seq, state, last, k)

    def _draft(self, seq: Sequence, state: _MTPState, last: int, k: int) -> list[int]:
        out = self._write_pending(seq, state)
        drafts = [int(self.mtp.compute_logits(out, self.main).argmax(-1))]
        if k > 1:
            table = self._chain_table(seq, last + k - 1)
            for j in range(1, k):  # step j: draft j at position last - 1 + j, after h' of step j - 1
                out = self._step(state.start, [last - 1 + j], [drafts[-1]], out, table)
                drafts.append(int(self.mtp.compute_logits(out, self.main).argmax(-1)))
        return drafts

    @torch.inference_mode()
    def catch_up(self, seq: Sequence) -> None:
        """Write the entries of a sequence that does not draft this step (backing off, or in a
        batch too large to draft) once ``catch_up_rows`` hidden states wait: its context stays
        whole, and its waiting hidden states stay few."""
        state = self._states.get(seq.seq_id)
        if state is not None and state.num_pending >= self.catch_up_rows:
            with self._on_device():
                self._write_pending(seq, state)

    def _on_device(self):
        """The engine's GPU for this thread's kernels (Triton launches on the current device)."""
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    def _write_pending(self, seq: Sequence, state: _MTPState) -> torch.Tensor:
        """Write the MTP entries of the waiting hidden states (each with its next token); h'
        of the last one."""
        if self._blocks(seq, state.start, state.written) != state.blocks:
            state.start = state.written  # its entries' blocks changed (copy-on-write): restart
        end = state.written + state.num_pending
        positions = list(range(state.written, end))
        hidden = self.main.norm(torch.cat(state.pending))
        tokens = seq.token_ids[state.written + 1 : end + 1]
        out = self._step(state.start, positions, tokens, hidden, list(seq.block_table))
        state.written, state.pending, state.num_pending = end, [], 0
        state.blocks = self._blocks(seq, state.start, end)
        return out

    def _step(
        self, start: int, positions: list[int], tokens: list[int], prev_hidden: torch.Tensor, table: list[int]
    ) -> torch.Tensor:
        """One MTP forward over ``positions`` (their entries written, attending to
        [start, position]); h' of the last row [1, H]."""
        bs = self.block_size
        end = positions[-1] + 1
        pos = torch.tensor(positions, dtype=torch.int64, device=self.device)
        ids = lambda values: torch.tensor(values, dtype=torch.int64, device=self.device)  # noqa: E731
        meta = MLAMetadata(
            is_prompt=True,
            slot_blocks=ids([table[p // bs] for p in positions]),
            slot_offsets=ids([p % bs for p in positions]),
            prefill_seqs=[MLASeq(0, len(positions), end, ids(table[: -(-end // bs)]), context_start=start)],
        )
        embeds = self.main.embed_tokens(ids(tokens))
        cos, sin = self.main.rotary.cos_sin(pos, embeds.dtype)
        keep = ids([len(positions) - 1])
        return self.mtp(embeds, prev_hidden, cos, sin, self.kv, meta, keep_rows=keep)

    def _chain_table(self, seq: Sequence, end: int) -> list[int]:
        """The sequence's blocks, then scratch blocks up to position ``end`` - 1."""
        table = list(seq.block_table)
        missing = -(-end // self.block_size) - len(table)
        return table + self.scratch[: max(0, missing)]

    def _blocks(self, seq: Sequence, start: int, end: int) -> list[int]:
        if end <= start:
            return []
        return list(seq.block_table[start // self.block_size : -(-end // self.block_size)])
