"""Sampling on the device, with no host sync but the sampled tokens.

Order of processing: penalties (repetition, then frequency/presence), temperature, top-k, top-p
(on the top-k-renormalized distribution), min-p. Randomness is counter-based: the uniform
number of vocabulary entry v for a token at position p of a request with seed s is a hash of
(s, p, v), and the token is drawn by an exponential race (argmax p_v / E_v, E_v = -log u_v),
which picks v with probability exactly p_v. So a seeded request gives the same tokens whatever
else is in the batch, on any engine role.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

_MASK32 = 0xFFFFFFFF
_MIX = 0x45D9F3B
_GOLDEN = 0x9E3779B1


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix on int64 tensors; products stay below 2**63 (no overflow)."""
    return _hash32_(x.clone())


def _hash32_(x: torch.Tensor) -> torch.Tensor:
    """``hash32`` in place: one temporary the size of ``x`` at a time."""
    for _ in range(2):
        x ^= x >> 16
        x *= _MIX
        x &= _MASK32
    x ^= x >> 16
    return x


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """u[i, v] in (0, 1), a pure function of (seeds[i], positions[i], v)."""
    row = hash32(hash32(seeds & _MASK32) ^ (positions & _MASK32))
    vocab = (torch.arange(vocab_size, device=seeds.device, dtype=torch.int64) * _GOLDEN) & _MASK32
    h = _hash32_(row[:, None] ^ vocab[None, :])
    # 23 bits: (k + 0.5) / 2**23 is exact in float32, so u < 1 and -log(u) > 0 (with 24 bits
    # the top value rounds to 1.0, and p / -log(u) becomes inf, or NaN for a filtered token).
    return (h >> 9).to(torch.float32).add_(0.5).mul_(1.0 / (1 << 23))


@dataclass
class SamplingTensors:
    """Per-row sampling settings of one step, already on the device."""

    temperatures: torch.Tensor  # [S] float (0 = greedy)
    top_k: torch.Tensor  # [S] int64 (vocab size = off)
    top_p: torch.Tensor  # [S] float
    min_p: torch.Tensor  # [S] float
    seeds: torch.Tensor  # [S] int64
    positions: torch.Tensor  # [S] int64: position of the token being sampled
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    # Penalties (None when no row uses them)
    presence: torch.Tensor | None = None  # [S]
    frequency: torch.Tensor | None = None  # [S]
    repetition: torch.Tensor | None = None  # [S]
    output_tokens: torch.Tensor | None = None  # [S, Lo] int64, -1 padded
    prompt_tokens: torch.Tensor | None = None  # [S, Lp] int64, -1 padded
    max_logprobs: int = -1  # -1: none requested; else top-k logprobs to return
    # Structured outputs: rows whose next token is constrained, and their allowed-token bit sets
    mask_rows: torch.Tensor | None = None  # [M] int64
    masks: torch.Tensor | None = None  # [M, ceil(V / 32)] int32
    # logit_bias entries, flattened: logits[bias_rows[i], bias_ids[i]] += bias_values[i]
    bias_rows: torch.Tensor | None = None
    bias_ids: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [S] int64
    logprobs: torch.Tensor | None = None  # [S] logprob of the sampled token
    top_ids: torch.Tensor | None = None  # [S, k]
    top_logprobs: torch.Tensor | None = None  # [S, k]
    # Prompt log-probs (``score_prompt``), one row per ``StepInput.prompt_rows`` entry
    prompt_logprobs: torch.Tensor | None = None  # [P] of the prompt token
    prompt_ranks: torch.Tensor | None = None  # [P] its rank: tokens at least as likely
    prompt_top_ids: torch.Tensor | None = None  # [P, k]
    prompt_top_logprobs: torch.Tensor | None = None  # [P, k]


# Prompt log-probs take the logits of this many rows at a time: a long prompt's full-vocabulary
# logits would otherwise be its length times the vocabulary (and a sampling step's are smaller).
PROMPT_LOGPROB_ROWS = 256


