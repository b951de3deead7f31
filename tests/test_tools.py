"""Tool calling's pieces without a server (issue 25, item 2): what ``tools`` and ``tool_choice``
ask, what the prompt shows the model, and how outputs are read back. The expectations are
written by hand from OpenAI's shapes and the Hermes and Llama 3 formats; every parser is fed
the same text whole and one character at a time, and must read the same calls. The HTTP round
trips (openai SDK, LangChain) are in test_api_server.py and test_router.py."""

from __future__ import annotations

import json

import jsonschema
import pydantic
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdinfer.serving import tools
from pdinfer.serving.frontend import PromptBuilder
from pdinfer.serving.protocol import APIError, ChatCompletionRequest

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


def request(tool_choice=None, parallel=None, tool_list=(WEATHER, ADD)) -> tools.ToolRequest:
    made = tools.ToolRequest.from_body(list(tool_list), tool_choice, parallel)
    assert made is not None
    return made


def run(parser: tools.ToolParser, text: str, by_char: bool) -> tuple[str, list[tuple[str, dict]]]:
    """Content and (name, arguments) of each call, fed whole or one character at a time, the
    streamed deltas merged the way a client merges them (by index; arguments concatenated)."""
    pieces = list(text) if by_char else [text]
    steps = [parser.feed(p) for p in pieces] + [parser.finish()]
    content = "".join(s.content for s in steps)
    calls: dict[int, dict] = {}
    for step in steps:
        for delta in step.calls:
            call = calls.setdefault(delta["index"], {"name": "", "arguments": ""})
            if "id" in delta:
                assert delta["id"].startswith("call_") and delta["type"] == "function"
            call["name"] += delta["function"].get("name", "")
            call["arguments"] += delta["function"].get("arguments", "")
    return content, [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]


HERMES_CASES = [
    # (output, content, calls)
    ('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>', "", [("add", {"a": 1, "b": 2})]),
    (
        'Let me look.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
        '<tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call>',
        "Let me look.\n",
        [("get_weather", {"city": "Paris"}), ("add", {"a": 3, "b": 4})],
    ),
    ("Just text, with a < and a <tool in it.", "Just text, with a < and a <tool in it.", []),
    ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
    ('<tool_call>{"name": "add", "arguments": {"a": 1', '<tool_call>{"name": "add", "arguments": {"a": 1', []),
    ('<tool_call>{"name": "add", "arguments": "{\\"a\\": 5}"}</tool_call>', "", [("add", {"a": 5})]),
]


@pytest.mark.parametrize("by_char", [False, True])
@pytest.mark.parametrize("text, content, calls", HERMES_CASES)
def test_hermes_calls_are_read_whole_and_char_by_char(text, content, calls, by_char):
    assert run(request("auto").parser(tools.HERMES), text, by_char) == (content, calls)


@pytest.mark.parametrize("by_char", [False, True])
def test_llama3_json_calls_and_plain_text(by_char):
    parser = request("auto").parser(tools.LLAMA3_JSON)
    text = '{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "get_weather", "parameters": {"city": "N{Y}"}}'
    assert run(parser, text, by_char) == ("", [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "N{Y}"})])
    assert run(request("auto").parser(tools.LLAMA3_JSON), "Hello {there}", by_char) == ("Hello {there}", [])


@pytest.mark.parametrize("by_char", [False, True])
def test_required_reads_the_array_its_grammar_writes(by_char):
    text = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "add", "parameters": {"a": 2, "b": 9}}]'
    assert run(request("required").parser(tools.HERMES), text, by_char) == (
        "",
        [("get_weather", {"city": "Oslo"}), ("add", {"a": 2, "b": 9})],
    )


