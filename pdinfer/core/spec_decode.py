"""Speculative decoding on the host: the drafter interface, the n-gram drafter, the draft pool
and the acceptance rule (pure Python and NumPy, no torch; the scheduler and the output
processor call it).

A decode step verifies a sequence's k drafts in one forward: it carries 1 + k tokens (the last
known token, then the drafts) and samples all 1 + k rows. Row i samples the token at the
position of draft i + 1, exactly as a plain decode step would sample it there (same logits up
to float rounding, same (seed, position)-keyed noise). The output is the longest prefix of
drafts that equals the sampled tokens, then the first sampled token that differs (or the bonus
token after the last draft): 1 to k + 1 tokens a step.

This is the standard rejection rule for a point-mass draft q (accept x with probability
min(1, p(x) / q(x)) = p(x), else draw from p with x removed and renormalised), because the
sampler draws by an exponential race over (seed, position)-keyed noise: the race's winner is x
with probability p(x), and given that it is not x, it is any other v with probability
p(v) / (1 - p(x)). So the output keeps the target distribution exactly, greedy output is the
argmax chain, and a seeded request draws the same tokens with and without speculation (see
docs/usage.md for what "the same" promises).
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from pdinfer.sequence import Sequence

# Steps of more decoding sequences than this draft nothing (``DraftPool.max_batch``): there every
# extra row costs about what a sequence's row does, on the CPU and the GPU alike
# (docs/performance.md#measurements-behind-design-choices), and a plain step keeps zero-overhead
# scheduling's overlap.
MAX_DRAFT_BATCH = 16


def max_verify_rows(max_num_seqs: int, num_draft_tokens: int, max_batch: int = MAX_DRAFT_BATCH) -> int:
    """Rows of the largest verifying step: the largest batch that drafts, each sequence with
    1 + k rows (what the CUDA graphs of a drafting engine must cover)."""
    return min(max_num_seqs, max_batch) * (1 + num_draft_tokens)


class Drafter(Protocol):
    """Proposes up to ``k`` tokens that may follow ``seq``'s tokens (prompt and output so far).

    A drafter that reads the target model's hidden states (MTP, ``worker/mtp_drafter.py``) sets
    ``needs_hidden_states``: the engine then hands it every step's last-layer hidden states of
    the positions whose next token is known (``observe``), and ``catch_up`` lets it absorb them
    for a sequence that does not draft this step. ``forget`` drops what it keeps for a
    sequence that left the engine."""

    needs_hidden_states: bool

    def draft(self, seq: Sequence, k: int) -> list[int]: ...

    def observe(self, seq: Sequence, first_position: int, hidden: Any) -> None: ...

    def catch_up(self, seq: Sequence) -> None: ...

    def forget(self, seq: Sequence) -> None: ...


class NgramDrafter:
    """Prompt lookup: find the sequence's last n tokens earlier in its prompt + output and
    propose the k tokens that followed them there.

    n goes from ``max_n`` down to ``min_n`` (3..1 by default): a longer match predicts better,
    a shorter one still finds something in repetitive text. Among matches of one n the latest
    that still has k tokens after it wins (recent text predicts best), else the latest one.
    """

    needs_hidden_states = False

    def __init__(self, max_n: int = 3, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.max_n, self.min_n = max_n, min_n

    def draft(self, seq: Sequence, k: int) -> list[int]:
        return self.propose(seq.token_ids, k)

    def observe(self, seq: Sequence, first_position: int, hidden: Any) -> None:
        pass

    def catch_up(self, seq: Sequence) -> None:
        pass

    def forget(self, seq: Sequence) -> None:
        pass

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        length = len(token_ids)
        if k <= 0 or length < self.min_n + 1:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            starts = length - n  # candidate windows start at 0 .. length - n - 1
            match = tokens[:starts] == tokens[length - n]
            for j in range(1, n):
                match &= tokens[j : starts + j] == tokens[length - n + j]
            found = np.flatnonzero(match)
            if found.size == 0:
                continue
            full = found[found <= length - n - k]
            start = int(full[-1] if full.size else found[-1]) + n
            return token_ids[start : start + k]
        return []


def num_accepted(drafts: list[int], sampled: list[int]) -> int:
    """How many drafts the step accepts: the longest prefix where draft i equals the token row i
    sampled (``sampled`` has one more row than ``drafts``: the bonus token's)."""
    accepted = 0
    for draft, token in zip(drafts, sampled):
        if draft != token:
            break
        accepted += 1
    return accepted


class DraftPool:
    """The engine's drafting state: one slot per running request (``max_num_seqs`` slots;
    DeepInfer's MTP information pool, which only NORMAL and COMPLETION engines build), the
    drafter, and the back-off.

    Per sequence, a step drafts one token more than the last step accepted (at most k), so
    rows are not spent on drafts that keep failing. Back-off: after ``miss_limit`` steps in a row that drafted nothing or had no
    draft accepted, the sequence stops drafting for ``pause`` steps; each further miss run
    doubles the pause (up to ``max_pause``), an accepted draft resets it. Drafting costs a
    1 + k-token forward and, with zero-overhead scheduling, the overlap of that step, so text
    that does not repeat soon decodes as without speculation.
    """

    def __init__(
        self,
        drafter: Drafter,
        num_slots: int,
        num_draft_tokens: int,
        miss_limit: int = 2,
        first_pause: int = 4,
        max_pause: int = 64,
        max_batch: int = MAX_DRAFT_BATCH,
    ):
        if num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1 to speculate, got {num_draft_tokens}")
        self.drafter = drafter
        self.num_slots = num_slots
        self.num_draft_tokens = num_draft_tokens
        self.miss_limit, self.first_pause, self.max_pause = miss_limit, first_pause, max_pause
        self.max_batch = max_batch  # steps of more sequences draft nothing (MAX_DRAFT_BATCH)
        self._free_slots = list(range(num_slots - 1, -1, -1))
        self._misses = [0] * num_slots  # steps in a row without an accepted draft
        self._pause = [0] * num_slots  # steps left without drafting
        self._next_pause = [first_pause] * num_slots
        self._k = [num_draft_tokens] * num_slots  # drafts to propose next
        # counters (engine stats)
        self.num_draft_steps = 0  # sequence-steps that verified drafts
        self.num_drafted_tokens = 0
        self.num_accepted_tokens = 0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_drafted_tokens if self.num_drafted_tokens else 0.0

    def stats(self) -> dict[str, float]:
        return {
            "draft_steps": self.num_draft_steps,
            "drafted_tokens": self.num_drafted_tokens,
            "accepted_tokens": self.num_accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
        }

    def drafts_at(self, num_seqs: int) -> bool:
        """Whether a step of ``num_seqs`` decoding sequences drafts at all."""
        return num_seqs <= self.max_batch

    def wants_to_draft(self, seq: Sequence) -> bool:
        """Whether ``seq`` would draft at its next step (before its tokens are looked at).
        Constrained sequences never draft: their drafts would have to go through the grammar."""
        if seq.grammar is not None:
            return False
        return seq.draft_slot < 0 or self._pause[seq.draft_slot] == 0

    def propose(self, seq: Sequence, max_tokens: int) -> list[int]:
        """Drafts for ``seq``'s next step (at most ``max_tokens``); needs all its tokens known."""
        k = min(self.num_draft_tokens, max_tokens)
        if k <= 0 or seq.grammar is not None:
            return []
        if seq.draft_slot >= 0 and self._pause[seq.draft_slot] > 0:
            self._pause[seq.draft_slot] -= 1  # backing off: a plain decode step
            self.drafter.catch_up(seq)
            return []
        if seq.num_pending_tokens:  # its last token is in flight: nothing to look up yet
            return []
        if seq.draft_slot < 0:
            if not self._free_slots:
                return []
            seq.draft_slot = self._free_slots.pop()
            self._misses[seq.draft_slot], self._pause[seq.draft_slot] = 0, 0
            self._next_pause[seq.draft_slot] = self.first_pause
            self._k[seq.draft_slot] = self.num_draft_tokens
        drafts = self.drafter.draft(seq, min(k, self._k[seq.draft_slot]))
        if not drafts:
            self._record_miss(seq.draft_slot)
        return drafts

    def record(self, seq: Sequence, num_drafted: int, accepted: int) -> None:
        self.num_draft_steps += 1
        self.num_drafted_tokens += num_drafted
        self.num_accepted_tokens += accepted
        if seq.draft_slot < 0:
            return
        slot = seq.draft_slot
        # Draft one more than were accepted (all taken: one more than drafted, up to k).
        self._k[slot] = min(self.num_draft_tokens, accepted + 1)
        if accepted:
            self._misses[slot] = 0
            self._next_pause[slot] = self.first_pause
        else:
            self._record_miss(seq.draft_slot)

    def _record_miss(self, slot: int) -> None:
        self._misses[slot] += 1
        if self._misses[slot] >= self.miss_limit:
            self._misses[slot] = 0
            self._pause[slot] = self._next_pause[slot]
            self._next_pause[slot] = min(2 * self._next_pause[slot], self.max_pause)

    @property
    def needs_hidden_states(self) -> bool:
        return self.drafter.needs_hidden_states

    def observe(self, seq: Sequence, first_position: int, hidden: Any) -> None:
        """A step's hidden states of ``seq`` from ``first_position`` on (hidden-state drafters).
        Constrained sequences never draft: nothing is kept for them."""
        if seq.grammar is None:
            self.drafter.observe(seq, first_position, hidden)

    def skip(self, seq: Sequence) -> None:
        """``seq`` decodes without drafts this step (its batch is too large to draft)."""
        self.drafter.catch_up(seq)

    def release(self, seq: Sequence) -> None:
        """Give ``seq``'s slot back (it finished, was preempted or freed); idempotent."""
        self.drafter.forget(seq)
        if seq.draft_slot >= 0:
            self._free_slots.append(seq.draft_slot)
            seq.draft_slot = -1
        seq.draft_token_ids = []
