"""Orca on a Llama-family checkpoint with grouped-query attention: greedy tokens equal ``generate``'s."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from handlers.orca.attention import Step
from handlers.orca.engine import OrcaEngine
from handlers.orca.kv_cache import KVCache
from handlers.orca.llama import SelectiveLlama, UnsupportedCheckpoint
from model_store.user_models import describe_checkpoint, load_checkpoint

VOCAB = 256


def llama_config(**overrides) -> transformers.LlamaConfig:
    """A small Llama with fewer key/value heads than query heads (GQA), as Llama 3 / SmolLM / Qwen2 have."""
    settings = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=96,
        rms_norm_eps=1e-6, tie_word_embeddings=False,
    )  # fmt: skip
    settings.update(overrides)
    return transformers.LlamaConfig(**settings)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A checkpoint as ``save_pretrained`` writes it (config.json + safetensors), read back as a user's would be."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("llama")
    transformers.LlamaForCausalLM(llama_config()).eval().save_pretrained(path)
    return transformers.LlamaForCausalLM.from_pretrained(path).eval()


def generate(hf, prompt: list[int], new_tokens: int) -> list[int]:
    with torch.inference_mode():
        out = hf.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
        )  # fmt: skip
    return out[0, len(prompt) :].tolist()


def test_prompts_of_different_lengths_served_together_generate_what_generate_does(checkpoint):
    model = SelectiveLlama(checkpoint)
    assert (model.heads, model.kv_heads) == (4, 2)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in (3, 11, 1, 7)]
    engine = OrcaEngine(model, slots=4, max_tokens=48, max_batch=4, max_new_tokens=16)
    try:
        futures = [engine.submit(p, 12) for p in prompts]
        results = [f.result(timeout=120) for f in futures]
    finally:
        engine.close(timeout_s=30)
    assert results == [generate(checkpoint, p, 12) for p in prompts]
    assert max(engine.batch_sizes) >= 2  # they shared iterations


def test_a_decode_iteration_matches_the_full_forward_at_every_position(checkpoint):
    model = SelectiveLlama(checkpoint)
    kv = KVCache(model.kv_shape(blocks=8, block_size=2))
    prompt = [5, 9, 200, 17, 3]
    table = kv.table_for(len(prompt))
    logits = model.iterate([Step(prompt[:3], 0, table)], kv)
    for i in range(3, len(prompt)):
        logits = model.iterate([Step([prompt[i]], i, table)], kv)
    with torch.inference_mode():
        expected = checkpoint(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(logits[0], expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("overrides", "named"),
    [({"hidden_act": "gelu"}, "hidden_act"), ({"pretraining_tp": 2}, "pretraining_tp")],
)
def test_settings_it_does_not_compute_are_refused_by_name(overrides, named):
    with pytest.raises(UnsupportedCheckpoint, match=named):
        SelectiveLlama(transformers.LlamaForCausalLM(llama_config(**overrides)))


def test_a_sliding_window_checkpoint_is_refused_by_name():
    config = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, use_sliding_window=True, sliding_window=16, max_window_layers=0,
    )  # fmt: skip
    with pytest.raises(UnsupportedCheckpoint, match="sliding_window"):
        SelectiveLlama(transformers.Qwen2ForCausalLM(config))


def test_a_users_checkpoint_is_described_by_its_config_and_loaded_as_saved(tmp_path):
    torch.manual_seed(2)
    saved = transformers.LlamaForCausalLM(llama_config(max_position_embeddings=40)).eval()
    saved.save_pretrained(tmp_path)
    spec = describe_checkpoint(tmp_path / "config.json", "mine")
    assert (spec.family, spec.seq_len, spec.vocab_size) == ("llama", 40, VOCAB)
    loaded = load_checkpoint(tmp_path / "model.safetensors")
    assert torch.equal(loaded.model.model.layers[1].mlp.up_proj.weight, saved.model.layers[1].mlp.up_proj.weight)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu"}))
    with pytest.raises(UnsupportedCheckpoint, match="hidden_act 'gelu'"):
        describe_checkpoint(tmp_path / "config.json", "mine")
