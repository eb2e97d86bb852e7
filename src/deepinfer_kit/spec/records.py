"""Records of the spec package: a draft proposal, a verification result, an SPS curve, the
speculative config, and a sequence as a drafter sees it.

Shape symbols: ``R`` requests, ``γ`` (gamma) draft length, ``V`` vocabulary. Imports
without torch (tensors appear in annotations only), so configs and planners stay host-only.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from deepinfer_kit._validators import config_from, int_at_least, one_of
from deepinfer_kit.errors import ConfigError

if TYPE_CHECKING:
    from deepinfer_kit.sample.params import SamplingParams
    from deepinfer_kit.sample.records import SamplingBatch
    import torch

__all__ = ["DraftProposal", "DraftView", "VerifyResult", "VerifyRows", "SpsCurve", "SpecConfig", "MAX_NUM_DRAFT"]


@attrs.define(slots=True, eq=False)
class DraftProposal:
    """Draft tokens for ``R`` requests.

    Attributes:
        token_ids: ``[R, γ]`` int64, drafted tokens (rows shorter than γ are padded; see
            ``num_drafted``).
        num_drafted: ``[R]`` drafts actually proposed per request (``<= γ``).
        draft_probs: ``[R, γ, V]`` float32, the drafter's distribution at each position
            (needed by strict rejection sampling); ``None`` for deterministic drafters,
            treated as one-hot on ``token_ids``.
        confidence: ``[R, γ]`` float32 in ``[0, 1]``, the drafter's estimate that each
            draft is accepted given the previous ones; ``None`` when not estimated.
    """

    token_ids: torch.Tensor
    num_drafted: list[int]
    draft_probs: torch.Tensor | None = None
    confidence: torch.Tensor | None = None


@attrs.define(slots=True, eq=False)
class VerifyResult:
    """Accepted tokens per request.

    Attributes:
        token_ids: ``[R]`` lists: the accepted drafts followed by one recovered (on
            rejection) or bonus (all accepted) token; length ``num_accepted + 1``.
        num_accepted: ``[R]`` accepted drafts, in ``[0, ℓ_r]``.
    """

    token_ids: list[list[int]]
    num_accepted: list[int]


@attrs.define(slots=True, eq=False)
class VerifyRows:
    """The flat rows of one verification, as the runner lays a round out: request ``r``
    verifying ``ℓ_r`` drafts owns rows ``offsets[r] .. offsets[r] + ℓ_r``; its row ``j``
    holds the target's logits after draft ``j - 1`` and the sampling row of output
    position ``q_r + j``, with ``drafts[r][:j]`` counted as generated (penalties,
    ``min_tokens``: :func:`~deepinfer_kit.spec.verify.rows.row_histories`).

    Attributes:
        logits: ``[M, V]`` target logits, ``M = sum(ℓ_r + 1)``, request-major.
        batch: ``M`` sampling rows.
        drafts: ``[R]`` host lists, the ``ℓ_r`` drafts of each request.
        offsets: ``[R + 1]`` first flat row of each request, then ``M``.
    """

    logits: torch.Tensor
    batch: SamplingBatch
    drafts: list[list[int]]
    offsets: list[int]


def _int_tuple(values: Iterable[int]) -> tuple[int, ...]:
    return tuple(values)


def _float_tuple(values: Iterable[float]) -> tuple[float, ...]:
    return tuple(float(v) for v in values)


@attrs.frozen(slots=True)
class SpsCurve:
    """Profiled steps per second as a function of verified tokens in a step, ``SPS(B)``.

    Two readings between the profiled counts. ``staircase=False`` (a roofline): the step
    time ``1 / SPS`` is interpolated linearly (a step's time is what adds up, and a
    roofline's time is piecewise linear in ``B``; SPS itself is convex past the knee, so
    interpolating it would overstate it). ``staircase=True`` (rounds replayed as captured
    graphs, or padded to a ladder of sizes): a round of ``B`` tokens costs the time of
    the smallest profiled count ``>= B``. Either way, past the last count the time keeps
    growing at the last segment's per-token cost (never shrinking); below the first it is
    the first point's.

    Attributes:
        batch_tokens: increasing token counts ``B`` at which SPS was measured.
        steps_per_second: the measured SPS at each count.
        staircase: read the curve as a staircase (see above).
    """

    batch_tokens: tuple[int, ...] = attrs.field(converter=_int_tuple)
    steps_per_second: tuple[float, ...] = attrs.field(converter=_float_tuple)
    staircase: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    _times: tuple[float, ...] = attrs.field(init=False, eq=False, repr=False, default=())

    def __attrs_post_init__(self) -> None:
        xs, ys = self.batch_tokens, self.steps_per_second
        if not xs or len(xs) != len(ys):
            raise ConfigError(
                f"SpsCurve needs as many batch_tokens as steps_per_second (at least one), "
                f"got {len(xs)} and {len(ys)}"
            )
        if any(b >= a for a, b in zip(xs[1:], xs)):
            raise ConfigError(f"SpsCurve batch_tokens must increase, got {xs}")
        if not all(math.isfinite(y) and y > 0 for y in ys):
            raise ConfigError(f"SpsCurve steps_per_second must be finite and > 0, got {ys}")
        object.__setattr__(self, "_times", tuple(1.0 / y for y in ys))

    @classmethod
    def ladder(cls, sizes: Sequence[int], seconds: Sequence[float]) -> SpsCurve:
        """The staircase of a ladder of round sizes and their step times (seconds)."""
        if any(not (math.isfinite(t) and t > 0) for t in seconds):
            raise ConfigError(f"SpsCurve.ladder seconds must be finite and > 0, got {list(seconds)}")
        return cls(tuple(sizes), tuple(1.0 / t for t in seconds), staircase=True)

    @property
    def times(self) -> tuple[float, ...]:
        """``1 / steps_per_second``: the step time (seconds) at each profiled count."""
        return self._times

    def step_time(self, tokens: int) -> float:
        """Seconds of a step of ``tokens`` tokens, ``1 / SPS(tokens)``. O(log n)."""
        xs, ts = self.batch_tokens, self._times
        if tokens <= xs[0]:
            return ts[0]
        i = bisect_left(xs, tokens)
        if i == len(xs):
            if len(xs) == 1:
                return ts[0]
            slope = max(0.0, (ts[-1] - ts[-2]) / (xs[-1] - xs[-2]))
            return ts[-1] + slope * (tokens - xs[-1])
        if self.staircase:
            return ts[i]
        frac = (tokens - xs[i - 1]) / (xs[i] - xs[i - 1])
        return ts[i - 1] + frac * (ts[i] - ts[i - 1])

    def __call__(self, tokens: int) -> float:
        """``SPS(tokens)`` (see the class docstring for how it reads between points)."""
        return 1.0 / self.step_time(tokens)


DRAFTERS = ("ngram", "draft_model", "self", "dspark")

#: The most drafts per request and round (``num_draft``): verified rows are padded to γ + 1,
#: and past a few dozen drafts the chance that all survive is nil for any real drafter.
MAX_NUM_DRAFT = 64


def _named(value: Any) -> bool:
    return isinstance(value, str) and bool(value)


def _positive_int(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= 1


# (field, the drafter that reads it, what it must be, its check)
_DRAFTER_FIELDS: tuple[tuple[str, str, str, Callable[[Any], bool]], ...] = (
    ("draft_model", "draft_model", "must name a checkpoint folder (or 'tiny')", _named),
    ("draft_layers", "self", "must be an int >= 1", _positive_int),
    ("dspark_heads", "dspark", "must name a heads file (or 'tiny-words')", _named),
)


def _check_num_draft(instance: Any, attribute: attrs.Attribute[int], value: Any) -> None:
    if not _positive_int(value) or value > MAX_NUM_DRAFT:
        raise ConfigError(
            f"speculative.num_draft must be an int in [1, {MAX_NUM_DRAFT}], got {value!r}"
        )


def _check_threshold(instance: Any, attribute: attrs.Attribute[float], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise ConfigError(f"speculative.threshold must be a finite number >= 0, got {value!r}")


def _check_sps(instance: Any, attribute: attrs.Attribute[SpsCurve | str | None], value: Any) -> None:
    if value is not None and value != "profile" and not isinstance(value, SpsCurve):
        raise ConfigError(f"speculative.sps must be an SpsCurve, 'profile' or None, got {value!r}")


@attrs.frozen(slots=True)
class SpecConfig:
    """Speculative decoding of an engine: who drafts, how many, who picks the lengths.

    Attributes:
        drafter: ``"ngram"`` (prompt lookup over the request's own tokens),
            ``"draft_model"`` (a small checkpoint sharing the tokenizer, ``draft_model``)
            ``"self"`` (the target's first ``draft_layers`` layers and its LM head) or
            ``"dspark"`` (DSpark heads, ``dspark_heads``, above the target's first layers).
        num_draft: ``γ``, drafts proposed per request and round, in ``[1, MAX_NUM_DRAFT]``
            (and below the engine's ``max_model_len``).
        planner: ``"fixed"`` (verify all ``γ``), ``"threshold"`` (while the drafts clear
            ``threshold``) or ``"dspark"`` (maximise ``τ · SPS(B)``).
        threshold: the static planner's threshold.
        threshold_rule: what the threshold planner compares with it: ``"survival"`` (the
            cumulative product of the confidences, the estimated chance a draft is kept) or
            ``"step"`` (each draft's own confidence, DeepSpec's early stop); see
            :class:`~deepinfer_kit.spec.planners.ThresholdPlanner`.
        ngram_min, ngram_max: n-gram sizes the n-gram drafter tries (longest first).
        sps: the ``SPS(B)`` curve of the DSpark planner; ``None`` or ``"profile"`` measure
            it when the engine is built (the target's forward timed at powers of two up to
            ``max_num_batched_tokens`` and around the knee, ``engine.sps_profile``; a
            second or two on CPU). The other planners ignore it.
        sps_online: correct the DSpark planner's curve from the round times the runner
            measures (:class:`~deepinfer_kit.spec.sps_online.MeasuredSps`: per profiled
            count, the median ratio of measured to profiled time over the last 9 rounds).
            Off by default: the plans then depend on timing, which an engine's decisions
            otherwise never do. Only with ``planner="dspark"``.
        draft_model: the draft checkpoint folder of ``drafter="draft_model"`` (``"tiny"``:
            the embedded model built from the engine's seed). Its vocabulary must be the
            target's.
        draft_layers: ``k`` of ``drafter="self"``, in ``[1, target layers]``.
        dspark_heads: the heads file of ``drafter="dspark"`` (a safetensors path, or
            ``"tiny-words"``: the heads shipped for that embedded model); the backbone depth
            is the file's. ``num_draft`` must not exceed its positions.
    """

    drafter: str = attrs.field(default="ngram", validator=one_of(DRAFTERS))
    num_draft: int = attrs.field(default=4, validator=_check_num_draft)
    planner: str = attrs.field(default="fixed", validator=one_of(("fixed", "threshold", "dspark")))
    threshold: float = attrs.field(default=0.3, validator=_check_threshold)
    threshold_rule: str = attrs.field(default="survival", validator=one_of(("survival", "step")))
    ngram_min: int = attrs.field(default=1, validator=int_at_least(1))
    ngram_max: int = attrs.field(default=3, validator=int_at_least(1))
    sps: SpsCurve | str | None = attrs.field(default=None, validator=_check_sps)
    sps_online: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    draft_model: str | None = attrs.field(default=None)
    draft_layers: int | None = attrs.field(default=None)
    dspark_heads: str | None = attrs.field(default=None)

    def __attrs_post_init__(self) -> None:
        if self.ngram_max < self.ngram_min:
            raise ConfigError(
                f"speculative.ngram_max must be >= ngram_min ({self.ngram_min}), got {self.ngram_max}"
            )
        if self.sps_online and self.planner != "dspark":
            raise ConfigError(f"speculative.sps_online corrects the DSpark planner's curve; "
                              f"planner is {self.planner!r}")
        self._check_draft_fields()

    def _check_draft_fields(self) -> None:
        """``draft_model`` / ``draft_layers`` / ``dspark_heads``: each required by its
        drafter, refused by the others."""
        for field, owner, need, ok in _DRAFTER_FIELDS:
            value = getattr(self, field)
            if self.drafter == owner:
                if not ok(value):
                    raise ConfigError(
                        f"speculative.{field} {need} when drafter='{owner}', got {value!r}"
                    )
            elif value is not None:
                raise ConfigError(
                    f"speculative.{field} is read only by drafter='{owner}' (drafter is "
                    f"{self.drafter!r}), got {value!r}"
                )

    @classmethod
    def coerce(cls, value: SpecConfig | Mapping[str, Any] | None) -> SpecConfig | None:
        """A :class:`SpecConfig` from itself, ``None``, or a plain dict with the same keys
        (as vLLM's ``speculative_config``).

        Raises:
            ConfigError: another type, an unknown key, or a bad value.
        """
        return config_from(cls, value, "speculative")


@attrs.frozen(slots=True)
class DraftView:
    """A sequence as a drafter sees it when a round executes (a
    :class:`~deepinfer_kit.spec.protocols.DraftSequence`): the runner builds one from the
    planned chunk's snapshots plus the tokens the round before emitted
    (:class:`~deepinfer_kit.engine.runner.drafting.RunnerDrafting`)."""

    request_id: str
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    all_token_ids: list[int]
    params: SamplingParams
    seed: int | None
    eos_token_id: int | None