def score_prompt(compute_logits, hidden: torch.Tensor, targets: torch.Tensor, top_k: int, out: SamplerOutput) -> None:
    """Fill ``out``'s prompt fields: the log-prob and rank of ``targets[i]`` under the logits of
    ``hidden[i]`` (raw logits: no penalty, bias or temperature, as vLLM reports them), and the
    ``top_k`` most likely tokens; on the device, without a host sync."""
    logprobs, ranks, top_ids, top_logprobs = [], [], [], []
    for h, t in zip(hidden.split(PROMPT_LOGPROB_ROWS), targets.split(PROMPT_LOGPROB_ROWS)):
        rows = torch.log_softmax(compute_logits(h), dim=-1, dtype=torch.float32)
        chosen = rows.gather(1, t[:, None])
        logprobs.append(chosen.squeeze(1))
        ranks.append((rows >= chosen).sum(dim=-1))
        if top_k > 0:
            values, ids = rows.topk(min(top_k, rows.shape[-1]), dim=-1)
            top_logprobs.append(values)
            top_ids.append(ids)
    out.prompt_logprobs, out.prompt_ranks = torch.cat(logprobs), torch.cat(ranks)
    if top_k > 0:
        out.prompt_top_ids, out.prompt_top_logprobs = torch.cat(top_ids), torch.cat(top_logprobs)


class Sampler:
    def __call__(self, logits: torch.Tensor, t: SamplingTensors) -> SamplerOutput:
        """Tokens (and log-probs where asked) from ``logits`` [S, V] in any float dtype. A
        greedy step with nothing to report and nothing changing the logits takes their argmax
        as they are (exact in any dtype, first maximum on ties); anything else runs in float32."""
        plain = t.max_logprobs < 0 and t.bias_rows is None and t.masks is None and t.presence is None
        if t.all_greedy and plain:
            return SamplerOutput(token_ids=logits.argmax(dim=-1))
        logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1) if t.max_logprobs >= 0 else None
        logits = apply_constraints(logits, t)
        if t.presence is not None:
            logits = apply_penalties(logits, t)
        if t.all_greedy:
            tokens = logits.argmax(dim=-1)
        else:
            tokens = torch.where(t.temperatures == 0, logits.argmax(dim=-1), sample_rows(logits, t))
        out = SamplerOutput(token_ids=tokens)
        if raw_logprobs is not None:
            out.logprobs = raw_logprobs.gather(1, tokens[:, None]).squeeze(1)
            if t.max_logprobs > 0:
                # never more than the vocabulary (a tiny model's may be under SamplingParams' bound)
                k = min(t.max_logprobs, raw_logprobs.shape[-1])
                out.top_logprobs, out.top_ids = raw_logprobs.topk(k, dim=-1)
        return out


