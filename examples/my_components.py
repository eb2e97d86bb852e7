"""Three components of your own — a drafter, an eviction policy and an admission policy —
plugged into the engine and the simulator through ``Components``, and from the command line
through ``--component KIND=module:callable``:

    PYTHONPATH=examples .venv/bin/deepinfer-kit generate --num-draft 3 \\
        --component drafter=my_components:make_drafter \\
        --component eviction_policy=my_components:make_lfu \\
        --component admission_policy=my_components:make_admission
    PYTHONPATH=examples .venv/bin/deepinfer-kit sim --num-requests 500 \\
        --set 'speculative={"num_draft": 3}' \\
        --component drafter=my_components:make_drafter \\
        --component eviction_policy=my_components:make_lfu \\
        --component admission_policy=my_components:make_admission

Each factory is a module-level function taking the ``BuildContext`` (what the engine or the
simulator knows when it builds the component: its config, clock, pool, model ...). Run as a
script it checks each component against its Protocol's conformance suite, then serves a few
requests with them and simulates a workload with them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

from deepinfer_kit import BuildContext, Components, Factory, SamplingParams, build_engine
from deepinfer_kit.request import Request
from deepinfer_kit.spec.protocols import DraftSequence
from deepinfer_kit.spec.records import DraftProposal


class BigramDrafter:
    """Drafts by following the sequence's own bigrams: after token ``t`` it proposes the
    token that last followed ``t`` in the sequence, and so on (the n-gram drafter's idea
    with n = 1, no confidence)."""

    def propose(self, requests: Sequence[DraftSequence], num_draft: int) -> DraftProposal:
        rows, counts = [], []
        for seq in requests:
            tokens = seq.all_token_ids
            follows = {a: b for a, b in zip(tokens, tokens[1:])}
            draft, last = [], tokens[-1]
            while len(draft) < num_draft and last in follows:
                last = follows[last]
                draft.append(last)
            counts.append(len(draft))
            rows.append(draft + [0] * (num_draft - len(draft)))
        ids = torch.tensor(rows, dtype=torch.int64).view(len(requests), num_draft)
        return DraftProposal(token_ids=ids, num_drafted=counts)


class LFUEvictionPolicy:
    """Evicts the cached block matched least often (ties: the least recently used)."""

    def __init__(self) -> None:
        self._uses: dict[int, int] = {}
        self._recency: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._recency)

    def push(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            self._uses[b] = self._uses.get(b, 0) + 1
            self._recency[b] = None

    def discard(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            if self._recency.pop(b, 1) is None:
                self._uses[b] = self._uses.get(b, 0) + 1  # referenced again: one more use

    def touch(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            if b in self._recency:
                self._uses[b] += 1
                self._recency.move_to_end(b)

    def pop(self, n: int) -> list[int]:
        order = {b: i for i, b in enumerate(self._recency)}
        victims = sorted(self._recency, key=lambda b: (self._uses[b], order[b]))[:n]
        for b in victims:
            del self._recency[b]
            del self._uses[b]
        return victims


def shortest_prompt_first(request: Request) -> tuple[float, ...]:
    """Admission key: shorter prompts first, then arrival order."""
    return (float(request.num_prompt_tokens), request.arrival_time)


def make_drafter(ctx: BuildContext) -> BigramDrafter:
    return BigramDrafter()


def make_lfu(ctx: BuildContext) -> LFUEvictionPolicy:
    return LFUEvictionPolicy()


def make_admission(ctx: BuildContext) -> object:
    return shortest_prompt_first


MINE = Components(drafter=Factory(make_drafter), eviction_policy=Factory(make_lfu),
                  admission_policy=Factory(make_admission))


def main() -> None:
    from deepinfer_kit import EngineConfig
    from deepinfer_kit.sim import H200, QWEN3_1_7B, AnalyticCost, WorkloadConfig, build_simulator, generate
    from deepinfer_kit.testing import DRAFTER_SUITE, EVICTION_POLICY_SUITE

    EVICTION_POLICY_SUITE.run(LFUEvictionPolicy)  # each raises ConformanceError naming a failure
    DRAFTER_SUITE.run(BigramDrafter)
    torch.set_num_threads(1)
    traces = []
    engine = build_engine(model="tiny-words", speculative={"num_draft": 3}, components=MINE,
                          num_blocks=64, max_model_len=256, trace=traces.append)
    prompt = "The paged KV cache stores each request's keys and values. The paged KV cache"
    for i, text in enumerate((prompt, prompt + " again")):
        engine.add_request(f"r{i}", text, SamplingParams(temperature=0.0, max_tokens=24))
    outs = engine.run()
    drafted = sum(t.num_drafted for t in traces)
    print(f"engine: {len(outs)} completions, {drafted} drafts from BigramDrafter verified")
    assert drafted > 0
    config = EngineConfig(num_blocks=400, max_model_len=4096, speculative={"num_draft": 3})
    sim = build_simulator(config, AnalyticCost(QWEN3_1_7B, H200), QWEN3_1_7B, components=MINE)
    report = sim.run(generate(WorkloadConfig(num_requests=300, rate=200.0, shared_fraction=0.5, seed=1)))
    print(f"simulator: {report.num_finished} requests, prefix hit rate {report.prefix_hit_rate:.1%}, "
          f"{sim.runner.drafting.speculation.num_drafted} drafts from BigramDrafter")  # type: ignore[attr-defined]
    assert report.num_finished == 300


if __name__ == "__main__":
    main()
