"""Text in and out of Orca: the checkpoint's own tokenizer, its chat template, and text made as tokens arrive.

The engine works on token ids; this module is the text around it, for the
OpenAI-compatible routes (``openai_api.py``).  The tokenizer is the one the
user archived beside the checkpoint (``tokenizer.json``, with
``tokenizer_config.json`` and ``chat_template.jinja`` when it has them, as
``save_pretrained`` writes them), read by transformers, so prompts are
encoded and chat messages rendered exactly as the model's own tooling does.

``TextStream`` turns one request's tokens into text while they are made.
Text is decoded from every token so far (byte-level tokenizers can split a
character across tokens; a trailing U+FFFD means "wait for the next one"),
and any text that could still become the start of a stop string is held
back, so a streamed client never sees a stop string or a piece of one.  The
first stop string found ends the text just before it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TOKENIZER_FILE = "tokenizer.json"
INCOMPLETE = "\ufffd"  # what a decoder makes of a character whose bytes have not all arrived


class TokenizerError(ValueError):
    """A tokenizer the model cannot use, or a prompt it cannot render (the handler answers 400 or refuses)."""


@dataclass
class TextCodec:
    """A checkpoint's tokenizer: prompts to ids, ids to text, chat messages to a prompt."""

    tokenizer: Any  # a transformers tokenizer
    stop_ids: tuple[int, ...]  # end-of-sequence ids: a request ends when it makes one

    @classmethod
    def load(cls, folder: Path, vocab: int) -> TextCodec:
        """The tokenizer archived in ``folder``; refused by name when its ids do not fit the model's ``vocab``."""
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        except Exception as exc:  # noqa: BLE001 - any unreadable tokenizer is refused in one line
            raise TokenizerError(f"cannot read the archive's {TOKENIZER_FILE}: {type(exc).__name__}: {exc}") from None
        if len(tokenizer) > vocab:
            raise TokenizerError(f"the tokenizer has {len(tokenizer)} tokens but the model's vocabulary holds "
                                 f"{vocab}; archive the checkpoint's own tokenizer")  # fmt: skip
        eos = tokenizer.eos_token_id
        stops = tuple(eos if isinstance(eos, list) else [eos]) if eos is not None else ()
        return cls(tokenizer, tuple(int(t) for t in stops))

    @staticmethod
    def present(folder: Path) -> bool:
        return (folder / TOKENIZER_FILE).is_file()

    def encode(self, text: str) -> list[int]:
        """A completion prompt's ids, with the special tokens the tokenizer adds (a Llama BOS, say)."""
        return list(self.tokenizer.encode(text))

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        """Chat messages rendered by the checkpoint's template, ending where the assistant's answer begins."""
        if not self.has_chat_template:
            raise TokenizerError("this model's tokenizer has no chat template (chat_template.jinja or "
                                 "tokenizer_config.json's chat_template); use the completions route")  # fmt: skip
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # noqa: BLE001 - the template's own error (a role it does not take, say)
            raise TokenizerError(f"the chat template cannot render these messages: {exc}") from None
        # The template writes the special tokens itself (a BOS, say): encoding adds none.
        return list(self.tokenizer.encode(text, add_special_tokens=False))


class TextStream:
    """One request's text, made as its tokens arrive, ended at the first of its stop strings (module doc)."""

    def __init__(self, codec: TextCodec, stops: Sequence[str] = ()) -> None:
        self.codec = codec
        self.stops = tuple(s for s in stops if s)
        self.ids: list[int] = []
        self.text = ""  # the text so far (cut before a stop string once one is seen)
        self.sent = 0  # characters of ``text`` handed out
        self.stopped = False  # a stop string ended it
        self._searched = 0  # characters of the text already searched for stop strings

    def push(self, token: int) -> str:
        """Add a token; the new text that is safe to hand out now (maybe empty)."""
        if self.stopped:
            return ""
        self.ids.append(token)
        decoded = self.codec.decode(self.ids)
        stable = decoded.rstrip(INCOMPLETE)  # a trailing U+FFFD may yet become a character
        if self._cut_at_stop(stable):
            return self._hand_out(len(self.text))
        self.text = decoded
        return self._hand_out(len(stable) - self._stop_prefix_at_end(stable))

    def finish(self) -> str:
        """The text held back so far (the request has ended)."""
        if not self.stopped and self.ids:
            decoded = self.codec.decode(self.ids)  # an incomplete last character stays U+FFFD
            if not self._cut_at_stop(decoded):
                self.text = decoded
        return self._hand_out(len(self.text))

    def _cut_at_stop(self, text: str) -> bool:
        """End the text before the first stop string in ``text``, if one is there (searching only what is new)."""
        if not self.stops:
            return False
        start = max(0, self._searched - max(map(len, self.stops)) + 1)
        self._searched = len(text)
        hits = [i for i in (text.find(s, start) for s in self.stops) if i >= 0]
        if not hits:
            return False
        self.text = text[: min(hits)]
        self.stopped = True
        return True

    def _hand_out(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        out = self.text[self.sent : upto]
        self.sent = upto
        return out

    def _stop_prefix_at_end(self, text: str) -> int:
        """How many of ``text``'s last characters begin some stop string (they wait for the next token)."""
        longest = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:k]):
                    longest = k
                    break
        return longest
