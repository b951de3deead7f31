"""The error a rank raises when a peer of its process group failed (DP vote, EP all-to-all)."""

from __future__ import annotations


class DPGroupError(RuntimeError):
    """A collective of the DP group failed: a peer died, or did not answer within the timeout."""
