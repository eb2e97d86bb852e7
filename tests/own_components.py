"""Small components of the tests' own, one per Protocol kind, each with an effect the engine
reports (trace, tokens, plans, hits, placements) or a count of its calls. Module-level,
so their factories pickle by reference into worker processes."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from deepinfer_kit.cache.free_list_allocator import FreeListBlockAllocator
from deepinfer_kit.cache.manager import BlockKVCacheManager
from deepinfer_kit.cache.radix_index import RadixPrefixIndex
from deepinfer_kit.components import BuildContext
from deepinfer_kit.eplb.deepseek import HierarchicalPlacementPolicy
from deepinfer_kit.eplb.records import Placement, Topology
from deepinfer_kit.moe.counts import copies_per_id
from deepinfer_kit.moe.local_dispatcher import LocalDispatcher
from deepinfer_kit.moe.records import Dispatched, Routing
from deepinfer_kit.moe.replica_layout import ReplicaLayout, Selection
from deepinfer_kit.overlap.sync import SyncExecutor
from deepinfer_kit.request import Request
from deepinfer_kit.sample.logprobs import attach_logprobs
from deepinfer_kit.sample.records import SampleResult, SamplingBatch
from deepinfer_kit.sched.batching import ContinuousBatching
from deepinfer_kit.sched.scheduler import BatchScheduler
from deepinfer_kit.sched.state import SchedulerState
from deepinfer_kit.sim.records import StepShape
from deepinfer_kit.spec.records import DraftProposal, VerifyResult, VerifyRows
from deepinfer_kit.spec.protocols import DraftSequence


# ---- host kinds --------------------------------------------------------------------------


class CountingAllocator(FreeListBlockAllocator):
    """The free-list pool, counting ``allocate`` calls."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks, block_size)
        self.calls = 0

    def allocate(self, n: int) -> list[int]:
        self.calls += 1
        return super().allocate(n)


def make_allocator(ctx: BuildContext) -> CountingAllocator:
    assert ctx.num_blocks is not None
    return CountingAllocator(ctx.num_blocks, ctx.block_size)


