"""The round loop written out: add_request, step until done, flush — with a step trace.

    .venv/bin/python examples/engine_loop.py
"""

from __future__ import annotations

import torch

from deepinfer_kit import SamplingParams, build_engine
from deepinfer_kit.engine.trace import StepTrace


def main() -> None:
    torch.set_num_threads(1)
    # A small pool and budget so chunked prefill, prefix hits and preemption all show up.
    engine = build_engine(
        model="tiny", num_blocks=12, block_size=8, max_model_len=96, max_num_batched_tokens=32,
        trace=lambda t: print(t.describe()),
    )
    system = "You are a helpful assistant. "
    engine.add_request("a", system + "Explain paged KV caches.", SamplingParams(temperature=0, max_tokens=8))
    engine.add_request("b", system + "Explain prefix reuse.", SamplingParams(temperature=0, max_tokens=8))
    finished = []
    late_arrival_added = False
    while engine.has_unfinished_requests():
        finished += engine.step()
        if finished and not late_arrival_added:
            # Arrives later: its system-prompt blocks are already cached by then.
            engine.add_request("c", system + "Explain forks.", SamplingParams(temperature=0, max_tokens=8))
            late_arrival_added = True
    finished += engine.flush()
    for out in finished:
        print(out.request_id, out.outputs[0].token_ids, out.outputs[0].finish_reason,
              f"cached prompt tokens: {out.num_cached_tokens}")
    engine.check_idle()


if __name__ == "__main__":
    main()
