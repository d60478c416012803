"""Archives built the way a TorchServe user builds them: the real ``torch-model-archiver``, a model that is
not in the catalog (a TorchScript module defined here), TorchServe's stock ``image_classifier`` handler or a
handler file of the user's own."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from PIL import Image

ARCHIVER = str(Path(sys.executable).with_name("torch-model-archiver"))

CUSTOM_HANDLER = '''
import json

import torch


class Doubler:
    """A user's handler: JSON lists in, the TorchScript model's output out."""

    def initialize(self, context):
        props = context.system_properties
        self.model = torch.jit.load(f"{props['model_dir']}/{context.manifest['model']['serializedFile']}")

    def handle(self, data, context):
        rows = [json.loads(row.get("body") or row.get("data")) for row in data]
        with torch.inference_mode():
            out = self.model(torch.tensor(rows, dtype=torch.float32).reshape(len(rows), 3, 8, 8))
        return [o.tolist() for o in out]
'''


class Tiny(torch.nn.Module):
    """Not a catalog model: a convolution and a ten-way linear layer."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, stride=2)
        self.fc = torch.nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.conv(x).mean((2, 3)))


def jpeg(path: Path, seed: int) -> Path:
    """A small photo-like JPEG (noise), different for every seed."""
    g = torch.Generator().manual_seed(seed)
    pixels = (torch.rand(260, 300, 3, generator=g) * 255).to(torch.uint8).numpy()
    Image.fromarray(pixels).save(path, quality=90)
    return path


def build_user_archives(root: Path) -> dict[str, Path]:
    """``tiny.mar`` (stock image_classifier) and ``tinycustom.mar`` (a handler file), plus samples, in ``root``."""
    torch.manual_seed(0)
    torch.jit.script(Tiny().eval()).save(str(root / "tiny.pt"))
    jpeg(root / "cat.jpg", seed=1)
    (root / "grid.json").write_text(json.dumps([0.5] * (3 * 8 * 8)))
    (root / "doubler.py").write_text(CUSTOM_HANDLER)
    out = {}
    for name, handler in (("tiny", "image_classifier"), ("tinycustom", str(root / "doubler.py"))):
        subprocess.run(
            [ARCHIVER, "--model-name", name, "--version", "1.0", "--serialized-file", str(root / "tiny.pt"),
             "--handler", handler, "--export-path", str(root)],
            check=True,
        )  # fmt: skip
        out[name] = root / f"{name}.mar"
    return out


CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")  # fmt: skip
TEXTS = [
    "the quick brown fox jumps over the lazy dog. ",
    "Once upon a time a small server answered every request it was sent, one token at a time.",
    "hello world! serving language models is about batching, memory and latency; é, ü and 東京 too.",
]


def save_small_tokenizer(folder: Path, vocab: int = 300) -> Path:
    """What a user archives beside a checkpoint: a byte-level BPE tokenizer of ``vocab`` tokens with an
    end-of-text token (id 0) and a chat template, written by ``save_pretrained`` (tokenizer.json,
    tokenizer_config.json, chat_template.jinja).  Training is deterministic, so every call writes the same."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tokenizer.train_from_iterator(TEXTS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    return folder


def tokenizer_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.name.startswith("tokenizer") or p.name.endswith(".jinja"))
