"""Structured outputs and logit_bias in the engine (issue 25), on the default model.

References: ``jsonschema`` validates every JSON output, ``re.fullmatch`` every regex output;
transformers' logits give the token a -100 bias must fall back to. Sampled requests (n = 2,
temperature 0.8) run with zero-overhead scheduling on, the default, and through a PE -> CE
hand-off in one process (``PDPair``), where the PE samples the first token under the grammar
and the CE continues it.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from conftest import assert_blocks_back, make_llm

from pdinfer import SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
PROMPTS = ["Give me a person as JSON:", "A user record:", "Describe a cat in JSON.", "{"]


@pytest.fixture(scope="module")
def llm():
    return make_llm(max_model_len=1024)


def _sampled(**structured) -> SamplingParams:
    return SamplingParams(temperature=0.8, seed=11, n=2, max_tokens=120, structured_outputs=structured)


def test_every_json_schema_output_parses_and_validates(llm):
    assert llm.engine.zero_overhead  # the mask waits for the token in flight, nothing else does
    outs = llm.generate(PROMPTS, _sampled(json=SCHEMA), use_tqdm=False)
    for out in outs:
        assert len(out.outputs) == 2
        for choice in out.outputs:
            assert choice.finish_reason == "stop", choice.text
            jsonschema.validate(json.loads(choice.text), SCHEMA)
    assert_blocks_back(llm.engine)


def test_json_object_regex_choice_and_grammar(llm):
    # Any object: nothing bounds its length, so an output may run to max_tokens; every one that
    # ended by itself is an object.
    outs = llm.generate(PROMPTS, _sampled(json_object=True), use_tqdm=False)
    ended = [c.text for o in outs for c in o.outputs if c.finish_reason == "stop"]
    assert ended and all(isinstance(json.loads(text), dict) for text in ended)
    pattern = r"[A-Z][a-z]{2,6}-\d{3}"
    outs = llm.generate(PROMPTS[:2], _sampled(regex=pattern), use_tqdm=False)
    assert all(re.fullmatch(pattern, c.text) for o in outs for c in o.outputs), outs
    choices = ["red", "green", "blue (dark)"]
    outs = llm.generate(["Pick a color:", "Sky?"], _sampled(choice=choices), use_tqdm=False)
    assert all(c.text in choices for o in outs for c in o.outputs)
    grammar = 'root ::= "yes" | "no" | "maybe " [0-9]'
    outs = llm.generate(["Will it rain?"], _sampled(grammar=grammar), use_tqdm=False)
    assert all(re.fullmatch(r"yes|no|maybe [0-9]", c.text) for o in outs for c in o.outputs)
    assert_blocks_back(llm.engine)


@pytest.mark.parametrize(
    "spec, problem",
    [
        ({"json": {"type": "nonsense"}}, "nonsense"),
        ({"json": {"properties": [1]}}, "properties must be an object"),  # not a crash of our walk
        ({"regex": "(abc"}, "parenthesis"),
        ({"grammar": "root ::= foo"}, "foo"),
        ({"json": {}, "regex": "a"}, "exactly one"),
    ],
)
def test_an_invalid_spec_is_refused_naming_the_problem(llm, spec, problem):
    with pytest.raises(ValueError, match=problem):
        llm.generate(["x"], SamplingParams(structured_outputs=spec), use_tqdm=False)
    assert_blocks_back(llm.engine)


def _obj(required: list[str], **extra) -> dict:
    props = {"a": {"type": "integer"}, "b": {"type": "integer"}}
    return {"type": "object", "properties": props, "required": required, **extra}


INTS = {"type": "array", "items": {"type": "integer"}}
# (keyword, schema, an instance the schema forbids that xgrammar's matcher accepts)
UNENFORCED = [
    ("allOf", {"allOf": [_obj(["a"]), _obj(["b"])]}, "[1]"),
    ("oneOf", {"oneOf": [{"type": "integer"}, {"type": "number"}]}, "1"),
    ("not", {"not": {"type": "integer"}}, "1"),
    ("if", _obj(["a"], **{"if": _obj([], properties={"a": {"const": 1}}), "then": {"required": ["b"]}}), '{"a": 1}'),
    ("dependentRequired", _obj([], dependentRequired={"a": ["b"]}), '{"a": 1}'),
    ("dependentSchemas", _obj([], dependentSchemas={"a": {"required": ["b"]}}), '{"a": 1}'),
    (
        "dependencies",
        _obj([], dependencies={"a": ["b"]}, **{"$schema": "http://json-schema.org/draft-07/schema#"}),
        '{"a": 1}',
    ),
    ("uniqueItems", {**INTS, "uniqueItems": True}, "[1, 1]"),
    ("contains", {**INTS, "contains": {"const": 5}}, "[1]"),
    ("regex", {"type": "string", "format": "regex"}, '"("'),
    ("uniqueItems", {"type": "object", "properties": {"xs": {**INTS, "uniqueItems": True}}}, '{"xs": [2, 2]}'),
]


@pytest.mark.parametrize(
    "keyword, schema, breaking", UNENFORCED, ids=[f"{k}-{i}" for i, (k, *_) in enumerate(UNENFORCED)]
)
def test_a_schema_keyword_the_grammar_would_not_enforce_is_refused(llm, tokenizer, keyword, schema, breaking):
    """xgrammar compiles these schemas but lets through an instance that breaks them (checked
    here with its own matcher, and jsonschema says it breaks them): such a request is refused,
    naming the keyword, rather than answered with JSON that ignores part of its schema."""
    import xgrammar

    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(breaking), schema, format_checker=jsonschema.FormatChecker())
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=llm.engine.spec.vocab_size)
    matcher = xgrammar.GrammarMatcher(xgrammar.GrammarCompiler(info).compile_json_schema(json.dumps(schema)))
    assert matcher.accept_string(breaking)
    with pytest.raises(ValueError, match=keyword):
        llm.generate(["x"], SamplingParams(structured_outputs={"json": schema}), use_tqdm=False)
    assert_blocks_back(llm.engine)


def test_a_discriminated_union_is_enforced(llm):
    """pydantic's tagged union is a oneOf of $refs told apart by a const property: xgrammar's
    anyOf enforces it exactly, so it is accepted and every output validates."""
    cat = {"type": "object", "properties": {"kind": {"const": "cat"}, "lives": {"type": "integer"}}}
    dog = {"type": "object", "properties": {"kind": {"const": "dog"}, "name": {"type": "string", "maxLength": 8}}}
    schema = {
        "$defs": {"Cat": {**cat, "required": ["kind", "lives"]}, "Dog": {**dog, "required": ["kind", "name"]}},
        "oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}],
    }
    outs = llm.generate(["A pet as JSON:"], _sampled(json=schema), use_tqdm=False)
    for choice in outs[0].outputs:
        assert choice.finish_reason == "stop", choice.text
        jsonschema.validate(json.loads(choice.text), schema)


def test_a_refused_prompt_leaves_nothing_of_its_batch_behind(llm):
    """The grammar is compiled as each prompt is added: when the second one is refused, the
    first, already added, must not stay in the engine (running unseen, holding blocks)."""
    good = SamplingParams(temperature=0.0, max_tokens=8)
    bad = SamplingParams(structured_outputs={"regex": "(abc"})
    aborted = llm.engine.num_aborted
    with pytest.raises(ValueError, match="parenthesis"):
        llm.generate(["x", "y"], [good, bad], use_tqdm=False)
    assert not llm.engine.requests  # "x" was aborted, not left to run
    assert llm.engine.num_aborted == aborted + 1
    llm.generate(["z"], good, use_tqdm=False)  # takes the abort's delta on its way
    assert_blocks_back(llm.engine)


def test_greedy_json_is_the_same_with_and_without_zero_overhead_scheduling(llm, monkeypatch):
    params = SamplingParams(temperature=0.0, max_tokens=80, structured_outputs={"json": SCHEMA})
    overlapped = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    monkeypatch.setenv("PDINFER_ZERO_OVERHEAD_SCHEDULING", "0")
    plain = make_llm(max_model_len=1024)
    assert not plain.engine.zero_overhead
    assert [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params, use_tqdm=False)] == overlapped


def test_a_minus_100_logit_bias_gives_the_runner_up(llm, hf_model, tokenizer):
    """transformers' logits of the prompt: with the top token biased away, greedy takes the
    second; +100 on a token makes it the greedy choice."""
    prompt = "The capital of France is"
    ids = tokenizer(prompt).input_ids
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0, -1]
    first, second = logits.topk(2).indices.tolist()
    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    assert llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids == [first]
    away = greedy.clone(logit_bias={str(first): -100})  # JSON keys are strings
    assert llm.generate([prompt], away, use_tqdm=False)[0].outputs[0].token_ids == [second]
    unlikely = int(logits.argmin())
    toward = greedy.clone(logit_bias={unlikely: 100})
    assert llm.generate([prompt], toward, use_tqdm=False)[0].outputs[0].token_ids == [unlikely]


@pytest.mark.parametrize("bias", [{"abc": 1}, {5: 100.5}, {10**9: 1}, {1: float("nan")}])
def test_a_bad_logit_bias_is_refused(llm, bias):
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate(["x"], SamplingParams(logit_bias=bias), use_tqdm=False)


def test_through_a_pe_to_ce_hand_off_the_output_validates():
    from pdinfer import EngineArgs
    from pdinfer.engine.completion_engine import CompletionEngine
    from pdinfer.engine.pd_pair import PDPair
    from pdinfer.engine.prefill_engine import PrefillEngine

    args = dict(kv_cache_memory=640 << 20, max_model_len=1024, kv_transfer={"connector": "tcp"})
    pe = PrefillEngine(EngineArgs(engine_type="prompt", **args))
    ce = CompletionEngine(EngineArgs(engine_type="completion", **args))
    try:
        outs = PDPair(pe, ce).generate(PROMPTS, _sampled(json=SCHEMA))
        for out in outs:
            assert len(out.outputs) == 2
            for choice in out.outputs:
                jsonschema.validate(json.loads(choice.text), SCHEMA)
        for engine in (pe, ce):
            assert engine.get_num_free_blocks() == engine.num_blocks
    finally:
        pe.shutdown()
        ce.shutdown()


def test_sampled_mixed_batches_are_the_same_with_and_without_zero_overhead_scheduling(llm, monkeypatch):
    """Constrained and free requests in one batch, seeded sampling: the grammar masks that
    zero-overhead scheduling computes while the forward runs land on the same rows, so every
    token equals the one the plain step loop samples."""
    mixed = [
        SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=60, structured_outputs={"json": SCHEMA}),
        SamplingParams(temperature=0.8, seed=4, max_tokens=40),
        SamplingParams(temperature=0.8, seed=5, max_tokens=30, structured_outputs={"regex": r"[a-z]{3,9}-\d{2}"}),
        SamplingParams(temperature=0.0, max_tokens=50, logit_bias={11: 5.0}),
    ]

    def run(model):
        outs = model.generate(PROMPTS, mixed, use_tqdm=False)
        assert_blocks_back(model.engine)
        return [[c.token_ids for c in o.outputs] for o in outs]

    overlapped = run(llm)
    monkeypatch.setenv("PDINFER_ZERO_OVERHEAD_SCHEDULING", "0")
    plain = make_llm(max_model_len=1024)
    assert not plain.engine.zero_overhead
    assert run(plain) == overlapped


def test_a_constrained_step_is_launched_before_the_step_in_flight_is_processed(llm):
    """With zero-overhead scheduling a decode step of a constrained sequence does not first
    finish the step in flight: it is launched with its masks deferred (filled in while its
    forward runs), and the outputs still validate."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=60, structured_outputs={"json": SCHEMA})
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"defer-{i}", prompt, params)
    deferred, tokens = 0, {}
    while engine.has_unfinished_requests():
        for delta in engine.step_deltas():
            for seq in delta.seqs:
                tokens.setdefault(delta.request_id, []).extend(seq.token_ids)
        inflight = engine._inflight
        deferred += inflight is not None and inflight.inp.masks_later is not None
    assert deferred >= 10  # every decode step of this batch: one per token
    for ids in tokens.values():
        jsonschema.validate(json.loads(llm.tokenizer.decode(ids, skip_special_tokens=True)), SCHEMA)
    assert_blocks_back(engine)
