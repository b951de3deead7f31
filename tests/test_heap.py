"""``LLM.generate`` keeps the objects that existed before it out of Python's full collections
while it runs, and puts them back when it returns (``engine/heap.py``): nothing is kept alive
for good, and what the loop makes is still collected. It collects young objects less often
while it runs, and restores the threshold after."""

from __future__ import annotations

import gc

from pdinfer import LLM, SamplingParams
from pdinfer.engine.heap import LOOP_GC_THRESHOLD


def test_generate_freezes_the_startup_heap_and_gives_it_back(tiny_model):
    model, tokenizer = tiny_model
    llm = LLM(model=model, tokenizer=tokenizer, load_format="dummy", max_model_len=256, num_kv_blocks=64)
    seen: list[int] = []
    thresholds: list[int] = []
    step = llm.engine.step

    def watched_step(**kwargs):
        seen.append(gc.get_freeze_count())
        thresholds.append(gc.get_threshold()[0])
        return step(**kwargs)

    llm.engine.step = watched_step  # observes the loop; the engine's step runs unchanged
    before = gc.get_freeze_count()
    threshold_before = gc.get_threshold()
    assert threshold_before[0] < LOOP_GC_THRESHOLD  # the interpreter's default, 700
    outputs = llm.generate(["Hello", "The sky is"], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [8, 8]
    assert seen and min(seen) > before  # the engine, the model and the libraries were frozen
    assert gc.get_freeze_count() == before  # and are back in the collector's reach
    assert min(thresholds) == LOOP_GC_THRESHOLD and gc.get_threshold() == threshold_before
    garbage: list = []
    garbage.append(garbage)  # a cycle made after generate: still collected
    del garbage
    assert gc.collect() >= 1


def test_finished_only_steps_give_the_same_final_outputs(tiny_model):
    """``step(finished_only=True)`` (what ``LLM.generate`` runs) returns exactly the outputs
    of the requests that ended, once each, equal to the final outputs of plain steps."""
    model, tokenizer = tiny_model
    llm = LLM(model=model, tokenizer=tokenizer, load_format="dummy", max_model_len=256, num_kv_blocks=64)
    engine = llm.engine
    lengths = {"a": 2, "b": 7, "c": 4}
    finals = []
    for finished_only in (False, True):
        for name, n in lengths.items():
            params = SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.8, seed=3)
            engine.add_request(f"{name}-{finished_only}", "The sky is", params)
        seen: dict[str, list] = {}
        while engine.has_unfinished_requests():
            for out in engine.step(finished_only=finished_only):
                seen.setdefault(out.request_id.split("-")[0], []).append(out)
        if finished_only:
            assert all(len(v) == 1 and v[0].finished for v in seen.values())
        else:
            assert any(len(v) > 1 for v in seen.values())  # plain steps report progress too
        finals.append({k: (v[-1].outputs[0].token_ids, v[-1].outputs[0].text) for k, v in seen.items()})
    assert finals[0] == finals[1] and [len(finals[1][k][0]) for k in lengths] == list(lengths.values())
