"""The engine's check of a request's ``structured_outputs`` when it arrives: the spec is
compiled for the model's tokenizer in a bounded pool of threads, within a time limit, so a
spec that cannot compile (or would take too long) refuses that request with a
``StructuredOutputError`` naming it, before it is queued; the requests already running
never meet it. The runner compiles the same spec again where it samples (the model's own
process; the backend caches compiled grammars)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from deepinfer_kit.sample.structured.params import StructuredOutputError, StructuredOutputsParams
from deepinfer_kit.sample.structured.protocols import GrammarBackend

__all__ = ["GrammarCheck", "COMPILE_TIMEOUT_S", "COMPILE_THREADS", "tokenizer_backend"]

COMPILE_TIMEOUT_S = 10.0
"""Seconds a spec may take to compile before its request is refused."""

COMPILE_THREADS = 2
"""Threads compiling specs (a compile past its time limit keeps its thread until it ends)."""


class GrammarCheck:
    """Compiles each new spec once, off the calling thread, within :data:`COMPILE_TIMEOUT_S`.

    Args:
        tokenizer: the engine's tokenizer (``None``: every spec is refused, naming why).
        vocab_size: the model's vocabulary (bitmask width).
        stop_token_ids: the ids that end a grammar (the model's EOS ids).
        timeout_s: the time limit of one compile.
        backend: the backend to compile with (default: xgrammar over ``tokenizer``, built
            on the first spec).
    """

    def __init__(self, tokenizer: object | None, vocab_size: int, stop_token_ids: Sequence[int], *,
                 timeout_s: float = COMPILE_TIMEOUT_S, backend: GrammarBackend | None = None) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop = tuple(stop_token_ids)
        self._timeout = timeout_s
        self._backend: GrammarBackend | None = backend
        self._pool: ThreadPoolExecutor | None = None
        self._checked: set[StructuredOutputsParams] = set()
        self._lock = threading.Lock()

    def check(self, spec: StructuredOutputsParams) -> None:
        """Compile ``spec`` (once per distinct spec). Called by the request builder for a
        request with ``structured_outputs``; blocks the caller up to the time limit. The
        server and ``AsyncLLM.generate`` call it from a worker thread first (the engine's
        check at ``add_request`` then finds the spec checked), so the engine's thread never
        waits on a compile; ``LLM.generate`` compiles on its own (the engine's) thread.
        Thread-safe.

        Raises:
            StructuredOutputError: the spec does not compile, took longer than the limit,
                the engine has no tokenizer, or xgrammar is not installed.
        """
        if spec in self._checked:
            return
        with self._lock:  # the server checks from several threads at once
            if self._backend is None:
                self._backend = tokenizer_backend(self._tokenizer, self._vocab_size, self._stop)
            if self._pool is None:
                self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar-compile")
        future = self._pool.submit(self._backend.compile, spec)
        try:
            future.result(timeout=self._timeout)
        except StructuredOutputError as exc:
            raise StructuredOutputError(f"structured_outputs: {exc}") from None
        except FutureTimeout:
            raise StructuredOutputError(
                f"structured_outputs ({spec.kind}) did not compile within {self._timeout:g} s"
            ) from None
        self._checked.add(spec)


def tokenizer_backend(tokenizer: object | None, vocab_size: int, stop_token_ids: Sequence[int]) -> GrammarBackend:
    """The xgrammar backend over the model's tokenizer (``vocab_size`` bits a row, the
    model's EOS ids as the tokens that end a grammar). Called on the first request with
    ``structured_outputs``, by the engine (to compile and check its spec) and by the runner.

    Raises:
        StructuredOutputError: no tokenizer (token-id-only models), or xgrammar missing
            (``pip install 'deepinfer_kit[structured]'``).
    """
    from deepinfer_kit.sample.structured.xgrammar_backend import XGrammarBackend

    if tokenizer is None:
        raise StructuredOutputError("structured_outputs needs the model's tokenizer, and this engine has none")
    return XGrammarBackend.from_tokenizer(tokenizer, vocab_size, tuple(stop_token_ids))
