"""AsyncLLM: concurrent streams, cancellation frees blocks, errors reach their caller only."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator

import pytest
import torch

from deepinfer_kit import LLM, SamplingParams
from deepinfer_kit.errors import ConfigError, EngineDeadError
from deepinfer_kit.outputs import RequestOutput
from deepinfer_kit.sample.params import RequestOutputKind
from deepinfer_kit.serve import AsyncLLM

CUMULATIVE, DELTA = RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA


@pytest.fixture(scope="module")
def allm() -> Iterator[AsyncLLM]:
    llm = AsyncLLM("tiny", num_blocks=64, block_size=8, max_model_len=256)
    yield llm
    llm.shutdown()


async def _collect(allm: AsyncLLM, prompt: str, params: SamplingParams, rid: str) -> list[RequestOutput]:
    return [out async for out in allm.generate(prompt, params, request_id=rid)]


def _params(i: int, kind: RequestOutputKind, max_tokens: int = 8) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.8, seed=i, output_kind=kind)


def test_concurrent_streams_match_the_batch_api(allm: AsyncLLM) -> None:
    prompts = [f"request number {i} says" for i in range(12)]
    kinds = [CUMULATIVE if i % 2 else DELTA for i in range(12)]

    async def main() -> list[list[RequestOutput]]:
        got = await asyncio.gather(*(
            _collect(allm, p, _params(i, k), f"r{i}") for i, (p, k) in enumerate(zip(prompts, kinds))
        ))
        await asyncio.wait_for(allm.wait_idle(), 10)
        return got

    streams = asyncio.run(main())
    reference = LLM("tiny", num_blocks=64, block_size=8, max_model_len=256).generate(
        prompts, [_params(i, CUMULATIVE) for i in range(12)])
    for i, (outs, ref) in enumerate(zip(streams, reference)):
        assert len(outs) == 8, "one output per produced token"
        assert [o.finished for o in outs] == [False] * 7 + [True]
        assert all(o.request_id == f"r{i}" for o in outs)
        if kinds[i] is DELTA:
            tokens = [t for o in outs for t in o.outputs[0].token_ids]
            text = "".join(o.outputs[0].text for o in outs)
        else:
            tokens, text = outs[-1].outputs[0].token_ids, outs[-1].outputs[0].text
            assert [len(o.outputs[0].token_ids) for o in outs] == list(range(1, 9))
        assert tokens == ref.outputs[0].token_ids
        assert text == ref.outputs[0].text


def test_cancelled_consumer_aborts_its_request_and_frees_its_blocks(
    allm: AsyncLLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    aborted: list[str] = []
    engine_abort = allm.engine.abort

    def recording_abort(request_id: str) -> bool:
        aborted.append(request_id.split("#")[0])
        return engine_abort(request_id)

    monkeypatch.setattr(allm.engine, "abort", recording_abort)

    async def main() -> None:
        seen: list[RequestOutput] = []

        async def consume() -> None:
            async for out in allm.generate("long " * 20, _params(1, DELTA, 200), request_id="victim"):
                seen.append(out)

        bystander = asyncio.create_task(_collect(allm, "short", _params(2, DELTA, 6), "bystander"))
        task = asyncio.create_task(consume())
        while len(seen) < 3:
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # A closed generator aborts as well.
        gen = allm.generate("closed early " * 5, _params(3, DELTA, 200), request_id="closed")
        await gen.__anext__()
        await gen.aclose()
        assert sum(len(o.outputs[0].token_ids) for o in await bystander) == 6
        await asyncio.wait_for(allm.wait_idle(), 10)
        assert aborted == ["victim", "closed"]
        assert len(seen) < 200
        # The id is free again.
        again = await _collect(allm, "reuse", _params(4, DELTA, 2), "victim")
        assert again[-1].finished and again[-1].outputs[0].finish_reason == "length"
        await asyncio.wait_for(allm.wait_idle(), 10)

    asyncio.run(main())


def test_an_invalid_request_raises_to_its_caller_only(allm: AsyncLLM) -> None:
    async def main() -> None:
        good = [asyncio.create_task(_collect(allm, f"fine {i}", _params(i, DELTA, 5), f"g{i}")) for i in range(4)]
        bad_ids = asyncio.create_task(_collect(allm, [1, 2, 10**6], _params(0, DELTA), "bad"))
        too_long = asyncio.create_task(_collect(allm, "x" * 300, _params(0, DELTA), "long"))
        with pytest.raises(ConfigError, match=r"\[0, 259\)"):
            await bad_ids
        with pytest.raises(ConfigError, match="max_model_len"):
            await too_long
        for task in good:
            outs = await task
            assert outs[-1].outputs[0].finish_reason == "length"
        gen = allm.generate("dup", _params(0, DELTA, 50), request_id="dup")
        await gen.__anext__()
        with pytest.raises(ConfigError, match="already in use"):
            await allm.generate("dup", _params(0, DELTA), request_id="dup").__anext__()
        await gen.aclose()
        await asyncio.wait_for(allm.wait_idle(), 10)

    asyncio.run(main())


def test_shutdown_ends_waiting_consumers_and_frees_everything() -> None:
    allm = AsyncLLM("tiny", num_blocks=64, block_size=8, max_model_len=256)

    async def main() -> None:
        gen = allm.generate("stream " * 4, _params(0, DELTA, 200), request_id="s")
        await gen.__anext__()
        await asyncio.get_running_loop().run_in_executor(None, allm.shutdown)
        with pytest.raises(EngineDeadError, match="shut down"):
            async for _ in gen:
                pass
        with pytest.raises(EngineDeadError, match="shut down"):
            await allm.generate("late").__anext__()

    asyncio.run(main())
    assert not allm.is_running
    allm.engine.check_idle()


def test_generate_without_params_streams_cumulative_outputs(allm: AsyncLLM) -> None:
    torch.manual_seed(0)  # default params sample; a first-token EOS would leave one output

    async def run() -> list[RequestOutput]:  # vLLM's default: CUMULATIVE, 16 tokens
        return [out async for out in allm.generate([5, 6, 7], request_id="plain")]

    outs = asyncio.run(run())
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    assert len(outs) > 1 and lengths == sorted(lengths) and lengths[0] >= 1
    assert all(b.outputs[0].token_ids[: len(a.outputs[0].token_ids)] == a.outputs[0].token_ids
               for a, b in zip(outs, outs[1:]))
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    asyncio.run(allm.wait_idle())


def test_streams_from_a_worker_process_match_the_in_process_engine() -> None:
    """The server's engine loop over ``worker="process"`` (overlapped by default there)."""
    allm = AsyncLLM("tiny", num_blocks=64, block_size=8, max_model_len=256, worker="process")
    prompts = [f"worker request {i}" for i in range(6)]

    async def main() -> list[list[RequestOutput]]:
        got = await asyncio.gather(*(_collect(allm, p, _params(i, DELTA), f"w{i}") for i, p in enumerate(prompts)))
        await asyncio.wait_for(allm.wait_idle(), 30)
        return got

    pid = allm.engine.runner.pid  # type: ignore[attr-defined]
    try:
        streams = asyncio.run(main())
        assert allm.engine.executor.depth == 1
        allm.engine.check_idle()
    finally:
        allm.shutdown()  # closes the engine it built: the worker exits
    _gone(pid)
    reference = LLM("tiny", num_blocks=64, block_size=8, max_model_len=256).generate(
        prompts, [_params(i, CUMULATIVE) for i in range(6)])
    for outs, ref in zip(streams, reference):
        assert [t for o in outs for t in o.outputs[0].token_ids] == ref.outputs[0].token_ids


def _gone(pid: int) -> None:
    for _ in range(100):
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    raise AssertionError(f"worker {pid} still running after shutdown")
