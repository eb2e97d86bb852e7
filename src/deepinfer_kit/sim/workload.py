"""Seeded workloads: arrivals (Poisson, bursty, all at once), prompt and output lengths,
shared system prompts and multi-turn conversations."""

from __future__ import annotations

import random

import attrs

from deepinfer_kit._validators import int_at_least, one_of
from deepinfer_kit.errors import ConfigError
from deepinfer_kit.sim.lengths import LengthDist
from deepinfer_kit.sim.records import SimRequest

__all__ = ["WorkloadConfig", "generate"]


def _fraction(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ConfigError(f"{attribute.name} must be in [0, 1], got {value!r}")


def _non_negative(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not value >= 0:
        raise ConfigError(f"{attribute.name} must be >= 0, got {value!r}")


@attrs.frozen(slots=True)
class WorkloadConfig:
    """What :func:`generate` draws.

    Attributes:
        num_requests: requests in all (every turn of a conversation counts one).
        seed: the same seed gives the same workload.
        arrival: ``"poisson"`` (exponential gaps), ``"bursty"`` (bursts of a geometric
            number of requests, mean ``burst_size``, arriving together at Poisson
            epochs) or ``"batch"`` (everything at time 0).
        rate: first turns per second (``poisson`` and ``bursty``).
        burst_size: mean requests per burst (``bursty``).
        prompt_len, output_len: lengths of a first turn's prompt and of every output.
        shared_fraction: fraction of first turns that open with a shared system prompt.
        shared_prefix_len: tokens of a system prompt (cut to ``prompt_len - 1``).
        num_shared_prefixes: distinct system prompts, picked uniformly.
        eos_fraction: fraction of requests that end with EOS (the rest by length).
        multi_turn_fraction: fraction of conversations with follow-up turns.
        turns: turns of a multi-turn conversation (>= 2 for follow-ups to exist).
        followup_len: new user tokens of a follow-up turn (the history is prepended).
        think_time: mean seconds (exponential) between a turn's end and the next turn.
        priority_levels: priorities are drawn uniformly from ``range(priority_levels)``.

    Raises:
        ConfigError: a field out of range (the message names it and the value).
    """

    num_requests: int = attrs.field(default=1000, validator=int_at_least(1))
    seed: int = attrs.field(default=0, validator=int_at_least(0))
    arrival: str = attrs.field(default="poisson", validator=one_of(("poisson", "bursty", "batch")))
    rate: float = attrs.field(default=10.0, validator=_non_negative)
    burst_size: float = attrs.field(default=8.0, validator=_non_negative)
    prompt_len: LengthDist = LengthDist("lognormal", 500.0, 0.6)
    output_len: LengthDist = LengthDist("lognormal", 200.0, 0.6)
    shared_fraction: float = attrs.field(default=0.3, validator=_fraction)
    shared_prefix_len: int = attrs.field(default=256, validator=int_at_least(0))
    num_shared_prefixes: int = attrs.field(default=1, validator=int_at_least(1))
    eos_fraction: float = attrs.field(default=0.5, validator=_fraction)
    multi_turn_fraction: float = attrs.field(default=0.0, validator=_fraction)
    turns: int = attrs.field(default=3, validator=int_at_least(1))
    followup_len: LengthDist = LengthDist("lognormal", 100.0, 0.6)
    think_time: float = attrs.field(default=5.0, validator=_non_negative)
    priority_levels: int = attrs.field(default=1, validator=int_at_least(1))

    def __attrs_post_init__(self) -> None:
        if self.arrival != "batch" and self.rate <= 0:
            raise ConfigError(f"rate must be > 0 for {self.arrival} arrivals, got {self.rate}")
        if self.arrival == "bursty" and self.burst_size < 1:
            raise ConfigError(f"burst_size must be >= 1, got {self.burst_size}")

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> WorkloadConfig:
        """A config from JSON-like data; length fields take ``LengthDist.parse`` text or
        a dict of its fields.

        Raises:
            ConfigError: unknown field, or a value the validators reject.
        """
        kwargs: dict[str, object] = {}
        for key, value in data.items():
            if key in ("prompt_len", "output_len", "followup_len"):
                if isinstance(value, dict):
                    value = LengthDist(**value)
                elif isinstance(value, (str, int, float)):
                    value = LengthDist.parse(str(value))
            kwargs[key] = value
        try:
            return cls(**kwargs)  # type: ignore[arg-type]
        except TypeError as exc:
            raise ConfigError(f"bad workload field in {sorted(data)}: {exc}") from exc


def generate(config: WorkloadConfig) -> list[SimRequest]:
    """The workload ``config`` describes: first turns in arrival order, each followed by
    its follow-up turns (``after`` names the previous turn; they arrive ``think_time``
    after it ends, decided during the simulation). Pure given the seed; O(requests).

    Request ids are ``"c{conversation}"`` for a first turn and ``"c{conversation}.{turn}"``
    for a follow-up.
    """
    rng = random.Random(config.seed)
    out: list[SimRequest] = []
    t = 0.0
    burst_left = 0
    conv = 0
    while len(out) < config.num_requests:
        if config.arrival == "poisson":
            t += rng.expovariate(config.rate)
        elif config.arrival == "bursty":
            if burst_left == 0:
                t += rng.expovariate(config.rate / config.burst_size)
                p = 1.0 / config.burst_size  # geometric burst sizes with this mean
                burst_left = 1
                while rng.random() > p:
                    burst_left += 1
            burst_left -= 1
        prompt_len = max(config.prompt_len.sample(rng), 1)
        shared, shared_len = -1, 0
        if config.shared_fraction and rng.random() < config.shared_fraction:
            shared = rng.randrange(config.num_shared_prefixes)
            shared_len = min(config.shared_prefix_len, prompt_len - 1)
        rid = f"c{conv}"
        out.append(SimRequest(
            rid, t, prompt_len, config.output_len.sample(rng),
            rng.random() < config.eos_fraction, rng.randrange(config.priority_levels),
            shared, shared_len,
        ))
        turns = config.turns if rng.random() < config.multi_turn_fraction else 1
        for turn in range(1, turns):
            if len(out) >= config.num_requests:
                break
            follow = f"c{conv}.{turn}"
            out.append(SimRequest(
                follow, 0.0, max(config.followup_len.sample(rng), 1),
                config.output_len.sample(rng), rng.random() < config.eos_fraction,
                out[-1].priority, after=rid, think_time=rng.expovariate(1.0 / config.think_time)
                if config.think_time > 0 else 0.0,
            ))
            rid = follow
        conv += 1
    return out
