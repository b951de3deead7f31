"""The P/D wire protocol between the router and the engines (JSON over HTTP).

    router -> CE  POST /pd/decode   {request_id, prompt_token_ids, sampling}
                  SSE: first event {"reservation": {...}}, then {"outputs": [...deltas], ...}
                  503 at once when the CE has no room (back-pressure: pick another CE)
    router -> PE  POST /pd/prefill  {request_id, prompt_token_ids, sampling, reservation}
                  200 {"first_tokens": [...], "handoff_s": x} once the CE confirmed the K/V;
                  4xx/5xx with an OpenAI-shaped error otherwise

Sampling parameters travel as a dict of ``SamplingParams`` fields, rebuilt and validated on
arrival; the reservation as the CE produced it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pydantic import BaseModel, Field

from pdinfer.engine.pd_common import Reservation
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
    request_id: str = Field(min_length=1, max_length=256)
    prompt_token_ids: list[int] = Field(min_length=1)
    sampling: dict[str, Any] = Field(default_factory=dict)


class PrefillRequest(DecodeRequest):
    reservation: dict[str, Any]

    def parsed_reservation(self) -> Reservation:
        return Reservation(**self.reservation)


def reservation_to_dict(reservation: Reservation) -> dict[str, Any]:
    return {name: getattr(reservation, name) for name in reservation.__struct_fields__}


def output_delta(index: int, text: str, token_ids: list[int], logprobs, finish_reason) -> dict[str, Any]:
    entry: dict[str, Any] = {"index": index, "text": text, "token_ids": token_ids, "finish_reason": finish_reason}
    if logprobs is not None:
        entry["logprobs"] = [{str(k): v for k, v in d.items()} for d in logprobs]
    return entry
