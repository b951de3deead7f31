"""``LLM.generate`` keeps the objects that existed before it out of Python's full collections
while it runs, and puts them back when it returns (``engine/heap.py``): nothing is kept alive
for good, and what the loop makes is still collected."""

from __future__ import annotations

import gc

from pdinfer import LLM, SamplingParams


def test_generate_freezes_the_startup_heap_and_gives_it_back(tiny_model):
    model, tokenizer = tiny_model
    llm = LLM(model=model, tokenizer=tokenizer, load_format="dummy", max_model_len=256, num_kv_blocks=64)
    seen: list[int] = []
    step = llm.engine.step

    def watched_step():
        seen.append(gc.get_freeze_count())
        return step()

    llm.engine.step = watched_step  # observes the loop; the engine's step runs unchanged
    before = gc.get_freeze_count()
    outputs = llm.generate(["Hello", "The sky is"], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [8, 8]
    assert seen and min(seen) > before  # the engine, the model and the libraries were frozen
    assert gc.get_freeze_count() == before  # and are back in the collector's reach
    garbage: list = []
    garbage.append(garbage)  # a cycle made after generate: still collected
    del garbage
    assert gc.collect() >= 1
