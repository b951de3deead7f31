"""``OutputTracker``: the client side of a request (detokenization, stop strings, what a stream
shows), fed engine deltas by hand with the default model's real tokenizer. Expected texts come
from the tokenizer's own ``decode``."""

from __future__ import annotations

import pytest

from pdinfer import SamplingParams
from pdinfer.engine.detokenizer import Detokenizer
from pdinfer.engine.output_tracker import OutputTracker
from pdinfer.outputs import RequestDelta, SeqDelta


@pytest.fixture(scope="module")
def ids(tokenizer):
    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False).input_ids

    return encode


def tracker(tokenizer, prompt_ids, **params) -> OutputTracker:
    return OutputTracker("r", None, prompt_ids, SamplingParams(**params), Detokenizer(tokenizer))


def feed(t: OutputTracker, tokens: list[int], index: int = 0, finish: str | None = None, **kw) -> list[int]:
    return t.apply(RequestDelta("r", [SeqDelta(index, tokens, finish_reason=finish)], **kw))


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_inside_the_output_are_skipped_or_kept_as_decode_does(tokenizer, ids, skip):
    special = tokenizer.all_special_ids[:2]
    out = ids("Hello") + special[:1] + ids(" wide world, café") + special[1:] + ids(" end")
    t = tracker(tokenizer, ids("Say hi"), max_tokens=100, skip_special_tokens=skip)
    for token in out:
        feed(t, [token])
    feed(t, [], finish="length", finished=True)
    assert t.output().outputs[0].text == tokenizer.decode(out, skip_special_tokens=skip)


def test_text_is_the_tokenizers_decode_one_token_at_a_time(tokenizer, ids):
    prompt, out = ids("The capital of France is"), ids(" Paris, a city of lights. Café!")
    t = tracker(tokenizer, prompt, max_tokens=100)
    for token in out:
        assert feed(t, [token]) == []
    feed(t, [], finish="length", finished=True)
    result = t.output()
    assert result.finished and result.outputs[0].token_ids == out
    assert result.outputs[0].text == tokenizer.decode(out)
    assert result.outputs[0].finish_reason == "length"


def test_a_stop_string_across_tokens_ends_the_output_and_drops_later_tokens(tokenizer, ids):
    out = ids(" one two three STOP four five")
    stop_at = next(i for i in range(len(out)) if "STOP" in tokenizer.decode(out[: i + 1]))
    t = tracker(tokenizer, ids("Count:"), stop=["STOP"], max_tokens=100)
    stopped = feed(t, out)  # the engine ran past the stop before the client saw it
    assert stopped == [0]
    result = t.output()
    assert result.finished  # every output ended: the request is done on the client side
    assert result.outputs[0].text == " one two three "
    assert result.outputs[0].token_ids == out[: stop_at + 1]  # the token that completed it counts
    assert (result.outputs[0].finish_reason, result.outputs[0].stop_reason) == ("stop", "STOP")
    assert feed(t, ids(" six")) == [] and t.output().outputs[0].token_ids == out[: stop_at + 1]


def test_include_stop_str_in_output_keeps_it(tokenizer, ids):
    t = tracker(tokenizer, ids("Count:"), stop=["STOP"], include_stop_str_in_output=True)
    feed(t, ids(" one STOP two"))
    assert t.output().outputs[0].text == " one STOP"


def test_a_stream_holds_back_what_may_start_a_stop_string(tokenizer, ids):
    """While running, the last len(stop) - 1 characters stay hidden; several deltas applied
    between two reads come out as one."""
    t = tracker(tokenizer, ids("Say:"), stop=["abcdef"], max_tokens=100)
    feed(t, ids(" hello"))
    feed(t, ids(" world"))
    shown = t.take_shown()
    text = " hello world"
    assert [(d.index, d.text, d.text_offset) for d in shown] == [(0, text[: len(text) - 5], 0)]
    assert t.take_shown() == []  # nothing new
    feed(t, [], finish="length", finished=True)
    (last,) = t.take_shown()
    assert (last.text, last.text_offset, last.finish_reason) == (text[-5:], len(text) - 5, "length")


def test_forked_outputs_are_tracked_apart_and_one_stop_ends_only_its_output(tokenizer, ids):
    t = tracker(tokenizer, ids("Q:"), n=2, stop=["X"], max_tokens=100)
    t.apply(RequestDelta("r", [SeqDelta(0, ids(" aX")), SeqDelta(1, ids(" b"))]))
    assert not t.finished  # output 1 still runs
    stopped = t.apply(RequestDelta("r", [SeqDelta(0, ids(" c")), SeqDelta(1, ids(" c"))]))
    assert stopped == []
    assert [c.text for c in t.output().outputs] == [" a", " b c"]
    feed(t, [], index=1, finish="length")
    assert t.finished


def test_logprobs_and_cumulative_logprob_stop_where_the_text_stops(tokenizer, ids):
    out = ids(" yes STOP no")
    entries = [{tok: -0.5 * (i + 1)} for i, tok in enumerate(out)]
    stop_at = next(i for i in range(len(out)) if "STOP" in tokenizer.decode(out[: i + 1]))
    t = tracker(tokenizer, ids("A:"), stop=["STOP"], logprobs=0)
    total = sum(e[tok] for e, tok in zip(entries, out))
    t.apply(RequestDelta("r", [SeqDelta(0, out, entries, total)]))
    result = t.output().outputs[0]
    assert result.logprobs == entries[: stop_at + 1]
    assert result.cumulative_logprob == pytest.approx(sum(-0.5 * (i + 1) for i in range(stop_at + 1)))


def test_engine_failure_ends_every_output_with_an_error(tokenizer, ids):
    t = tracker(tokenizer, ids("A:"), n=3)
    feed(t, ids(" x"))
    t.fail("the engine went away")
    result = t.output()
    assert result.finished and result.error == "the engine went away"
    assert [c.finish_reason for c in result.outputs] == ["error", "error", "error"]


def test_a_finished_output_is_shown_once_while_its_siblings_run_on(tokenizer, ids):
    """n = 2, output 0 ends first: a stream shows its finish once (OpenAI sends one finish chunk
    per choice); it repeated it, with an empty delta, at every later read until output 1 ended."""
    t = tracker(tokenizer, ids("Say:"), n=2, max_tokens=100)
    feed(t, ids(" yes"), index=0, finish="stop")
    feed(t, ids(" one"), index=1)
    first = t.take_shown()
    assert sorted((d.index, d.finish_reason) for d in first) == [(0, "stop"), (1, None)]
    for word in (" two", " three"):
        feed(t, ids(word), index=1)
        assert [(d.index, d.finish_reason) for d in t.take_shown()] == [(1, None)]
    feed(t, [], index=1, finish="length", finished=True)
    assert [(d.index, d.finish_reason) for d in t.take_shown()] == [(1, "length")]
    assert t.take_shown() == []
