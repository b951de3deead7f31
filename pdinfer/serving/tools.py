"""Tool calling on /v1/chat/completions: ``tools``, ``tool_choice``, ``parallel_tool_calls``.

What a request asks (``ToolRequest.from_body``), what the prompt shows the model and what is
read back from its output:

- The chat template receives the tools (``tools=``) and the history's tool calls and results.
  A template that does not use them (SmolLM2's, the default model's, ignores both) gets them
  from pdinfer instead, in the Hermes format: the tools as JSON in the system message, each
  earlier call as ``<tool_call>{"name", "arguments"}</tool_call>`` in its assistant message.
- ``tool_choice`` "auto" lets the model answer or call. Its output is parsed in the format of the
  template: Hermes (``<tool_call>`` JSON ``</tool_call>``: Qwen, Hermes, and the fallback above)
  or Llama 3's JSON (``{"name": ..., "parameters": ...}``, several joined by ``;``), picked by
  what the template writes. Text that does not parse stays content.
- "required" and a named function are enforced with the grammar engine (as vLLM does): a named
  function's output is the JSON of its ``parameters`` schema, "required"'s a JSON array of
  ``{"name", "parameters"}`` objects, one of the tools each (one item without
  ``parallel_tool_calls``).
- "none" (the default without tools) generates text; the tools are still shown to the model,
  as OpenAI does.

``finish_reason`` is "tool_calls" when "auto" or "required" produced calls and the model stopped
by itself; "stop" for a named function (OpenAI's answers). With ``parallel_tool_calls`` false,
"auto" keeps the first call only.

Streaming: a call goes out as one delta once its JSON is complete (id, name and all arguments
together), except a named function, whose arguments stream as they are generated. Content
before a call streams as it comes; text that may open a call is held back until it is known.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from pdinfer.serving.errors import bad_request

_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
MAX_TOOLS = 128

HERMES = "hermes"
LLAMA3_JSON = "llama3_json"


@dataclass
class ToolRequest:
    """The tool fields of one chat request, checked."""

    tools: list[dict[str, Any]]  # OpenAI's shape: {"type": "function", "function": {...}}
    choice: str  # "none" | "auto" | "required" | "named"
    named: str | None = None  # the function of a named choice
    parallel: bool = True

    @classmethod
    def from_body(cls, tools: list[Any] | None, tool_choice: Any, parallel: bool | None) -> ToolRequest | None:
        """None when the request has no tools and no choice that needs them."""
        checked = _check_tools(tools)
        if tool_choice is None:
            choice, named = ("auto" if checked else "none"), None
        elif isinstance(tool_choice, str):
            if tool_choice not in ("none", "auto", "required"):
                raise bad_request(
                    f"tool_choice must be none, auto, required or a function, got {tool_choice!r}",
                    param="tool_choice",
                )
            choice, named = tool_choice, None
        else:
            choice, named = "named", _named_choice(tool_choice)
        if choice in ("auto", "required", "named") and not checked:
            raise bad_request(f"tool_choice {tool_choice!r} needs tools", param="tool_choice")
        if named is not None and named not in {t["function"]["name"] for t in checked}:
            raise bad_request(f"tool_choice names {named!r}, which is not one of the tools", param="tool_choice")
        if not checked:
            return None
        return cls(checked, choice, named, parallel is not False)

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "named")

    def function(self, name: str) -> dict[str, Any]:
        return next(t["function"] for t in self.tools if t["function"]["name"] == name)

    def structured_outputs(self) -> dict[str, Any] | None:
        """The grammar that enforces "required" or a named function; None otherwise."""
        if self.choice == "named":
            return {"json": _parameters(self.function(self.named or ""))}
        if self.choice != "required":
            return None
        one_of = [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [t["function"]["name"]]},
                    "parameters": _parameters(t["function"]),
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for t in self.tools
        ]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": one_of}}
        if not self.parallel:
            schema["maxItems"] = 1
        return {"json": schema}

    def parser(self, template_format: str) -> ToolParser | None:
        """A fresh parser for one choice's output; None when the output is plain text."""
        if self.choice == "none":
            return None
        if self.choice == "named":
            return _NamedParser(self.named or "")
        if self.choice == "required":
            return _JSONCallsParser(array=True, name_keys=("name",), args_keys=("parameters",), parallel=self.parallel)
        if template_format == LLAMA3_JSON:
            return _JSONCallsParser(
                array=False, name_keys=("name",), args_keys=("parameters", "arguments"), parallel=self.parallel
            )
        return _HermesParser(self.parallel)


