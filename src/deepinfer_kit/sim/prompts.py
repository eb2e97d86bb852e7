"""PromptBuilder: a simulated request's prompt token ids, made when it arrives."""

from __future__ import annotations

from collections.abc import Sequence

from deepinfer_kit.sim.records import SimRequest
from deepinfer_kit.sim.tokens import token_stream

__all__ = ["PromptBuilder"]


class PromptBuilder:
    """Materializes prompts lazily (100,000 prompts of 500 ids would not fit in memory
    as Python lists; one live batch does).

    A prompt is the request's shared system prompt (if any), then its own tokens drawn
    from SHAKE-128 of ``(seed, request_id)``; a follow-up turn's prompt is the previous
    turn's prompt and output, then its own tokens. Ids lie in ``[0, vocab_size)``.

    Args:
        vocab_size: the model's vocabulary.
        seed: varies every prompt.
    """

    __slots__ = ("vocab_size", "seed", "_prefixes")

    def __init__(self, vocab_size: int, seed: int = 0) -> None:
        self.vocab_size = vocab_size
        self.seed = seed
        self._prefixes: dict[int, list[int]] = {}

    def build(self, request: SimRequest, history: Sequence[int] = ()) -> list[int]:
        """The prompt of ``request``: ``history`` (a follow-up's previous turn, prompt
        plus output) + its system prompt + its own tokens, or its explicit
        ``prompt_token_ids``. Caches each system prompt; O(prompt)."""
        if request.prompt_token_ids is not None:
            return [*history, *request.prompt_token_ids]
        k = request.shared_prefix_len if request.shared_prefix >= 0 else 0
        k = min(k, request.prompt_len - 1) if request.after is None else k
        own = token_stream(f"{self.seed}:p:{request.request_id}", request.prompt_len - k,
                           self.vocab_size)
        if k <= 0:
            return [*history, *own] if history else own
        prefix = self._prefixes.get(request.shared_prefix)
        if prefix is None or len(prefix) < k:
            prefix = token_stream(f"{self.seed}:sys:{request.shared_prefix}", k, self.vocab_size)
            self._prefixes[request.shared_prefix] = prefix
        return [*history, *prefix[:k], *own]
