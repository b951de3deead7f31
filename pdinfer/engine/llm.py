"""The offline batch API: ``LLM().generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence as SequenceABC
from typing import TYPE_CHECKING

from pdinfer.chat import CHAT_ROLES, template_role
from pdinfer.config import EngineArgs
from pdinfer.engine.heap import startup_objects_frozen
from pdinfer.engine.llm_engine import LLMEngine
from pdinfer.outputs import RequestOutput
from pdinfer.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pdinfer.distributed.dp_client import DPEngineClient

logger = logging.getLogger("pdinfer")

_batch_ids = itertools.count()


class LLM:
    """``LLM()`` loads the embedded default model; ``LLM(model=path, **engine_args)`` another."""

    def __init__(self, model: str | None = None, **kwargs):
        args = EngineArgs(model=model, **kwargs)
        self.engine: LLMEngine | DPEngineClient
        if args.data_parallel_size > 1:  # rank processes behind a DP front, same results
            from pdinfer.distributed.dp_client import DPEngineClient

            self.engine = DPEngineClient(args)
        else:
            self.engine = LLMEngine(args)
        self.tokenizer = self.engine.tokenizer

    def generate(
        self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None, use_tqdm: bool = True
    ) -> list[RequestOutput]:
        """One ``RequestOutput`` per prompt, in order. A prompt is text or
        ``{"prompt_token_ids": [...]}``. Bad input raises ``ValueError`` before anything runs;
        a prompt the scheduler refuses (too long) comes back with ``.error`` set."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, SequenceABC) or not prompts:
            raise ValueError("prompts must be a non-empty list of prompts")
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        for prompt, p in zip(prompts, params):  # validate everything before adding anything
            if not isinstance(p, SamplingParams):
                raise ValueError(f"sampling_params must be SamplingParams (or a list of them), got {type(p).__name__}")
            self.engine.tokenize(prompt)
            p.verify()
        batch = next(_batch_ids)
        ids = [f"llm-{batch}-{i}" for i in range(len(prompts))]
        added = []
        try:
            for request_id, prompt, p in zip(ids, prompts, params):
                self.engine.add_request(request_id, prompt, p)  # may still refuse (a bad grammar)
                added.append(request_id)
        except BaseException:
            for request_id in added:  # none of the batch runs: nothing left behind in the engine
                self.engine.abort_request(request_id)
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """``messages``: one conversation (a list of {"role", "content"}) or a list of them."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so no chat template")
        if not isinstance(messages, list) or not messages:
            raise ValueError('messages must be a list of {"role", "content"} (or a list of such lists)')
        conversations = [messages] if isinstance(messages[0], dict) else messages
        prompts = []
        for conversation in conversations:
            _check_conversation(conversation)
            conversation = [{**m, "role": template_role(m["role"])} for m in conversation]
            text = self.tokenizer.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=add_generation_prompt
            )
            ids = self.tokenizer(text, add_special_tokens=False).input_ids
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        from tqdm import tqdm

        wanted = set(ids)
        final: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Generating", unit="req", disable=not use_tqdm, dynamic_ncols=True)
        try:
            with startup_objects_frozen():  # no full collections over the model's objects
                while self.engine.has_unfinished_requests():
                    for output in self.engine.step(finished_only=True):
                        if output.finished and output.request_id in wanted and output.request_id not in final:
                            final[output.request_id] = output
                            bar.update(1)
                            if output.error:
                                logger.warning("request %s: %s", output.request_id, output.error)
        except BaseException:
            for request_id in wanted - final.keys():
                self.engine.abort_request(request_id)
            raise
        finally:
            bar.close()
        return [final[i] for i in ids]


def _check_conversation(conversation) -> None:
    """A conversation is a non-empty list of {"role", "content"} with OpenAI's roles."""
    if not isinstance(conversation, list) or not conversation:
        raise ValueError('messages must be a list of {"role", "content"} (or a list of such lists)')
    for i, message in enumerate(conversation):
        if not isinstance(message, dict) or message.get("role") not in CHAT_ROLES:
            raise ValueError(f"messages[{i}] must be a dict whose role is one of {', '.join(CHAT_ROLES)}")
