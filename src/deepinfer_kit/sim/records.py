"""Records of the sim package: a simulated request, the shape of one step, a step's
simulated execution."""

from __future__ import annotations


import attrs

from deepinfer_kit.sched.records import SchedulePlan

__all__ = ["SimRequest", "StepShape", "SimStep"]


@attrs.define(slots=True, eq=False)
class SimRequest:
    """One request of a workload, before it becomes a scheduler ``Request``.

    Mutable and unvalidated (a workload holds 100,000 of them; build them through
    :mod:`deepinfer_kit.sim.workload`, which validates its own config). The prompt's
    token ids are materialized only when the request arrives.

    Attributes:
        request_id: unique in the workload.
        arrival_time: virtual seconds; ignored for a follow-up turn (``after`` set).
        prompt_len: prompt tokens (for a follow-up: the new user tokens only; the
            previous turn's prompt and output are prepended when it is released).
        output_len: tokens the synthetic model generates (``max_tokens``).
        stop_by_eos: the last output token is EOS (finish ``stop``) rather than the
            length limit (finish ``length``).
        priority: lower values are served first by the ``priority`` policy.
        shared_prefix: index of the shared system prompt the prompt opens with, or -1.
        shared_prefix_len: tokens of that system prompt (at most ``prompt_len - 1``).
        after: the request id of the previous turn of its conversation, or ``None``.
        think_time: virtual seconds between the previous turn's end and this arrival.
        prompt_token_ids: explicit prompt tokens (a trace may give them), else ``None``.
    """

    request_id: str
    arrival_time: float
    prompt_len: int
    output_len: int
    stop_by_eos: bool = False
    priority: int = 0
    shared_prefix: int = -1
    shared_prefix_len: int = 0
    after: str | None = None
    think_time: float = 0.0
    prompt_token_ids: list[int] | None = None


@attrs.define(slots=True)
class StepShape:
    """The work of one round, in the terms cost models price.

    Attributes:
        num_prefill_tokens: tokens of prefill (or recompute) chunks.
        num_decode_rows: decode chunks (one token each).
        num_context_tokens: KV positions the round's attention reads, ``sum end_i``.
        num_sampled_rows: chunks whose logits are sampled (LM-head rows).
        attention_pairs: (query, key) pairs of causal attention, ``sum q_i * start_i +
            q_i * (q_i + 1) / 2``.
        num_chunks: chunks in the round.
        num_spec_tokens: draft tokens verified (fed after a decode chunk's known token;
            each is a token of work and an LM-head row).
        num_window_context_tokens: KV positions a sliding-window layer reads, ``sum
            min(end_i, window + q_i - 1)`` (0 when the shape was built without a window).
        window_attention_pairs: (query, key) pairs of a sliding-window layer (each query
            reads at most ``window`` keys).
        num_kv_transfer_tokens: tokens of KV copied between the device pool and the host
            tier before the round's forward (saves and loads of the KV tiers).
        num_kv_layerwise_load_tokens: of ``num_kv_transfer_tokens``, the loads that land
            layer by layer beside the forward (``TierConfig.layerwise_loads``): only the
            first layer's copy, and what the rest take beyond the forward, add to the round.
    """

    num_prefill_tokens: int = 0
    num_decode_rows: int = 0
    num_context_tokens: int = 0
    num_sampled_rows: int = 0
    attention_pairs: int = 0
    num_chunks: int = 0
    num_spec_tokens: int = 0
    num_window_context_tokens: int = 0
    window_attention_pairs: int = 0
    num_kv_transfer_tokens: int = 0
    num_kv_layerwise_load_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        """Tokens fed to the model this round."""
        return self.num_prefill_tokens + self.num_decode_rows + self.num_spec_tokens


@attrs.define(slots=True, eq=False)
class SimStep:
    """A plan laid out by the :class:`~deepinfer_kit.sim.runner.SimRunner`.

    Attributes:
        plan: the plan it was built from.
        shape: the round's work.
        duration: virtual seconds the round takes (the cost model's price of ``shape``).
    """

    plan: SchedulePlan
    shape: StepShape
    duration: float

