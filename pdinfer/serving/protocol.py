"""OpenAI-compatible request models, their mapping to ``SamplingParams``, and the error shape.

Fields marked "extra" are not in OpenAI's API; names follow vLLM's (``top_k``, ``ignore_eos`` ...).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from pdinfer.chat import ChatRole, template_role
from pdinfer.sampling_params import SamplingParams
from pdinfer.serving.errors import APIError, bad_request

MAX_LOGPROBS = 20
MAX_N = 16
# A body is read as OpenAI reads it: a field it does not know is refused, not ignored (its sender
# meant something by it), and a value of the wrong JSON type is refused, not converted
# (``"n": "2"``, ``true`` as a token id).
_STRICT = ConfigDict(extra="forbid", strict=True)
# Fields other servers take that pdinfer does not: the 400 says so plainly.
_NOT_SUPPORTED = {
    "truncate_prompt_tokens": "send a prompt that fits the context",
    "echo": "echo is only available on /v1/completions",
    "best_of": "best_of is only available on /v1/completions",
    "suffix": "suffix is only available on /v1/completions",
    "chat_template_kwargs": "the model's own chat template is applied as it is",
    "audio": "this server produces text only",
    "modalities": "this server produces text only",
    "prediction": "predicted outputs are not supported",
    "reasoning_effort": "this model does not reason before answering",
    "web_search_options": "this server has no web search",
}


def validation_error(errors) -> APIError:
    """One 400 from pydantic's errors; ``param`` is the top-level field that failed."""
    by_field: dict[str, list[dict]] = {}
    for err in errors:
        if err.get("type") == "json_invalid":
            return bad_request(f"the body is not valid JSON: {err.get('ctx', {}).get('error', '')}")
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        if not loc and err.get("type") == "missing":
            return bad_request("the request has no body: send a JSON object")
        if err.get("type") == "extra_forbidden" and len(loc) == 1:  # OpenAI's answer too
            hint = _NOT_SUPPORTED.get(loc[0])
            message = f"unrecognized request argument: {loc[0]}" + (f" ({hint})" if hint else "")
            return bad_request(message, param=loc[0], code="unknown_parameter")
        by_field.setdefault(loc[0] if loc else "", []).append({**err, "loc": loc})
    problems = []
    for name, errs in by_field.items():
        if name == "prompt" and len(errs) > 1:  # no member of its union fits, at any depth
            problems.append(f"prompt: {_PROMPT_SHAPES}")
            continue
        if len(errs) > 1 and all(len(e["loc"]) == 2 for e in errs):  # no member of a union fits
            allowed = ", ".join(e["loc"][1] for e in errs)
            got = type(errs[0].get("input")).__name__
            problems.append(f"{name}: got {got}, expected one of: {allowed}")
            continue
        for e in errs:
            where = ".".join(e["loc"])
            problems.append(f"{where}: {e.get('msg')}" if where else str(e.get("msg")))
    param = next(iter(by_field), None) or None
    return bad_request("; ".join(problems) or "invalid request", param=param)


_PROMPT_SHAPES = "expected a string, a list of token ids (integers), a list of strings, or a list of lists of token ids"
_SCALARS = frozenset({int, float, bool, type(None)})


