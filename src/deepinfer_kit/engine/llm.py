"""LLM: the batch API — ``LLM("tiny").generate(prompts, params)`` — over an Engine."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Union

from deepinfer_kit.engine.build import build_engine
from deepinfer_kit.engine.config import EngineConfig
from deepinfer_kit.engine.engine import Engine
from deepinfer_kit.errors import ConfigError
from deepinfer_kit.outputs import RequestOutput
from deepinfer_kit.sample.params import SamplingParams

__all__ = ["LLM", "PromptInput"]

PromptInput = Union[str, Sequence[int], Sequence[str], Sequence[Sequence[int]]]
"""One prompt (text or token ids) or a list of them."""

_PROGRESS_MIN = 8  # show a progress bar from this many prompts on


def _normalize(prompts: PromptInput) -> list[str | list[int]]:
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    ints = [p for p in items if isinstance(p, int) and not isinstance(p, bool)]
    if items and len(ints) == len(items):
        return [ints]
    out: list[str | list[int]] = []
    for i, p in enumerate(items):
        if isinstance(p, str):
            out.append(p)
        elif isinstance(p, Sequence):
            out.append(list(p))
        else:
            raise ConfigError(f"prompts[{i}] must be text or a list of token ids, got {p!r}")
    return out


class LLM:
    """Generate completions for a batch of prompts.

    Args:
        model: a Hugging Face checkpoint folder, or ``"tiny"`` (the embedded model).
        engine: an already built :class:`Engine` to use instead of building one.
        **config: other :class:`EngineConfig` fields (``device``, ``dtype``, ``num_blocks``…).
    """

    def __init__(self, model: str = "tiny", *, engine: Engine | None = None, **config: Any) -> None:
        self.engine = engine if engine is not None else build_engine(EngineConfig(model=model, **config))

    def generate(
        self,
        prompts: PromptInput,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order.

        Args:
            prompts: a text, a list of token ids, or a list of either.
            sampling_params: one for all prompts, or one per prompt (default: greedy-free
                ``SamplingParams()``).
            use_tqdm: show a progress bar (default: for 8 prompts or more).

        Raises:
            ConfigError: a bad prompt or parameter; then no prompt is run.
        """
        items = _normalize(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(items)
        else:
            params = list(sampling_params)
            if len(params) != len(items):
                raise ConfigError(
                    f"sampling_params must be one or one per prompt ({len(items)}), "
                    f"got {len(params)}"
                )
        for p in items:
            self.engine.encode(p)  # validate all before queuing any
        ids = [self.engine.add_request(None, p, sp) for p, sp in zip(items, params)]
        show = use_tqdm if use_tqdm is not None else len(ids) >= _PROGRESS_MIN
        results: dict[str, RequestOutput] = {}
        bar = _progress(len(ids)) if show else None
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    results[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
            for out in self.engine.flush():
                results[out.request_id] = out
        finally:
            if bar is not None:
                bar.close()
        return [results[i] for i in ids]


def _progress(total: int) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="generate", unit="req", dynamic_ncols=True)
