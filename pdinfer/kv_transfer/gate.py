"""What a CE's KV port lets through to the engine: pushes and aborts of live reservations, from
the PE that owns them. Shared by the engine thread (which reserves and forgets) and the port's
thread (which asks about every push and abort as it arrives, busy or idle), so what no live
reservation asked for is refused at once and never waits in the inbox.

A transfer belongs to the first handshaken PE session that pushes or aborts it; nothing from
any other session touches it afterwards. Until then its transfer id (random, 128 bits, known to
the CE, the router and the chosen PE) is the capability; the cluster secret keeps anyone else
from shaking hands at all.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class _Transfer:
    request_id: str
    nbytes: int  # the K/V the reservation's prompt blocks hold
    owner: str | None = None
    pushed: bool = False


class TransferGate:
    def __init__(self, max_done: int = 4096):
        self._lock = threading.Lock()
        self._live: dict[str, _Transfer] = {}
        # Taken over by the engine: their owner may still abort the request (a PE whose lease ran out).
        self._done: OrderedDict[str, _Transfer] = OrderedDict()
        self._max_done = max_done

    # --- the engine thread ---------------------------------------------------------------------------
    def expect(self, transfer_id: str, request_id: str, nbytes: int) -> None:
        with self._lock:
            self._live[transfer_id] = _Transfer(request_id, nbytes)

    def finish(self, transfer_id: str) -> None:
        """The engine took the push over: later pushes are refused, the owner's abort still counts."""
        with self._lock:
            transfer = self._live.pop(transfer_id, None)
            if transfer is not None:
                self._done[transfer_id] = transfer
                while len(self._done) > self._max_done:
                    self._done.popitem(last=False)

    def forget(self, transfer_id: str) -> None:
        with self._lock:
            self._live.pop(transfer_id, None)
            self._done.pop(transfer_id, None)

    def is_live(self, transfer_id: str) -> bool:
        with self._lock:
            return transfer_id in self._live

    # --- the port's thread ---------------------------------------------------------------------------
    def admit_push(self, transfer_id: str, owner: str, nbytes: int) -> str | None:
        """Why a push from ``owner`` carrying ``nbytes`` is refused, or None (then it is the
        transfer's one push)."""
        with self._lock:
            transfer = self._live.get(transfer_id)
            if transfer is None:
                return f"unknown or expired transfer ({transfer_id[:64]})"
            if transfer.owner not in (None, owner):
                return "the transfer belongs to another prefill engine connection"
            if transfer.pushed:
                return "the transfer was pushed already"
            if nbytes != transfer.nbytes:
                return f"{nbytes} bytes of K/V for a reservation of {transfer.nbytes} bytes"
            transfer.owner, transfer.pushed = owner, True
            return None

    def admit_abort(self, transfer_id: str, owner: str) -> tuple[str | None, str]:
        """(why an abort from ``owner`` is refused or None, the transfer's own request id)."""
        with self._lock:
            transfer = self._live.get(transfer_id) or self._done.get(transfer_id)
            if transfer is None:
                return f"unknown or expired transfer ({transfer_id[:64]})", ""
            if transfer.owner not in (None, owner):
                return "the transfer belongs to another prefill engine connection", ""
            transfer.owner = owner
            return None, transfer.request_id