def lone_surrogate_at(body: Any) -> tuple[str, ...] | None:
    """The path to the first string of ``body`` (parsed JSON) that holds a lone UTF-16 surrogate
    (for a key: the path to its object), or None. JSON's ``\\ud800`` escape parses to one, and no
    UTF-8 encoder takes it: not the tokenizer, not the router's JSON encoder."""
    stack: list[tuple[tuple[str, ...], Any]] = [((), body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if not _is_unicode(value):
                return path
        elif isinstance(value, dict):
            for key, item in value.items():
                if not _is_unicode(str(key)):
                    return path
                stack.append(((*path, str(key)), item))
        elif isinstance(value, list) and not set(map(type, value)) <= _SCALARS:  # token ids: skip fast
            stack.extend(((*path, str(i)), item) for i, item in enumerate(value))
    return None


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False
    continuous_usage_stats: bool = False  # extra (vLLM): with include_usage, usage in every chunk


class _GenerationRequest(BaseModel):
    """The fields /v1/completions and /v1/chat/completions share. ``None`` means the default."""

    model_config = _STRICT
    PROMPT_FIELD: ClassVar[str] = "prompt"

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extra
    min_p: float | None = None  # extra
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # extra
    seed: int | None = None
    min_tokens: int | None = None  # extra (vLLM's)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # extra
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # extra
    skip_special_tokens: bool = True  # extra
    include_stop_str_in_output: bool = False  # extra
    return_token_ids: bool = False  # extra (vLLM's name): each choice also carries "token_ids"
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # extra (vLLM's); shape: prompt_echo.py
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None  # extra (vLLM's name): json/regex/choice/grammar
    # Accepted and refused unless they change nothing: silently ignoring them would answer
    # something else than what was asked.
    tools: list[Any] | None = None  # chat only (serving/tools.py)
    tool_choice: Any = None
    functions: list[Any] | None = None  # OpenAI's deprecated form of tools: refused
    function_call: Any = None
    use_beam_search: bool = False  # extra (vLLM)
    # vLLM's older names for structured_outputs' json, regex, choice and grammar
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # Accepted without effect on the output: who asks (user, metadata), OpenAI's storage and tier.
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        path = lone_surrogate_at(data)
        if path is not None:  # anywhere, ignored fields included: OpenAI refuses such a body too
            where = ".".join(path)[:200] or "the body"
            raise bad_request(
                f"{where}: the text is not valid Unicode (a lone UTF-16 surrogate such as \\ud800)",
                param=path[0] if path else None,
            )
        return data

    def _structured(self) -> dict[str, Any] | None:
        """``response_format`` (OpenAI) or ``structured_outputs`` (vLLM) as the engine's spec."""
        if self.functions or self.function_call is not None:
            raise bad_request(
                "functions and function_call are not supported: use tools and tool_choice",
                param="functions" if self.functions else "function_call",
                code="not_supported",
            )
        if self.use_beam_search:
            raise bad_request("beam search is not supported", param="use_beam_search", code="not_supported")
        fmt = self.response_format
        spec, given = self.structured_outputs, ["structured_outputs"] if self.structured_outputs is not None else []
        for kind in _GUIDED:
            value = getattr(self, f"guided_{kind}")
            if value is not None:
                spec = {kind: value}
                given.append(f"guided_{kind}")
        if fmt is not None and fmt.get("type") != "text":
            given.insert(0, "response_format")
        if len(given) > 1:
            raise bad_request(f"give one of {', '.join(given)}: they are all output constraints", param=given[0])
        if fmt is None or fmt.get("type") == "text":
            return spec
        if fmt.get("type") == "json_object":
            return {"json_object": True}
        if fmt.get("type") == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise bad_request("response_format.json_schema.schema must be a JSON schema", param="response_format")
            return {"json": schema}
        raise bad_request(
            f"response_format.type must be text, json_object or json_schema, got {fmt.get('type')!r}",
            param="response_format",
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def _sampling_params(
        self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None
    ) -> SamplingParams:
        if not 1 <= self.n <= MAX_N:
            raise bad_request(f"n must be in [1, {MAX_N}], got {self.n}", param="n")
        if self.prompt_logprobs is not None and self.stream:  # vLLM's rule: a chunk has no place for them
            raise bad_request("prompt_logprobs are not available with stream=true", param="prompt_logprobs")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed with stream=true", param="stream_options")
        values: dict[str, Any] = {
            "n": self.n,
            "max_tokens": max_tokens,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "seed": self.seed,
            "ignore_eos": self.ignore_eos,
            "logprobs": logprobs,
            "prompt_logprobs": prompt_logprobs,
            "skip_special_tokens": self.skip_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "logit_bias": self.logit_bias,
            "structured_outputs": self._structured(),
        }
        for name in (
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "min_tokens",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ):
            if getattr(self, name) is not None:
                values[name] = getattr(self, name)
        try:
            return SamplingParams(**values)
        except ValueError as exc:
            raise bad_request(str(exc), param=self.param_of(str(exc))) from None

    def param_of(self, message: str, default: str | None = None) -> str | None:
        """The field of this request that a sampling or engine error names, as the request
        spelled it (``structured_outputs`` may have come as response_format or guided_json);
        else ``default``, else the field that holds the prompt."""
        param = param_named(message)
        if param == "structured_outputs" and self.structured_outputs is None:
            given = [f"guided_{k}" for k in _GUIDED if getattr(self, f"guided_{k}") is not None]
            param = given[0] if given else "response_format"
            if param == "response_format" and self.response_format is None:
                param = "tool_choice"  # a forced tool call: its parameters' schema constrains the output
        return param or default or self.PROMPT_FIELD


def param_named(message: str) -> str | None:
    """The sampling parameter an error message is about: its first word (``logit_bias keys must
    ...``), or its second after "invalid" (``invalid structured_outputs.regex: ...``)."""
    words = message.split(" ", 2)
    first = words[1 if words[0] == "invalid" and len(words) > 1 else 0].split(".", 1)[0]
    return first if first in _PARAM_NAMES else None


_PARAM_NAMES = {f.name for f in dataclasses.fields(SamplingParams)}
_GUIDED = ("json", "regex", "choice", "grammar")


class CompletionRequest(_GenerationRequest):
    # text, token ids, or a batch of either
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def sampling_params(self) -> SamplingParams:
        if self.tools is not None or self.tool_choice is not None:
            raise bad_request("tools are only available on /v1/chat/completions", param="tools")
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of other than n is not supported", param="best_of", code="not_supported")
        if self.suffix:
            raise bad_request("suffix is not supported", param="suffix")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise bad_request(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}", param="logprobs")
        # echo: the prompt leads each choice, with its tokens' log-probs when logprobs is set;
        # max_tokens 0 (echo only) scores the prompt: one token is sampled and not shown.
        prompt_logprobs = self.prompt_logprobs
        if self.echo and self.logprobs is not None:
            prompt_logprobs = max(prompt_logprobs or 0, self.logprobs)
        max_tokens = 1 if self.scoring_only else self.max_tokens
        return self._sampling_params(max_tokens, self.logprobs, prompt_logprobs)

    @property
    def scoring_only(self) -> bool:
        """echo with max_tokens 0: the answer is the prompt alone (OpenAI's scoring idiom)."""
        return self.echo and self.max_tokens == 0

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt of the batch: text or token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise bad_request("prompt is empty", param="prompt")
        if isinstance(prompt[0], int):
            return [list(prompt)]  # type: ignore[arg-type]
        return list(prompt)  # type: ignore[arg-type]


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    # Extra fields are allowed: clients send an assistant message back as they got it
    # (``refusal``, ``annotations``, ``audio`` null ...).
    model_config = ConfigDict(extra="allow", strict=True)
    role: ChatRole  # developer goes to the template as system
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's result: the call it answers

    def as_template_input(self, template_knows_tool_calls: bool = True) -> dict[str, Any]:
        """The message as chat templates take it: text content; earlier calls with their
        arguments as objects (templates write them with ``tojson``), or, for a template that
        ignores calls, written into the content in the Hermes format."""
        content = self.content
        if isinstance(content, list):
            if any(part.type != "text" for part in content):
                raise bad_request("only text content parts are supported", param="messages")
            content = "".join(part.text or "" for part in content)
        message: dict[str, Any] = {"role": template_role(self.role), "content": content or ""}
        if self.name:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            calls = [_template_call(call) for call in self.tool_calls]
            if template_knows_tool_calls:
                message["tool_calls"] = calls
            else:
                from pdinfer.serving.tools import hermes_call_text

                message["content"] = "\n".join(filter(None, [message["content"], hermes_call_text(calls)]))
        return message


def _template_call(call: Any) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad_request(
            'messages: a tool call must be {"id", "type": "function", "function": {"name", "arguments"}}',
            param="messages",
        )
    arguments = fn.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            raise bad_request(
                f"messages: the arguments of the call to {fn['name']!r} are not JSON", param="messages"
            ) from None
    return {
        "id": call.get("id"),
        "type": "function",
        "function": {"name": fn["name"], "arguments": arguments if arguments is not None else {}},
    }


class ChatCompletionRequest(_GenerationRequest):
    PROMPT_FIELD: ClassVar[str] = "messages"
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True  # extra
    parallel_tool_calls: bool | None = None

    _tools: Any = PrivateAttr(default=None)  # tool_request's answer, once checked
    _tools_checked: bool = PrivateAttr(default=False)

    def tool_request(self):
        """The checked tool fields (``serving.tools.ToolRequest``), or None without tools; the
        sampling parameters, the prompt and the response all ask, the check runs once."""
        from pdinfer.serving.tools import ToolRequest

        if not self._tools_checked:
            self._tools = ToolRequest.from_body(self.tools, self.tool_choice, self.parallel_tool_calls)
            self._tools_checked = True
        return self._tools

    def _structured(self) -> dict[str, Any] | None:
        spec = super()._structured()
        tools = self.tool_request()
        if tools is None or not tools.forced:
            return spec
        if spec is not None:
            raise bad_request(
                f"tool_choice {self.tool_choice!r} already constrains the output: "
                "it cannot be combined with response_format or structured_outputs",
                param="tool_choice",
            )
        return tools.structured_outputs()

    def sampling_params(self) -> SamplingParams:
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise bad_request("top_logprobs needs logprobs=true", param="top_logprobs")
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise bad_request(
                    f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {self.top_logprobs}", param="top_logprobs"
                )
        for i, message in enumerate(self.messages):
            if message.role == "tool" and not message.tool_call_id:
                raise bad_request(f"messages[{i}]: a tool message needs the tool_call_id it answers", param="messages")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        if self.max_completion_tokens is not None:  # OpenAI's newer name wins; None: up to the context
            if self.max_completion_tokens < 1:
                raise bad_request(
                    f"max_completion_tokens must be at least 1, got {self.max_completion_tokens}",
                    param="max_completion_tokens",
                )
            return self._sampling_params(self.max_completion_tokens, logprobs, self.prompt_logprobs)
        return self._sampling_params(self.max_tokens, logprobs, self.prompt_logprobs)


# --- responses (plain dicts: cheaper than models on the streaming path) -----------------------------
def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def model_card(name: str, created: int, max_model_len: int | None, root: str | None = None) -> dict[str, Any]:
    """``max_model_len`` None: not known yet (a router before any engine reported it); ``root``:
    the model it was loaded from (vLLM's field), the served name by default."""
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "pdinfer",
        "root": root or name,
        "parent": None,
        "max_model_len": max_model_len,
    }


def one_model(cards: list[dict[str, Any]], model_id: str) -> dict[str, Any]:
    """``GET /v1/models/{id}``: the card, or a 404 in OpenAI's shape."""
    for card in cards:
        if card["id"] == model_id:
            return card
    raise APIError(404, f"the model {model_id!r} does not exist", param="model", code="model_not_found")


def version() -> dict[str, str]:
    from pdinfer import __version__

    return {"version": __version__}
