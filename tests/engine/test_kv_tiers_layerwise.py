"""Layer-by-layer tier loads in the engine: the same tokens as whole-round loads and as no
tiers; the runner waits for each layer inside the forward and for the rest after it; a copy
that fails mid-forward ends that round's requests and the engine serves on, leaking
nothing."""

from __future__ import annotations

from typing import Any

import pytest

from deepinfer_kit.cache.tiers.host_worker import HostTransferWorker, host_slab
from deepinfer_kit.cache.tiers.config import TierConfig
from deepinfer_kit.cache.tiers.offload import OffloadConnector
from deepinfer_kit.cache.tiers.records import TransferOutput, TransferPlan
from deepinfer_kit.cache.tiers.slab_bytes import RankSlabs
from deepinfer_kit.components import BuildContext, Components, Factory
from deepinfer_kit.engine.build import build_engine
from tier_workload import POOL, serve_one_at_a_time, tier_params, tier_prompts

_HEADS, _PROMPTS, _ = tier_prompts(11, 5, 14)


class RecordingWorker:
    """The host tier's device side, logging the runner's calls; with ``fail_layer``, the
    wait for that layer in the first round with loads raises (a copy that failed)."""

    def __init__(self, inner: HostTransferWorker, fail_layer: int | None = None) -> None:
        self.inner = inner
        self.log: list[tuple[str, int]] = []
        self.fail_layer = fail_layer

    def start_save_kv(self, plan: TransferPlan) -> None:
        self.inner.start_save_kv(plan)

    def start_load_kv(self, plan: TransferPlan) -> None:
        self.log.append(("start_load", len(plan.loads)))
        self.inner.start_load_kv(plan)

    def wait_for_layer_load(self, layer: int) -> None:
        self.log.append(("layer", layer))
        self.inner.wait_for_layer_load(layer)
        if layer == self.fail_layer:
            self.fail_layer = None
            raise RuntimeError("the copy of a layer failed")

    def wait_for_load(self) -> None:
        self.log.append(("wait", -1))
        self.inner.wait_for_load()

    def get_finished(self) -> TransferOutput | None:
        return self.inner.get_finished()

    def close(self) -> None:
        self.inner.close()


def _recording(fail_layer: int | None = None) -> tuple[Factory[Any], list[RecordingWorker]]:
    made: list[RecordingWorker] = []

    def make(ctx: BuildContext) -> tuple[OffloadConnector, RecordingWorker]:
        kv = ctx.base
        slab = host_slab(kv, 64)
        worker = RecordingWorker(HostTransferWorker(kv, slab), fail_layer)
        made.append(worker)
        return OffloadConnector(TierConfig(host_blocks=64), RankSlabs([slab], [0], kv.num_kv_heads), None,
                                kv.block_size), worker

    return Factory(make), made


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    return serve_one_at_a_time(_PROMPTS)[0]


@pytest.mark.parametrize("layerwise", [True, False])
@pytest.mark.parametrize("engine", [{}, {"overlap": True}, {"worker": "process"}], ids=["inline", "overlap", "process"])
def test_tokens_equal_without_tiers(reference: dict[str, list[int]], layerwise: bool, engine: dict[str, Any]) -> None:
    got, stats = serve_one_at_a_time(_PROMPTS, kv_tiers={"host_blocks": 64, "layerwise_loads": layerwise}, **engine)
    assert got == reference
    assert stats.loaded_tokens > 0


def test_the_forward_waits_for_each_layer_then_the_rest(reference: dict[str, list[int]]) -> None:
    factory, made = _recording()
    got, stats = serve_one_at_a_time(_PROMPTS, components=Components(kv_connector=factory))
    assert got == reference and stats.loaded_tokens > 0
    (worker,) = made
    layers = worker.inner._kv.num_layers  # noqa: SLF001
    starts = [i for i, (name, n) in enumerate(worker.log) if name == "start_load" and n]
    assert starts
    for i in starts:  # each layer once, in order, inside the forward; the whole wait after it
        assert worker.log[i + 1:i + layers + 2] == [("layer", k) for k in range(layers)] + [("wait", -1)]


def test_a_copy_failing_mid_forward_ends_its_round_and_the_engine_serves_on(reference: dict[str, list[int]]) -> None:
    factory, made = _recording(fail_layer=1)
    engine = build_engine(**POOL, components=Components(kv_connector=factory))
    out: dict[str, Any] = {}
    for i, p in enumerate(_PROMPTS):
        engine.add_request(str(i), p, tier_params(i))
        out.update({o.request_id: o.outputs[0] for o in engine.run()})
    failed = [k for k, o in out.items() if o.finish_reason == "error"]
    assert len(failed) == 1 and made[0].fail_layer is None  # the one request of the failed round
    assert all(list(out[k].token_ids) == reference[k] for k in out if k not in failed)
    engine.add_request("again", _PROMPTS[int(failed[0])], tier_params(int(failed[0])))
    again = engine.run()[0].outputs[0]
    assert list(again.token_ids) == reference[failed[0]]
    engine.flush()
    engine.check_idle()
    engine.close()
    assert engine.cache.tier_stats.loaded_tokens > 0  # type: ignore[attr-defined]


def test_the_flag_is_checked() -> None:
    from deepinfer_kit.errors import ConfigError

    with pytest.raises(ConfigError, match="layerwise_loads must be True or False, got 'yes'"):
        TierConfig(host_blocks=4, layerwise_loads="yes")  # type: ignore[arg-type]
