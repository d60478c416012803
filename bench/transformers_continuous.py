"""transformers' own continuous batching behind the Orca engine's interface, as a benchmark baseline.

transformers ships iteration-level scheduling with a paged KV cache
(``model.init_continuous_batching()``, the engine behind ``generate_batch``):
the baseline a user already has in the ecosystem.  This wraps its manager in
the interface ``bench/orca.py`` drives every system through (``check``,
``submit`` → a future of the generated ids, ``close``).  End-of-text does not
stop a request (``eos_token_id`` none), so every system makes exactly the
tokens asked for and answers compare token for token.  Greedy decoding, as
the other systems.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from handlers.orca.engine import BATCH_SIZE_HISTORY, check_request


class TransformersContinuousEngine:
    """Requests into transformers' continuous-batching manager; a thread hands its results to futures."""

    def __init__(self, hf: Any, max_batch: int, max_new_tokens: int, max_tokens: int, block_size: int = 16,
                 slots: int = 16) -> None:  # fmt: skip
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        self.vocab = hf.config.vocab_size
        self.max_new_tokens = max_new_tokens
        self.max_tokens = max_tokens
        blocks = slots * -(-max_tokens // block_size)  # the same KV memory as Orca's engine gets
        generation = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
        config = ContinuousBatchingConfig(max_requests_per_batch=max_batch, num_blocks=blocks, page_size=block_size,
                                          use_cuda_graph=False)  # fmt: skip
        self._manager = hf.init_continuous_batching(generation_config=generation, continuous_batching_config=config)
        self._manager.start()
        self._futures: dict[str, Future] = {}
        self._lock = threading.Lock()
        self._closed = False
        self.batch_sizes: deque[int] = deque(maxlen=BATCH_SIZE_HISTORY)  # not observable here: stays empty
        self._reader = threading.Thread(target=self._read, name="transformers-cb-results", daemon=True)
        self._reader.start()

    def check(self, prompt: Sequence[int], max_new_tokens: int) -> None:
        check_request(prompt, max_new_tokens, self.vocab, self.max_new_tokens, self.max_tokens)

    def submit(self, prompt: Sequence[int], max_new_tokens: int) -> Future:
        self.check(prompt, max_new_tokens)
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the engine is closed")
            request_id = self._manager.add_request(list(prompt), max_new_tokens=max_new_tokens)
            self._futures[request_id] = future
        return future

    def _read(self) -> None:
        while True:
            with self._lock:
                if self._closed and not self._futures:
                    return
            result = self._manager.get_result(timeout=0.1)
            if result is None:
                continue
            with self._lock:
                future = self._futures.pop(result.request_id, None)
            if future is None or future.done():
                continue
            error = getattr(result, "error", None)
            if error:
                future.set_exception(RuntimeError(str(error)))
            else:
                future.set_result(list(result.generated_tokens))

    def close(self, timeout_s: float | None = None) -> None:
        with self._lock:
            self._closed = True
        self._reader.join(timeout_s)
        self._manager.stop(block=True, timeout=timeout_s)
        with self._lock:
            for future in self._futures.values():
                if not future.done():
                    future.set_exception(RuntimeError("the engine closed before this request finished"))
            self._futures.clear()