def _check_tools(tools: list[Any] | None) -> list[dict[str, Any]]:
    if not tools:
        return []
    if len(tools) > MAX_TOOLS:
        raise bad_request(f"at most {MAX_TOOLS} tools, got {len(tools)}", param="tools")
    checked, names = [], set()
    for i, tool in enumerate(tools):
        where = f"tools.{i}"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise bad_request(f'{where}: a tool must be {{"type": "function", "function": {{...}}}}', param="tools")
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise bad_request(
                f"{where}.function.name must be 1 to 64 letters, digits, _ or -, got {name!r}", param="tools"
            )
        if name in names:
            raise bad_request(f"{where}: two tools are named {name!r}", param="tools")
        names.add(name)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad_request(f"{where}.function.parameters must be a JSON schema object", param="tools")
        description = fn.get("description")
        if description is not None and not isinstance(description, str):
            raise bad_request(f"{where}.function.description must be a string", param="tools")
        clean: dict[str, Any] = {"name": name}
        if description is not None:
            clean["description"] = description
        clean["parameters"] = params if params is not None else {"type": "object", "properties": {}}
        checked.append({"type": "function", "function": clean})
    return checked


def _named_choice(tool_choice: Any) -> str:
    choice = tool_choice if isinstance(tool_choice, dict) else {}
    fn = choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if choice.get("type") != "function" or not isinstance(name, str):
        raise bad_request(
            'tool_choice must be none, auto, required or {"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    return name


def _parameters(fn: dict[str, Any]) -> dict[str, Any]:
    return fn.get("parameters") or {"type": "object", "properties": {}}


# --- the prompt --------------------------------------------------------------------------------------
def template_format(chat_template: str | None) -> str:
    """The tool-call format a chat template teaches its model (Hermes unless it is Llama 3's)."""
    template = chat_template or ""
    if "<tool_call>" in template:
        return HERMES
    if "<|python_tag|>" in template or "ipython" in template:
        return LLAMA3_JSON
    return HERMES


def template_knows_tools(chat_template: str | None) -> bool:
    return "tools" in (chat_template or "")


def template_knows_tool_calls(chat_template: str | None) -> bool:
    return "tool_calls" in (chat_template or "")


HERMES_SYSTEM = (
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def hermes_system_prompt(tools: list[dict[str, Any]]) -> str:
    return HERMES_SYSTEM.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))


def hermes_call_text(calls: list[dict[str, Any]]) -> str:
    """An assistant message's earlier calls as the Hermes text the model would have written."""
    parts = []
    for call in calls:
        fn = call.get("function") or {}
        payload = {"name": fn.get("name"), "arguments": fn.get("arguments")}
        parts.append("<tool_call>\n" + json.dumps(payload, ensure_ascii=False) + "\n</tool_call>")
    return "\n".join(parts)


# --- reading calls back --------------------------------------------------------------------------------
@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text


@dataclass
class ParseStep:
    """What one piece of output shows: content text and tool-call deltas in OpenAI's shape."""

    content: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)


class ToolParser:
    """Reads one choice's output, piece by piece (``feed``) then ``finish``."""

    def __init__(self) -> None:
        self.calls: list[ParsedCall] = []

    def feed(self, text: str) -> ParseStep:
        raise NotImplementedError

    def finish(self) -> ParseStep:
        raise NotImplementedError

    def _call_delta(self, name: str, arguments: str) -> dict[str, Any]:
        self.calls.append(ParsedCall(name, arguments))
        return {
            "index": len(self.calls) - 1,
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }


