"""Tool calling over HTTP, the same checks against `serve` (test_api_server.py) and through the
P/D router (test_router.py): the real openai SDK and LangChain's ``bind_tools``. The reference
for arguments is ``jsonschema`` against each tool's own parameters."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from conftest import MODEL

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, ADD]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def streamed_calls(stream) -> tuple[str, list[dict], list[str | None]]:
    """Content, calls and finish reasons of a stream, merged as a client merges deltas."""
    content, calls, finishes = "", {}, []
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = call["id"] or delta.id
                call["name"] += (delta.function.name or "") if delta.function else ""
                call["arguments"] += (delta.function.arguments or "") if delta.function else ""
            if choice.finish_reason:
                finishes.append(choice.finish_reason)
    return content, [calls[i] for i in sorted(calls)], finishes


def check_valid(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def check_forced_choices(client: openai.OpenAI) -> None:
    """A named function and "required": the grammar makes every call one of the tools with
    arguments its schema accepts, whole and streamed, sampled with n = 2."""
    named = {"type": "function", "function": {"name": "add"}}
    out = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=40, temperature=0
    )
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "stop" and not message.content
    [call] = message.tool_calls
    assert call.type == "function" and call.function.name == "add" and call.id.startswith("call_")
    check_valid("add", call.function.arguments)
    stream = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=40, temperature=0, stream=True
    )
    content, calls, finishes = streamed_calls(stream)
    assert content == "" and finishes == ["stop"] and len(calls) == 1
    assert calls[0]["name"] == "add" and calls[0]["arguments"] == call.function.arguments  # greedy: the same

    out = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=60,
        n=2,
        temperature=0.9,
        seed=4,
    )
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls", choice
        assert len(choice.message.tool_calls) == 1
        check_valid(choice.message.tool_calls[0].function.name, choice.message.tool_calls[0].function.arguments)
    stream = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=80, temperature=0, stream=True
    )
    content, calls, finishes = streamed_calls(stream)
    assert finishes == ["tool_calls"] and calls and content == ""
    for call in calls:
        assert call["id"].startswith("call_")
        check_valid(call["name"], call["arguments"])


def check_auto_reads_the_calls_the_model_writes(client: openai.OpenAI) -> None:
    """With "auto" the output is parsed; the model is made to write a Hermes call (a regex on
    its raw text), then plain text: the first comes back as a call, the second as content."""
    city = "[A-Z][a-z]{1,10}"
    hermes = r'Sure\. <tool_call>\n\{"name": "get_weather", "arguments": \{"city": "' + city + r'"\}\}\n</tool_call>'
    extra = {"structured_outputs": {"regex": hermes}}
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=60, temperature=0, extra_body=extra)
    out = client.chat.completions.create(**kwargs)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure. "
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    check_valid("get_weather", call.function.arguments)
    content, calls, finishes = streamed_calls(client.chat.completions.create(**kwargs, stream=True))
    assert (content, finishes) == ("Sure. ", ["tool_calls"])
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", call.function.arguments)]

    plain = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        max_tokens=20,
        temperature=0,
        extra_body={"structured_outputs": {"regex": "No tool"}},
    )
    assert plain.choices[0].message.content == "No tool" and not plain.choices[0].message.tool_calls
    assert plain.choices[0].finish_reason == "stop", plain


def check_bad_tool_requests(client: openai.OpenAI) -> None:
    cases = [
        ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "letters, digits"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not one of the tools"),
        ({"tool_choice": "required"}, "needs tools"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "combined"),
        ({"functions": [{"name": "f"}]}, "use tools"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
                "tool_choice": "required",
            },
            "nonsense",
        ),
    ]
    for extra, problem in cases:
        with pytest.raises(openai.BadRequestError, match=problem):
            client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, extra_body=extra)


def check_langchain_round_trip(base_url: str, api_key: str) -> None:
    """LangChain's ``bind_tools``: the model calls the tool, the result goes back as a tool
    message, the model answers; streamed calls merge to the same call."""
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return f"Sunny and 21 C in {city}."

    llm = ChatOpenAI(base_url=base_url, api_key=api_key, model=MODEL, temperature=0, max_tokens=30, max_retries=0)
    bound = llm.bind_tools([get_weather], tool_choice="get_weather")
    history = [HumanMessage("What is the weather in Paris?")]
    ai = bound.invoke(history)
    [call] = ai.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"].get("city"), str) and call["id"]
    history += [ai, ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])]
    answer = llm.bind_tools([get_weather]).invoke(history)
    assert answer.content or answer.tool_calls  # the model's own words: something came back
    merged = None
    for chunk in bound.stream([HumanMessage("What is the weather in Paris?")]):
        merged = chunk if merged is None else merged + chunk
    assert [(c["name"], c["args"]) for c in merged.tool_calls] == [(call["name"], call["args"])]


def check_langchain_structured_output(base_url: str, api_key: str) -> None:
    """LangChain's ``with_structured_output``, both ways it asks: a JSON schema in
    ``response_format`` and a forced function call. The answer must parse into the model class,
    which validates it (pydantic is the reference)."""
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=12)
        country: str = Field(max_length=12)

    llm = ChatOpenAI(base_url=base_url, api_key=api_key, model=MODEL, temperature=0, max_tokens=60, max_retries=0)
    for method in ("json_schema", "function_calling"):
        answer = llm.with_structured_output(City, method=method).invoke("Name a city and its country.")
        assert isinstance(answer, City), (method, answer)