def test_without_parallel_calls_auto_keeps_the_first_and_required_allows_one():
    text = (
        '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
        '<tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call>'
    )
    assert run(request("auto", parallel=False).parser(tools.HERMES), text, False)[1] == [("add", {"a": 1, "b": 2})]
    llama = '{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "add", "parameters": {"a": 3, "b": 4}}'
    assert run(request("auto", parallel=False).parser(tools.LLAMA3_JSON), llama, True)[1] == [("add", {"a": 1, "b": 2})]
    schema = request("required", parallel=False).structured_outputs()["json"]
    one = [{"name": "add", "parameters": {"a": 1, "b": 2}}]
    jsonschema.validate(one, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(one * 2, schema)


def test_the_grammars_of_required_and_named_accept_only_the_tools():
    required = request("required").structured_outputs()["json"]
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "x"}}], required)
    for bad in ([], [{"name": "nope", "parameters": {}}], [{"name": "add", "parameters": {"a": "one", "b": 2}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, required)
    named = request({"type": "function", "function": {"name": "add"}})
    assert named.structured_outputs() == {"json": ADD["function"]["parameters"]}
    assert run(named.parser(tools.HERMES), '{"a": 1, "b": 2}', True) == ("", [("add", {"a": 1, "b": 2})])


@pytest.mark.parametrize(
    "tool_list, choice, problem",
    [
        ([{"type": "function"}], None, "a tool must be"),
        ([{"type": "retrieval", "function": {"name": "f"}}], None, "a tool must be"),
        ([{"type": "function", "function": {"name": "bad name!"}}], None, "letters, digits"),
        ([{"type": "function", "function": {"name": "f", "parameters": []}}], None, "JSON schema object"),
        ([WEATHER, WEATHER], None, "two tools are named"),
        ([WEATHER], "sometimes", "tool_choice must be"),
        ([WEATHER], {"type": "function", "function": {"name": "add"}}, "not one of the tools"),
        ([WEATHER], {"type": "function"}, "tool_choice must be"),
        ([WEATHER], [], "tool_choice must be"),
        (None, 7, "tool_choice must be"),
        ([], "required", "needs tools"),
    ],
)
def test_bad_tool_fields_are_refused_naming_the_problem(tool_list, choice, problem):
    with pytest.raises(APIError, match=problem) as caught:
        tools.ToolRequest.from_body(tool_list, choice, None)
    assert caught.value.status_code == 400


def test_a_forced_choice_cannot_be_combined_with_a_response_format():
    body = ChatCompletionRequest(
        messages=[{"role": "user", "content": "hi"}],
        tools=[WEATHER],
        tool_choice="required",
        response_format={"type": "json_object"},
    )
    with pytest.raises(APIError, match="cannot be combined"):
        body.sampling_params()


def test_a_template_without_tools_gets_them_in_the_system_message(tokenizer):
    """SmolLM2's template drops ``tools`` and ``tool_calls``: the prompt must still show the
    tools, the earlier call (arguments as the client sent them) and its result."""
    assert not tools.template_knows_tools(tokenizer.chat_template)
    body = ChatCompletionRequest(
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
        ],
        tools=[WEATHER],
    )
    prompt = PromptBuilder(tokenizer, None).chat(body)["prompt"]
    system = prompt.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nBe brief.\n\n") and json.dumps(WEATHER) in system
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        in (prompt)
    )
    assert "<|im_start|>tool\nSunny, 21 C<|im_end|>" in prompt
    plain = ChatCompletionRequest(messages=[{"role": "user", "content": "Weather in Paris?"}])
    assert "<tools>" not in PromptBuilder(tokenizer, None).chat(plain)["prompt"]


def test_a_template_that_knows_tools_receives_them(tokenizer):
    class Templated:
        """The default tokenizer with a template that writes tools and calls itself."""

        chat_template = (
            "{% for t in tools %}[TOOL {{ t.function.name }}]{% endfor %}"
            "{% for m in messages %}{{ m.role }}:{{ m.content }}"
            "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.arguments | tojson }}</tool_call>{% endfor %}"
            "|{% endfor %}"
        )

        def apply_chat_template(self, messages, **kwargs):
            return tokenizer.apply_chat_template(messages, chat_template=self.chat_template, **kwargs)

        def __call__(self, text, **kwargs):
            return tokenizer(text, **kwargs)

    body = ChatCompletionRequest(
        messages=[
            {"role": "user", "content": "2+2?"},
            {
                "role": "assistant",
                "tool_calls": [{"id": "c", "type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}}],
            },
        ],
        tools=[WEATHER, ADD],
    )
    prompt = PromptBuilder(Templated(), None).chat(body)["prompt"]
    assert prompt == '[TOOL get_weather][TOOL add]user:2+2?|assistant:<tool_call>{"a": 2}</tool_call>|'
    assert tools.template_format(Templated.chat_template) == tools.HERMES
    assert tools.template_format("{{ '<|python_tag|>' }}") == tools.LLAMA3_JSON


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
TOOLISH = st.sampled_from([WEATHER, ADD, {"type": "function", "function": {"name": "add"}}, "required", "auto"])


@settings(max_examples=300, deadline=None, database=None)
@given(
    tool_list=st.none() | st.lists(TOOLISH | JSON, max_size=3),
    choice=st.sampled_from([None, "none", "auto", "required", {"type": "function", "function": {"name": "add"}}])
    | JSON,
    calls=st.none() | st.lists(JSON, max_size=2),
)
def test_any_json_in_the_tool_fields_is_served_or_refused_with_a_400(tokenizer, tool_list, choice, calls):
    """What a stranger can put in the tool fields: the request either builds (sampling
    parameters and prompt) or is refused with a 400; never another exception (a 500)."""
    try:
        body = ChatCompletionRequest.model_validate(
            {
                "messages": [
                    {"role": "assistant", "content": "", "tool_calls": calls},
                    {"role": "user", "content": "x"},
                ],
                "tools": tool_list,
                "tool_choice": choice,
            }
        )
    except pydantic.ValidationError:
        return  # the server answers these with a 400 (test_api_fuzz.py)
    try:
        body.sampling_params()
        PromptBuilder(tokenizer, None).chat(body)
    except APIError as refused:
        assert refused.status_code == 400