def _call_from_json(text: str, name_keys: tuple[str, ...], args_keys: tuple[str, ...]) -> tuple[str, str] | None:
    """(name, arguments JSON) of one call written as JSON, or None if it is not one."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    name = next((obj[k] for k in name_keys if k in obj), None)
    args: Any = next((obj[k] for k in args_keys if k in obj), {})
    if not isinstance(name, str) or not name:
        return None
    if isinstance(args, str):  # some models write the arguments as JSON text
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return name, json.dumps(args, ensure_ascii=False)


_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


class _HermesParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number, after content."""

    def __init__(self, parallel: bool):
        super().__init__()
        self.parallel = parallel
        self._buffer = ""
        self._in_call = False
        self._content_started = False

    def feed(self, text: str) -> ParseStep:
        self._buffer += text
        step = ParseStep()
        while True:
            if self._in_call:
                end = self._buffer.find(_CLOSE)
                if end < 0:
                    return step
                body, self._buffer = self._buffer[:end], self._buffer[end + len(_CLOSE) :]
                self._in_call = False
                self._take_call(body, step)
                continue
            start = self._buffer.find(_OPEN)
            if start >= 0:
                self._content(self._buffer[:start], step)
                self._buffer = self._buffer[start + len(_OPEN) :]
                self._in_call = True
                continue
            keep = _partial_suffix(self._buffer, _OPEN)
            self._content(self._buffer[: len(self._buffer) - keep], step)
            self._buffer = self._buffer[len(self._buffer) - keep :]
            return step

    def finish(self) -> ParseStep:
        step = ParseStep()
        if self._in_call:  # cut short (max_tokens): what came is not a call
            self._content(_OPEN + self._buffer, step, force=True)
        else:
            self._content(self._buffer, step)
        self._buffer = ""
        self._in_call = False
        return step

    def _take_call(self, body: str, step: ParseStep) -> None:
        parsed = _call_from_json(body.strip(), ("name",), ("arguments", "parameters"))
        if parsed is None:
            self._content(_OPEN + body + _CLOSE, step, force=True)
        elif self.parallel or not self.calls:
            step.calls.append(self._call_delta(*parsed))

    def _content(self, text: str, step: ParseStep, force: bool = False) -> None:
        if not self._content_started:  # leading whitespace waits for something visible
            text = text.lstrip() if not force else text
            if not text:
                return
            self._content_started = True
        if self.calls and not force and not text.strip():
            return  # whitespace between calls
        step.content += text


class _JSONCallsParser(ToolParser):
    """Calls written as JSON: one object or several joined by ``;`` (Llama 3), or a JSON array of
    them (the grammar of "required"). Output that does not start like JSON is content."""

    def __init__(self, array: bool, name_keys: tuple[str, ...], args_keys: tuple[str, ...], parallel: bool):
        super().__init__()
        self.array = array
        self.name_keys, self.args_keys = name_keys, args_keys
        self.parallel = parallel
        self._raw = ""  # everything seen
        self._mode: str | None = None  # None: undecided; "json"; "content"
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._object_start = -1

    def feed(self, text: str) -> ParseStep:
        step = ParseStep()
        if self._mode == "content":
            step.content = text
            return step
        start = len(self._raw)
        self._raw += text
        if self._mode is None:
            head = self._raw.lstrip()
            if not head:
                return step
            opener = "[" if self.array else "{"
            if head[0] != opener:
                self._mode = "content"
                step.content = self._raw
                return step
            self._mode = "json"
        self._scan(start, step)
        return step

    def finish(self) -> ParseStep:
        step = ParseStep()
        if self._mode == "json" and not self.calls:
            step.content = self._raw  # not calls after all, or cut short before the first ended
        return step  # after a call, a broken or unfinished rest is dropped (it was never shown)

    def _scan(self, start: int, step: ParseStep) -> None:
        base = 1 if self.array else 0  # the depth at which a call object opens
        for i in range(start, len(self._raw)):
            ch = self._raw[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
                continue
            if ch == '"':
                self._in_string = True
            elif ch in "{[":
                if self._depth == base and ch == "{":
                    self._object_start = i
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == base and ch == "}" and self._object_start >= 0:
                    parsed = _call_from_json(self._raw[self._object_start : i + 1], self.name_keys, self.args_keys)
                    self._object_start = -1
                    if parsed is not None and (self.parallel or not self.calls):
                        step.calls.append(self._call_delta(*parsed))


class _NamedParser(ToolParser):
    """The whole output is the arguments of one named function (its grammar made it so)."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name
        self._started = False

    def feed(self, text: str) -> ParseStep:
        step = ParseStep()
        if not self._started:
            self._started = True
            step.calls.append(self._call_delta(self.name, text))
        elif text:
            self.calls[0].arguments += text
            step.calls.append({"index": 0, "function": {"arguments": text}})
        return step

    def finish(self) -> ParseStep:
        return self.feed("") if not self._started else ParseStep()


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag`` (held back: it may open it)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


def parse_whole(parser: ToolParser, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """A finished output's content (None if empty) and its calls, in a message's shape."""
    first, last = parser.feed(text), parser.finish()
    content = first.content + last.content
    calls = [
        {"id": d["id"], "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c, d in zip(parser.calls, [*first.calls, *last.calls])
    ]
    return (content or None), calls
