"""KitSampler and KitTopKTopPSampler: the kit's vectorized sampler behind vLLM v1's
``Sampler.forward(logits, sampling_metadata)`` and ``TopKTopPSampler.forward(logits,
generators, k, p)`` interfaces."""

from __future__ import annotations

from typing import Any

import torch

from deepinfer_kit._kernels import Impl
from deepinfer_kit.adapters._peers import check_peer_version
from deepinfer_kit.adapters.vllm.versions import TESTED_VLLM
from deepinfer_kit.errors import ConfigError
from deepinfer_kit.sample.functional import sample
from deepinfer_kit.sample.vectorized import VectorizedSampler

__all__ = ["KitSampler", "KitTopKTopPSampler"]

_EPS = 1e-5  # a temperature below this is greedy, as in vLLM's sampler


def _seeds(generators: dict[int, torch.Generator], rows: int) -> list[int | None] | None:
    """One kit seed per row that has a vLLM generator, drawn from it (so the generator
    advances each step, as vLLM's draw advances it); ``None`` for the other rows."""
    if not generators:
        return None
    seeds: list[int | None] = [None] * rows
    for i, g in generators.items():
        seeds[i] = int(torch.randint(0, 2**62, (1,), generator=g, device=g.device).item())
    return seeds


def _top_k(k: torch.Tensor | None, vocab: int) -> list[int] | int:
    """vLLM's top-k tensor (``vocab`` or more means off) as the kit's (0 means off)."""
    if k is None:
        return 0
    return [v if 0 < v < vocab else 0 for v in k.tolist()]


class KitTopKTopPSampler:
    """vLLM's ``TopKTopPSampler`` interface over the kit's sampler: ``forward(logits,
    generators, k, p) -> (tokens [B] int64, None)``.

    ``logits`` ``[B, V]`` are already temperature-scaled (vLLM's sampler divides before
    calling); read, never mutated. ``k`` / ``p``: ``[B]`` tensors or ``None`` (off);
    ``generators``: row index -> ``torch.Generator`` for seeded rows. The kit draws from
    the same top-k / top-p set (its own draw, not vLLM's random stream: a seeded row is
    reproducible, not bit-identical to vLLM). Processed logits/logprobs are not returned.

    Args:
        impl: the kit sampler's kernels, ``"auto"``, ``"ref"`` or ``"triton"``.
        strict_version: raise on an untested vLLM version.

    Raises:
        PeerVersionError: vLLM is missing or untested (with ``strict_version``).
    """

    def __init__(self, impl: Impl = "auto", *, strict_version: bool = True) -> None:
        self.peer_version = check_peer_version("vllm", TESTED_VLLM, strict=strict_version)
        self.sampler = VectorizedSampler(impl)

    def forward(
        self,
        logits: torch.Tensor,
        generators: dict[int, torch.Generator],
        k: torch.Tensor | None,
        p: torch.Tensor | None,
    ) -> tuple[torch.Tensor, None]:
        """Draw one token per row; see the class docstring. Raises ``ConfigError`` for
        malformed inputs (from the kit's ``sample``)."""
        rows, vocab = logits.shape
        tokens = sample(
            logits,
            temperature=1.0,
            top_k=_top_k(k, vocab),
            top_p=1.0 if p is None else p,
            seeds=_seeds(generators, rows),
            sampler=self.sampler,
        )
        return tokens, None

    __call__ = forward


class KitSampler:
    """vLLM v1's ``Sampler`` interface over the kit's sampler:
    ``forward(logits, sampling_metadata) -> SamplerOutput`` (``sampled_token_ids``
    ``[B, 1]`` int32, no logprobs).

    Applies, in vLLM's order: the allowed-token mask and vLLM's non-argmax-invariant
    logits processors (logit bias, min tokens: vLLM's own objects, run as vLLM runs
    them); then the kit draws with per-row temperature (below 1e-5: greedy), top-k,
    top-p and the min-p of vLLM's ``MinPLogitsProcessor`` when present. Seeded rows
    (``generators``) are reproducible, not bit-identical to vLLM's stream.

    Not covered (``ConfigError``): logprobs (``max_num_logprobs``, ``logprob_token_ids``),
    penalties, bad words, speculative bonus tokens, a thinking budget, argmax-invariant
    logits processors other than min-p.

    Args: as :class:`KitTopKTopPSampler`.
    """

    def __init__(self, impl: Impl = "auto", *, strict_version: bool = True) -> None:
        from vllm.v1.outputs import SamplerOutput
        from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor

        self.topk_topp = KitTopKTopPSampler(impl, strict_version=strict_version)
        self._output = SamplerOutput
        self._min_p_type = MinPLogitsProcessor

    def forward(
        self,
        logits: torch.Tensor,
        sampling_metadata: Any,
        predict_bonus_token: bool = False,
        logprobs_mode_override: str | None = None,
    ) -> Any:
        """Draw one token per row of ``logits`` ``[B, V]`` (not mutated) under vLLM's
        ``SamplingMetadata``; returns vLLM's ``SamplerOutput``.

        Raises:
            ConfigError: the metadata asks for something not covered (named).
        """
        md = sampling_metadata
        _check_covered(md, predict_bonus_token)
        x = logits.float()
        if md.allowed_token_ids_mask is not None or md.logitsprocs.non_argmax_invariant:
            x = x.clone() if x is logits else x
            if md.allowed_token_ids_mask is not None:
                x.masked_fill_(md.allowed_token_ids_mask[: x.shape[0]], float("-inf"))
            for proc in md.logitsprocs.non_argmax_invariant:
                x = proc.apply(x)
        rows, vocab = x.shape
        min_p: torch.Tensor | float = 0.0
        for proc in md.logitsprocs.argmax_invariant:
            if not isinstance(proc, self._min_p_type):
                raise ConfigError(f"logits processor {type(proc).__name__} is not covered by the kit's sampler")
            if proc.min_p_count:
                min_p = proc.min_p.reshape(-1)[:rows]
        if md.all_greedy:
            temperature: torch.Tensor | float = 0.0
        else:
            temperature = md.temperature.masked_fill(md.temperature < _EPS, 0.0)
        tokens = sample(
            x,
            temperature=temperature,
            top_k=_top_k(md.top_k, vocab),
            top_p=1.0 if md.top_p is None else md.top_p,
            min_p=min_p,
            seeds=_seeds(md.generators, rows),
            sampler=self.topk_topp.sampler,
        )
        return self._output(sampled_token_ids=tokens.to(torch.int32).unsqueeze(-1), logprobs_tensors=None)

    __call__ = forward


def _check_covered(md: Any, predict_bonus_token: bool) -> None:
    """Raise ``ConfigError`` naming the first metadata feature the adapter leaves out."""
    if md.max_num_logprobs is not None or md.logprob_token_ids:
        raise ConfigError("logprobs (max_num_logprobs / logprob_token_ids) are not covered by the kit's sampler")
    if not md.no_penalties:
        raise ConfigError("penalties (no_penalties=False) are not covered by the kit's sampler")
    if md.bad_words_token_ids:
        raise ConfigError("bad_words_token_ids are not covered by the kit's sampler")
    if predict_bonus_token or md.spec_token_ids:
        raise ConfigError("speculative bonus tokens are not covered by the kit's sampler")
    holder = md.thinking_budget_state_holder
    if holder is not None and holder.has_tracked_requests():
        raise ConfigError("a thinking-token budget is not covered by the kit's sampler")
