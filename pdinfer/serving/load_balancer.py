"""The router's load balancers: which CE decodes a request, which PE prefills it, and whether a
NORMAL engine takes it instead. Pure Python: the router tells them what it routed and when it
finished (``Assignment``), and the health checker flips ``Engine.healthy``.

Decode (CE). Candidates are the healthy CEs in the order (fewest in-flight requests, fewest KV
tokens, least recently picked). KV tokens are what the router routed there and has not seen
finish: prompt + generated tokens of each request. The router tries the candidates in order; a CE
that answers 503 (no room) is skipped, and when all refuse the router waits and tries again
(back-pressure).

Prefill (PE). A prompt of L tokens falls in the context bucket b: L < 512, < 2048, < 8192, or
longer (long prompts cost more per token, so each bucket is balanced on its own).
  load_b(pe)  = uncached prompt tokens of bucket-b requests routed to pe whose prefill has not
                returned yet;
  cached(pe)  = tokens of the longest prefix of the prompt, in whole 16-token blocks, whose
                chained block hashes (``chain_hash`` from ``ROOT_HASH``) are in pe's LRU set of
                the hashes of prompts routed there, as many as the PE has KV blocks (an
                estimate of its prefix cache);
  least       = argmin over healthy PEs of (load_b, total queued tokens, least recently picked);
  holder      = argmax of cached (ties: lower load_b);
  pick holder if cached(holder) > 0 and load_b(holder) <= load_b(least) + tolerance
  (``prefix_tolerance_tokens``, default 2048), else least. The pick is charged L - cached.

NORMAL. When NORMAL engines are configured, a request whose prompts total at most
``normal_max_prompt_tokens`` goes to a NORMAL engine (as does any request while no PE/CE pair is
healthy): the one with the fewest in-flight requests, then the fewest routed tokens.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Container
from dataclasses import dataclass, field

from pdinfer.core.block_manager import ROOT_HASH, chain_hashes

BLOCK_SIZE_TOKENS = 16
BUCKET_BOUNDS_TOKENS = (512, 2048, 8192)  # bucket i holds prompts shorter than bound i
DEFAULT_PREFIX_TOLERANCE_TOKENS = 2048
DEFAULT_PREFIX_CAPACITY_BLOCKS = 1 << 16  # hashes remembered per PE


def bucket_of(num_tokens: int) -> int:
    return next((i for i, bound in enumerate(BUCKET_BOUNDS_TOKENS) if num_tokens < bound), len(BUCKET_BOUNDS_TOKENS))


def block_hashes(token_ids: list[int], block_size: int = BLOCK_SIZE_TOKENS) -> list[bytes]:
    """Chained hashes of the full blocks of ``token_ids`` (the engines' prefix-cache keys)."""
    return chain_hashes(ROOT_HASH, token_ids, block_size)


class PrefixIndex:
    """An LRU set of block hashes: which prefixes an engine has probably cached."""

    def __init__(self, capacity_blocks: int = DEFAULT_PREFIX_CAPACITY_BLOCKS, block_size: int = BLOCK_SIZE_TOKENS):
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self.block_size = block_size
        self._hashes: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._hashes)

    def cached_tokens(self, hashes: list[bytes]) -> int:
        num_blocks = 0
        for h in hashes:  # a chained hash implies its whole prefix: stop at the first miss
            if h not in self._hashes:
                break
            num_blocks += 1
        return num_blocks * self.block_size

    def add(self, hashes: list[bytes]) -> None:
        for h in hashes:
            self._hashes[h] = None
            self._hashes.move_to_end(h)
        self._trim()

    def resize(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._trim()

    def _trim(self) -> None:
        while len(self._hashes) > self.capacity_blocks:
            self._hashes.popitem(last=False)


@dataclass
class Engine:
    """One engine as the router sees it."""

    url: str
    role: str  # "prefill", "decode" or "normal"
    healthy: bool = False
    max_model_len: int | None = None  # from its /v1/models, once admitted
    in_flight: int = 0
    kv_tokens: int = 0
    queued_tokens: list[int] = field(default_factory=lambda: [0] * (len(BUCKET_BOUNDS_TOKENS) + 1))
    last_pick: int = 0
    prefix: PrefixIndex | None = None
    last_heard_s: float = float("-inf")  # monotonic time of the last bytes its streams sent us
    num_steps: int = 0  # its engine's step count, from its last health check
    last_stepped_s: float = float("-inf")  # monotonic time a health check first saw num_steps grow

    @property
    def total_queued_tokens(self) -> int:
        return sum(self.queued_tokens)


class Assignment:
    """What one request put on one engine; ``release`` (idempotent) takes it off again."""

    def __init__(self, engine: Engine, tokens: int, bucket: int | None = None):
        self.engine, self.tokens, self.bucket = engine, tokens, bucket
        self.released = False
        engine.in_flight += 1
        self._charge(tokens)

    def add_tokens(self, num_tokens: int) -> None:
        if not self.released:
            self.tokens += num_tokens
            self._charge(num_tokens)

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.engine.in_flight -= 1
            self._charge(-self.tokens)

    def _charge(self, num_tokens: int) -> None:
        if self.bucket is None:
            self.engine.kv_tokens += num_tokens
        else:
            self.engine.queued_tokens[self.bucket] += num_tokens


class _Balancer:
    _picks = itertools.count(1)  # one clock for all balancers: "least recently picked"

    def __init__(self, engines: list[Engine]):
        self.engines = engines

    def healthy(self, exclude: Container[str] = frozenset()) -> list[Engine]:
        return [e for e in self.engines if e.healthy and e.url not in exclude]

    def _stamp(self, engine: Engine) -> None:
        engine.last_pick = next(self._picks)


class DecodeBalancer(_Balancer):
    """Fewest in-flight requests, then fewest KV tokens."""

    def candidates(self, exclude: Container[str] = frozenset()) -> list[Engine]:
        return sorted(self.healthy(exclude), key=lambda e: (e.in_flight, e.kv_tokens, e.last_pick))

    def assign(self, engine: Engine, num_tokens: int) -> Assignment:
        self._stamp(engine)
        return Assignment(engine, num_tokens)


class NormalBalancer(DecodeBalancer):
    """NORMAL engines: the same order as CEs (they prefill too, but route short prompts)."""


class PrefillBalancer(_Balancer):
    """Queued uncached prompt tokens per context bucket, with a preference for cached prefixes."""

    def __init__(
        self,
        engines: list[Engine],
        prefix_tolerance_tokens: int = DEFAULT_PREFIX_TOLERANCE_TOKENS,
        prefix_capacity_blocks: int = DEFAULT_PREFIX_CAPACITY_BLOCKS,
    ):
        super().__init__(engines)
        if prefix_tolerance_tokens < 0:
            raise ValueError(f"prefix_tolerance_tokens must be >= 0, got {prefix_tolerance_tokens}")
        self.prefix_tolerance_tokens = prefix_tolerance_tokens
        for engine in engines:
            engine.prefix = PrefixIndex(prefix_capacity_blocks)

    def pick(self, token_ids: list[int], exclude: Container[str] = frozenset()) -> Assignment | None:
        """Choose a PE for this prompt and charge it; None when no PE is healthy."""
        engines = self.healthy(exclude)
        if not engines:
            return None
        b, hashes = bucket_of(len(token_ids)), block_hashes(token_ids)
        cached = {e.url: _prefix_of(e).cached_tokens(hashes) for e in engines}
        least = min(engines, key=lambda e: (e.queued_tokens[b], e.total_queued_tokens, e.last_pick))
        holder = max(engines, key=lambda e: (cached[e.url], -e.queued_tokens[b]))
        chosen = least
        if cached[holder.url] > 0 and holder.queued_tokens[b] <= least.queued_tokens[b] + self.prefix_tolerance_tokens:
            chosen = holder
        self._stamp(chosen)
        _prefix_of(chosen).add(hashes)
        return Assignment(chosen, len(token_ids) - cached[chosen.url], bucket=b)


def _prefix_of(engine: Engine) -> PrefixIndex:
    if engine.prefix is None:  # PrefillBalancer gives each of its engines one
        raise RuntimeError(f"prefill engine {engine.url} has no prefix index")
    return engine.prefix
