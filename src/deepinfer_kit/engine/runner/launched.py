"""LaunchedStep: a step whose device work ``ModelRunner.launch`` has queued, with what
``ModelRunner.finish`` needs to wait for its tokens and build its result."""

from __future__ import annotations

import attrs
import torch

from deepinfer_kit.engine.runner.prepared import PreparedStep
from deepinfer_kit.engine.runner.prompt_logprobs import PromptMaps
from deepinfer_kit.engine.runner.step_outputs import HostCopy
from deepinfer_kit.step import StepResult

__all__ = ["LaunchedStep"]


@attrs.define(slots=True, eq=False)
class LaunchedStep:
    """One launched step, not yet finished.

    Attributes:
        ordinal: the runner's count of launches when this one began; ``finish`` hands the
            step's history tokens to the next step only when no later launch began since.
        done: the whole result when it was known at launch (a step that draws nothing,
            a speculative round run to the end), else ``None``.
        step: the prepared step (also when ``done``: its plan names the chunks).
        copy: the queued copy back of the sampled rows (``None`` when ``done``).
        emitted: per verified chunk, tokens it emitted (in ``step.verified`` order).
        expert_counts: ``[L, E]`` routing counts of the round when traced (on the device,
            read by ``finish``), else ``None``.
        slot_counts: ``[L, P]`` per physical expert slot when traced with EPLB (on the
            device), else ``None``.
        prompt_maps: the queued prompt-logprob maps (built by ``finish``), or ``None``.
    """

    ordinal: int
    done: StepResult | None = None
    step: PreparedStep | None = None
    copy: HostCopy | None = None
    emitted: list[int] = attrs.field(factory=list)
    expert_counts: torch.Tensor | None = None
    slot_counts: torch.Tensor | None = None
    prompt_maps: PromptMaps | None = None