def apply_constraints(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """logit_bias, then the structured-output masks (a masked token stays out whatever its
    bias). Log-probs are reported from the logits before both, as OpenAI and vLLM do."""
    if t.bias_rows is not None:
        assert t.bias_ids is not None and t.bias_values is not None
        logits = logits.index_put((t.bias_rows, t.bias_ids), t.bias_values.to(logits.dtype), accumulate=True)
    if t.masks is not None:
        assert t.mask_rows is not None
        logits = apply_token_bitmask(logits, t.mask_rows, t.masks)
    return logits


def constraint_tensors(samples, device: torch.device) -> dict[str, torch.Tensor]:
    """The ``SamplingTensors`` fields of logit_bias and structured-output masks (none if no row
    has either)."""
    out: dict[str, torch.Tensor] = {}
    masked = [(i, s.allowed) for i, s in enumerate(samples) if s.allowed is not None]
    if masked:
        out["mask_rows"] = torch.tensor([i for i, _ in masked], dtype=torch.int64, device=device)
        out["masks"] = torch.stack([m for _, m in masked]).to(device)
    biased = [(i, tid, v) for i, s in enumerate(samples) if s.logit_bias for tid, v in s.logit_bias.items()]
    if biased:
        rows, ids, values = zip(*biased)
        out["bias_rows"] = torch.tensor(rows, dtype=torch.int64, device=device)
        out["bias_ids"] = torch.tensor(ids, dtype=torch.int64, device=device)
        out["bias_values"] = torch.tensor(values, dtype=torch.float32, device=device)
    return out


def apply_penalties(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Repetition penalty over prompt and output (as in transformers / vLLM), then
    OpenAI-style frequency and presence penalties over the output."""
    # The input builders set all five penalty tensors together.
    assert t.output_tokens is not None and t.prompt_tokens is not None and t.repetition is not None
    assert t.frequency is not None and t.presence is not None
    vocab = logits.shape[-1]
    counts = _token_counts(t.output_tokens, vocab)
    seen = (counts > 0) | (_token_counts(t.prompt_tokens, vocab) > 0)
    rep = t.repetition[:, None]
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    logits = logits - t.frequency[:, None] * counts
    return logits - t.presence[:, None] * (counts > 0).to(logits.dtype)


def _token_counts(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    counts = torch.zeros(tokens.shape[0], vocab + 1, dtype=torch.float32, device=tokens.device)
    index = torch.where(tokens < 0, vocab, tokens)  # padding counts into a spare column
    counts.scatter_add_(1, index, torch.ones_like(index, dtype=torch.float32))
    return counts[:, :vocab]


# Vocabulary entries filtered and sampled at a time. Rows are independent, so a large batch is
# sampled in row chunks: the sort, its workspace and the noise take about ten float32 copies of
# what they cover, which for 256 rows of a 128k vocabulary (1.25 GiB) was the largest buffer of
# a decode step, and so cost a COMPLETION engine its KV blocks.
SAMPLE_CHUNK_ENTRIES = 1 << 23


def sample_rows(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Each row's token drawn from its filtered distribution by the seeded exponential race."""
    num_rows, vocab = logits.shape
    rows = max(1, SAMPLE_CHUNK_ENTRIES // max(1, vocab))
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    for start in range(0, num_rows, rows):
        part = slice(start, start + rows)
        sub = t if rows >= num_rows else _rows_of(t, part)
        probs = filtered_probs(logits[part], sub)
        probs /= -torch.log(uniform_noise(sub.seeds, sub.positions, vocab))
        out[part] = probs.argmax(dim=-1)
    return out


def _rows_of(t: SamplingTensors, part: slice) -> SamplingTensors:
    """What ``filtered_probs`` and the noise read, for the rows in ``part``."""
    return replace(
        t,
        temperatures=t.temperatures[part],
        top_k=t.top_k[part],
        top_p=t.top_p[part],
        min_p=t.min_p[part],
        seeds=t.seeds[part],
        positions=t.positions[part],
    )


def filtered_probs(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """The distribution each row samples from, after temperature and the top-k/top-p/min-p filters."""
    temperature = torch.where(t.temperatures == 0, torch.ones_like(t.temperatures), t.temperatures)
    logits = logits / temperature[:, None]
    if t.any_top_k or t.any_top_p:
        logits = _top_k_top_p(logits, t)
    probs = torch.softmax(logits, dim=-1)
    if t.any_min_p:
        threshold = t.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = torch.where(probs < threshold, torch.zeros_like(probs), probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def _top_k_top_p(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Filters ``logits`` (a tensor of the caller's own) in place: at most one vocabulary-sized
    temporary besides the sort's."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    if t.any_top_k:
        kth = sorted_logits.gather(1, (t.top_k.clamp(1, vocab) - 1)[:, None])
        sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    if t.any_top_p:
        probs = torch.softmax(sorted_logits, dim=-1)
        before = probs.cumsum(dim=-1).sub_(probs)  # mass of strictly better tokens
        del probs
        # top_p = 1 is off: rounding must not let the cumulative mass reach it early.
        drop = before >= t.top_p[:, None]
        del before
        drop[:, 0] = False
        drop &= (t.top_p < 1.0)[:, None]
        sorted_logits.masked_fill_(drop, float("-inf"))
    return logits.fill_(float("-inf")).scatter_(1, order, sorted_logits)


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """``logits`` with every token outside ``masks`` (int32 words, bit i of word w = token
    32w + i) set to -inf in the given rows."""
    bits = torch.arange(32, device=masks.device, dtype=torch.int32)
    allowed = ((masks[:, :, None] >> bits) & 1).to(torch.bool).reshape(masks.shape[0], -1)
    allowed = allowed[:, : logits.shape[-1]]
    sub = logits[rows].masked_fill(~allowed, float("-inf"))
    return logits.index_put((rows,), sub)
