"""Which failure of a DP group generation is its cause, whatever order the front sees them in.

When one rank dies, its peers' next collective fails and they exit too, often before the dead
rank's exit is visible to the front. Every event is recorded as either a *cause* (a rank killed
by a signal, a rank that failed on its own, a group that never started) or a *suspect* (a rank
whose collective failed, a rank that exited with a code, a rank gone silent or unreachable). A
cause replaces a suspect; the first of each kind wins among its kind. A cause is acted on at
once; a suspect only after ``grace_s``, so the cause it is a consequence of can still arrive.
"""

from __future__ import annotations

import signal


def exit_reason(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"


class FailureCause:
    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self.reason: str | None = None
        self.is_suspect = False
        self._since_s = 0.0
        self._peer_failed: set[int] = set()  # ranks whose collective failed, this generation

    def new_generation(self) -> None:
        self._peer_failed = set()

    def rank_failed(self, rank: int, error: str, peer: bool, now: float) -> None:
        """A rank's own report: ``peer`` when a collective failed (a peer is the likely cause)."""
        if peer:
            self._peer_failed.add(rank)
        self.record(f"DP rank {rank} failed: {error}", now, suspect=peer)

    def rank_exited(self, rank: int, returncode: int, now: float) -> None:
        """A signal is a cause. An exit with a code is a suspect: the rank may have exited
        because a peer died, its report still in flight; its own report upgrades it."""
        suspect = rank in self._peer_failed or returncode > 0
        self.record(f"DP rank {rank} {exit_reason(returncode)}", now, suspect=suspect)

    def record(self, reason: str, now: float, suspect: bool = False) -> None:
        if self.reason is None or (self.is_suspect and not suspect):
            self.reason, self.is_suspect, self._since_s = reason, suspect, now

    def take(self, now: float) -> str | None:
        """The reason to act on now (and forget), or None: nothing failed, or only a suspect
        younger than the grace period."""
        if self.reason is None or (self.is_suspect and now - self._since_s < self.grace_s):
            return None
        reason, self.reason = self.reason, None
        return reason
