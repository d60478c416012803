"""Orca's decode iterations as padded static-shape programs (captured as CUDA graphs on a GPU): on CPU, the
same logits as ``iterate``, padding rows that touch only the scratch block, and the bucket each iteration takes."""

from __future__ import annotations

import pytest
import torch

from handlers.orca.attention import Step
from handlers.orca.decode_programs import DecodePrograms, context_buckets
from handlers.orca.gpt2 import SelectiveGPT2
from handlers.orca.kv_cache import KVCache
from handlers.orca.llama import SelectiveLlama
from model_store.catalog import get_spec
from model_store.factory import build_model

BLOCK = 4  # small blocks, so requests span several and tables interleave


@pytest.fixture(scope="module", params=["gpt2-tiny1", "llama-tiny"])
def model(request):
    hf = build_model(get_spec(request.param)).model
    return SelectiveLlama(hf) if request.param.startswith("llama") else SelectiveGPT2(hf)


def decoding(model, kv: KVCache, lengths: list[int]) -> list[Step]:
    """Requests whose prompts (of ``lengths`` tokens) were computed; each one's next decode step."""
    generator = torch.Generator().manual_seed(sum(lengths))
    steps = []
    for n in lengths:
        ask = torch.randint(0, model.vocab, (n,), generator=generator).tolist()
        table = kv.table_for(n + 1)
        logits = model.iterate([Step(ask, 0, table)], kv)
        steps.append(Step([int(logits[0].argmax())], n, table))
    return steps


def test_context_buckets_double_up_to_what_max_tokens_needs():
    assert context_buckets(64, 4) == [1, 2, 4, 8, 16]
    assert context_buckets(40, 4) == [1, 2, 4, 8, 10]


@pytest.mark.parametrize("lengths", [[3], [2, 9, 5], [7, 1, 12, 4, 6]])
def test_a_padded_decode_program_gives_each_request_the_logits_iterate_gives(model, lengths):
    kv = KVCache(model.kv_shape(blocks=64, block_size=BLOCK))
    scratch = kv.blocks.allocate(1)[0]
    programs = DecodePrograms(model, kv, max_batch=8, max_tokens=32, scratch=scratch)
    steps = decoding(model, kv, lengths)
    before_keys = [k.clone() for k in kv.keys]
    got = programs.iterate(steps)
    assert got is not None and got.shape == (len(steps), model.vocab) and programs.replays == 1
    written = {step.blocks[step.start // BLOCK] * BLOCK + step.start % BLOCK for step in steps}
    scratch_rows = set(range(scratch * BLOCK, (scratch + 1) * BLOCK))
    for layer, (before, after) in enumerate(zip(before_keys, kv.keys, strict=True)):
        changed = set((before != after).any(dim=(1, 2)).nonzero().flatten().tolist())
        assert changed <= written | scratch_rows, (layer, sorted(changed - written - scratch_rows))
    want = model.iterate(steps, kv)  # writes the same keys again: the program's must be the model's
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_each_iteration_takes_the_smallest_bucket_and_others_fall_back(model):
    kv = KVCache(model.kv_shape(blocks=64, block_size=BLOCK))
    programs = DecodePrograms(model, kv, max_batch=8, max_tokens=32, scratch=kv.blocks.allocate(1)[0])
    assert programs.batches == [1, 2, 4, 8] and programs.widths == [1, 2, 4, 8]
    steps = decoding(model, kv, [2, 9, 5])  # the longest context: 10 positions, 3 blocks
    assert programs.bucket(steps) == (4, 4)
    assert programs.bucket(steps[:1]) == (1, 1)
    prompt = Step([1, 2, 3], 0, kv.table_for(3))
    assert programs.bucket([*steps, prompt]) is None and programs.iterate([*steps, prompt]) is None
    assert programs.bucket(steps * 3) is None  # nine requests: more than max_batch
    assert programs.replays == 0
