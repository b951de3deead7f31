"""Drive a prefill engine and a completion engine together in one process.

The same protocol as across processes (reserve on the CE, prefill and push on the PE, decode on
the CE), for tests, notebooks and the P/D benchmarks: ``PDPair(LLMEngine(pe_args),
LLMEngine(ce_args))``, whose args name the PROMPT and COMPLETION roles and the same connector
(the in-process one or a networked one). The pair uses only what every engine has (``admit``).
"""

from __future__ import annotations

import itertools

from pdinfer.engine.llm_engine import LLMEngine
from pdinfer.outputs import RequestOutput, Resume
from pdinfer.sampling_params import SamplingParams

_ids = itertools.count()


class PDPair:
    def __init__(self, pe: LLMEngine, ce: LLMEngine):
        if pe.engine_type.handoff_side != "prefill" or ce.engine_type.handoff_side != "decode":
            raise ValueError("a P/D pair is a PROMPT engine and a COMPLETION engine")
        self.pe, self.ce = pe, ce
        self.errors: dict[str, RequestOutput] = {}
        self._prompt_logprobs: dict[str, list] = {}  # from the PE (which prefills) to the CE's outputs

    def add_request(self, request_id: str, prompt, params: SamplingParams, resume: Resume | None = None) -> None:
        """Reserve on the CE first (raises NoRoomError when it is full), then prefill on the PE.
        ``resume``: a migrated request's output, continued from its tokens."""
        reservation = self.ce.admit(request_id, prompt, params, resume=resume)  # the CE's reservation
        try:
            self.pe.admit(request_id, prompt, params, reservation=reservation, resume=resume)
        except Exception:
            self.ce.abort_request(request_id)
            raise

    def abort_request(self, request_id: str) -> None:
        self.pe.abort_request(request_id)
        self.ce.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.pe.has_unfinished_requests() or self.ce.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """One step of each engine; returns the CE's outputs and the PE's failures."""
        outputs = []
        for out in self.pe.step():
            if out.prompt_logprobs is not None:
                self._prompt_logprobs[out.request_id] = out.prompt_logprobs
            if out.finished and out.error:
                self.errors[out.request_id] = out
                self._prompt_logprobs.pop(out.request_id, None)
                outputs.append(out)
        for out in self.ce.step():
            out.prompt_logprobs = self._prompt_logprobs.get(out.request_id)
            if out.finished:
                self._prompt_logprobs.pop(out.request_id, None)
            outputs.append(out)
        return outputs

    def generate(self, prompts, params: SamplingParams) -> list[RequestOutput]:
        batch = next(_ids)
        ids = [f"pd-{batch}-{i}" for i in range(len(prompts))]
        for request_id, prompt in zip(ids, prompts):
            self.add_request(request_id, prompt, params)
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished_requests():
            for out in self.step():
                if out.finished and out.request_id in ids:
                    final.setdefault(out.request_id, out)
        return [final[i] for i in ids]
