"""The P/D wire protocol between the router and the engines (JSON over HTTP).

    router -> CE  POST /pd/decode   {request_id, prompt_token_ids, sampling, resume?}
                  SSE: first event {"reservation": {...}}, then {"outputs": [...deltas], ...};
                  the last has "finished": true, and "migrate": why, when the CE gave the
                  request up for another engine to continue (out of blocks, drained)
                  503 at once when the CE has no room (back-pressure: pick another CE)
    router -> PE  POST /pd/prefill  {request_id, prompt_token_ids, sampling, resume?, reservation}
                  200 {"first_tokens": [...], "handoff_s": x} once the CE confirmed the K/V
                  (with "prompt_logprobs": ``PromptLogprobs`` as a list when they were asked);
                  4xx/5xx with an OpenAI-shaped error otherwise

Sampling parameters travel as a dict of ``SamplingParams`` fields, rebuilt and validated on
arrival; the reservation as the CE produced it. ``resume`` (``outputs.Resume``): a migrated
request, the output it continues and the tokens its client has of it. The CE's stream events are typed
(``DecodeEvent``): the router decodes each once with msgspec, straight into what it relays.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec
from pydantic import BaseModel, ConfigDict, Field

from pdinfer.engine.pd_common import Reservation
from pdinfer.outputs import PromptLogprobs, Resume
from pdinfer.sampling_params import SamplingParams

_FIELDS = [f.name for f in dataclasses.fields(SamplingParams) if f.init]


def sampling_to_dict(params: SamplingParams) -> dict[str, Any]:
    return {name: getattr(params, name) for name in _FIELDS}


def sampling_from_dict(values: dict[str, Any]) -> SamplingParams:
    unknown = set(values) - set(_FIELDS)
    if unknown:
        raise ValueError(f"unknown sampling fields: {sorted(unknown)}")
    return SamplingParams(**values)


class DecodeRequest(BaseModel):
    # As strict as the client API: a field it does not know, or a value of another JSON type
    # (``true`` as a token id), is a 400, never converted.
    model_config = ConfigDict(extra="forbid", strict=True)

    request_id: str = Field(min_length=1, max_length=256)
    prompt_token_ids: list[int] = Field(min_length=1)
    sampling: dict[str, Any] = Field(default_factory=dict)
    resume: dict[str, Any] | None = None

    def parsed_resume(self) -> Resume | None:
        """The resume, every field of its declared type (ValueError otherwise)."""
        if self.resume is None:
            return None
        try:
            return msgspec.convert(self.resume, Resume)
        except msgspec.ValidationError as exc:
            raise ValueError(f"invalid resume: {exc}") from None


class PrefillRequest(DecodeRequest):
    reservation: dict[str, Any]

    def parsed_reservation(self) -> Reservation:
        """The reservation, every field of its declared type (ValueError otherwise). Building the
        Struct directly checks no types, and a wrong one surfaced only in the engine core's typed
        decode, which cannot answer the request: it hung."""
        try:
            return msgspec.convert(self.reservation, Reservation)
        except msgspec.ValidationError as exc:
            raise ValueError(str(exc)) from None


def reservation_to_dict(reservation: Reservation) -> dict[str, Any]:
    return {name: getattr(reservation, name) for name in reservation.__struct_fields__}


class OutputDelta(msgspec.Struct):
    """What one output of a request gained since the CE's last event (never cumulative)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[dict[int, float]] | None = None


class DecodeEvent(msgspec.Struct):
    """One event of a CE's /pd/decode stream: the reservation first, then outputs."""

    reservation: dict[str, Any] | None = None
    outputs: list[OutputDelta] = []
    finished: bool = False
    error: str | None = None
    migrate: str | None = None  # the CE gave the request up for another to continue: why


_event_encoder = msgspec.json.Encoder()
_event_decoder = msgspec.json.Decoder(DecodeEvent)


def encode_event(event: DecodeEvent) -> bytes:
    return b"data: " + _event_encoder.encode(event) + b"\n\n"


def prompt_logprobs_of(answer: Any) -> PromptLogprobs | None:
    """The prompt log-probs of a PE's /pd/prefill answer; ``ValueError`` for a malformed one."""
    if not isinstance(answer, dict):
        raise ValueError("the prefill engine's answer is not a JSON object")
    value = answer.get("prompt_logprobs")
    if value is None:
        return None
    try:
        return msgspec.convert(value, PromptLogprobs)
    except msgspec.ValidationError as exc:
        raise ValueError(f"malformed prompt_logprobs from the prefill engine: {exc}") from None


def decode_event(data: bytes | str) -> DecodeEvent:
    """One ``data:`` payload of a CE stream; ``ValueError`` for anything else."""
    try:
        return _event_decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise ValueError(f"a malformed /pd/decode event: {exc}") from None