class MRUEvictionPolicy:
    """Evicts the most recently freed block first (the opposite of LRU)."""

    def __init__(self) -> None:
        self._order: OrderedDict[int, None] = OrderedDict()
        self.evicted: list[int] = []

    def __len__(self) -> int:
        return len(self._order)

    def push(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            self._order[b] = None

    def discard(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            self._order.pop(b, None)

    def touch(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            if b in self._order:
                self._order.move_to_end(b)

    def pop(self, n: int) -> list[int]:
        out = []
        while self._order and len(out) < n:
            out.append(self._order.popitem(last=True)[0])
        self.evicted += out
        return out


def make_mru(ctx: BuildContext) -> MRUEvictionPolicy:
    return MRUEvictionPolicy()


class CountingIndex(RadixPrefixIndex):
    """The radix index, counting lookups."""

    def __init__(self, block_size: int) -> None:
        super().__init__(block_size)
        self.lookups = 0

    def match(self, *args: Any, **kwargs: Any) -> Any:
        self.lookups += 1
        return super().match(*args, **kwargs)


def make_index(ctx: BuildContext) -> CountingIndex:
    return CountingIndex(ctx.block_size)


class CountingCache(BlockKVCacheManager):
    """The block manager, counting ``reset_prefix_cache`` calls."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(FreeListBlockAllocator(num_blocks, block_size), RadixPrefixIndex(block_size))
        self.resets = 0

    def reset_prefix_cache(self) -> bool:
        self.resets += 1
        return super().reset_prefix_cache()


def make_cache(ctx: BuildContext) -> CountingCache:
    assert ctx.num_blocks is not None
    return CountingCache(ctx.num_blocks, ctx.block_size)


def shortest_prompt_first(request: Request) -> tuple[float, ...]:
    """Admission key: the shortest prompt first, then arrival."""
    return (float(request.num_prompt_tokens), request.arrival_time)


class NewestVictim:
    """Preempts the most recently admitted running sequence, recording its id."""

    def __init__(self) -> None:
        self.victims: list[str] = []

    def __call__(self, running: Sequence[Request]) -> Request:
        victim = running[-1]
        self.victims.append(victim.request_id)
        return victim


class ShortPromptsOnly(ContinuousBatching):
    """Continuous batching that refuses prompts longer than ``limit`` tokens."""

    def __init__(self, limit: int = 40) -> None:
        self.limit = limit

    def never_fits(self, request: Request, state: SchedulerState) -> str | None:
        if request.num_prompt_tokens > self.limit:
            return f"ShortPromptsOnly refuses prompts over {self.limit} tokens"
        return super().never_fits(request, state)


class CountingScheduler(BatchScheduler):
    """Continuous batching, counting the rounds it planned."""

    def __init__(self, ctx: BuildContext) -> None:
        assert ctx.scheduler_config is not None and ctx.cache is not None
        super().__init__(ctx.scheduler_config, ctx.cache, ContinuousBatching(), clock=ctx.clock)
        self.rounds = 0

    def schedule(self) -> Any:
        self.rounds += 1
        return super().schedule()


class CountingExecutor(SyncExecutor):
    """The synchronous executor, counting launches."""

    def __init__(self) -> None:
        super().__init__()
        self.launches = 0

    def launch(self, step_id: int, run: Any) -> Any:
        self.launches += 1
        return super().launch(step_id, run)


class ConstantCost:
    """Every simulated round takes ``seconds``."""

    def __init__(self, seconds: float = 0.01) -> None:
        self.seconds = seconds

    def step_time(self, shape: StepShape) -> float:
        return self.seconds


def make_cost(ctx: BuildContext) -> ConstantCost:
    return ConstantCost(0.01)


# ---- device kinds ------------------------------------------------------------------------


class SecondBestSampler:
    """Picks each row's second most likely token (ties by lowest id): a sampler whose
    tokens differ from the built-in greedy one's."""

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SampleResult:
        top = torch.topk(logits.float(), 2, dim=-1).indices
        result = SampleResult(token_ids=top[:, 1].to(torch.int64))
        if batch.max_logprobs >= 0:
            attach_logprobs(result, logits.float(), batch.max_logprobs)
        return result


def make_sampler(ctx: BuildContext) -> SecondBestSampler:
    return SecondBestSampler()


class RepeatLastDrafter:
    """Drafts γ copies of each sequence's last token."""

    def propose(self, requests: Sequence[DraftSequence], num_draft: int) -> DraftProposal:
        rows = [[r.all_token_ids[-1]] * num_draft for r in requests]
        return DraftProposal(token_ids=torch.tensor(rows, dtype=torch.int64).view(len(requests), num_draft),
                             num_drafted=[num_draft] * len(requests))


def make_drafter(ctx: BuildContext) -> RepeatLastDrafter:
    return RepeatLastDrafter()


class OneDraftPlanner:
    """Verifies at most one draft per sequence."""

    def plan(self, confidence: Sequence[Sequence[float]], max_lengths: Sequence[int],
             other_tokens: int = 0) -> list[int]:
        return [min(1, n) for n in max_lengths]


def make_planner(ctx: BuildContext) -> OneDraftPlanner:
    return OneDraftPlanner()


class AcceptAllVerifier:
    """Accepts every draft it is asked to verify, then the target's own token after them
    (drawn by the engine's sampler): outputs then hold the drafts, whatever the model."""

    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler

    def verify(self, rows: VerifyRows, draft_probs: torch.Tensor | None = None) -> VerifyResult:
        last = [rows.offsets[r] + len(d) for r, d in enumerate(rows.drafts)]  # each request's bonus row
        bonus = self.sampler(rows.logits[last], rows.batch.select(last)).token_ids.tolist()
        return VerifyResult(token_ids=[[*d, t] for d, t in zip(rows.drafts, bonus)],
                            num_accepted=[len(d) for d in rows.drafts])


def make_verifier(ctx: BuildContext) -> AcceptAllVerifier:
    return AcceptAllVerifier(ctx.sampler)


class FirstExpertsRouter:
    """The checkpoint's gate (``base``) with every token sent to experts ``0 .. k-1``,
    weights kept: routed counts land on those experts only."""

    def __init__(self, base: Any) -> None:
        self.base = base

    @property
    def num_experts(self) -> int:
        return int(self.base.num_experts)

    @property
    def top_k(self) -> int:
        return int(self.base.top_k)

    def __call__(self, hidden: torch.Tensor) -> Routing:
        routing = self.base(hidden)
        ids = torch.arange(self.top_k, device=hidden.device).expand_as(routing.expert_ids).contiguous()
        return Routing(ids, routing.weights)


def make_router(ctx: BuildContext) -> FirstExpertsRouter:
    return FirstExpertsRouter(ctx.base)


class MutedDispatcher:
    """A local dispatcher whose combine drops the experts' output (the MoE block then
    adds only its shared expert): tokens differ from the built-in's."""

    def __init__(self, num_experts: int) -> None:
        self.inner = LocalDispatcher(num_experts)

    @property
    def local_experts(self) -> tuple[int, ...]:
        return self.inner.local_experts

    def dispatch(self, hidden: torch.Tensor, routing: Routing) -> Dispatched:
        return self.inner.dispatch(hidden, routing)

    def combine(self, expert_out: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        return torch.zeros(dispatched.num_tokens, expert_out.shape[1], dtype=expert_out.dtype,
                           device=expert_out.device)


def make_dispatcher(ctx: BuildContext) -> MutedDispatcher:
    assert ctx.moe is not None
    return MutedDispatcher(ctx.moe.num_experts)


class FirstReplicaSelector:
    """Every copy to its expert's first replica: the other replicas serve nothing."""

    name = "first"

    def select(self, expert_ids: torch.Tensor, counts: torch.Tensor, rank: int,
               layout: ReplicaLayout) -> Selection:
        slots = layout.log2phy[expert_ids, 0]
        return Selection(slots=slots, sent=copies_per_id(slots, layout.num_slots), quotas=None)


def make_selector(ctx: BuildContext) -> FirstReplicaSelector:
    return FirstReplicaSelector()


class FrozenPlacementPolicy:
    """Always the placement DeepSeek's policy makes of a uniform load (whatever the
    window), counting its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def place(self, load: torch.Tensor, topology: Topology) -> Placement:
        self.calls += 1
        return HierarchicalPlacementPolicy().place(torch.ones_like(load), topology)


def make_policy(ctx: BuildContext) -> FrozenPlacementPolicy:
    return FrozenPlacementPolicy()
