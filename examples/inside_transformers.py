"""The kit's scheduler and block manager inside transformers' continuous batching (CPU).

Builds a tiny random Qwen3 (no download), serves 16 requests sharing a 48-token prefix
with ``model.generate_batch`` twice — once with transformers' own FIFO scheduler, once
with the kit's scheduler registered in transformers' ``SCHEDULER_MAPPING`` — checks the
greedy tokens are identical, and prints the kit's prefix-cache hits. A mismatch exits
non-zero naming the request.

    .venv/bin/python examples/inside_transformers.py
"""

from __future__ import annotations

import logging
import random

import torch
from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from deepinfer_kit.adapters.transformers import kit_scheduler


def generate(model: Qwen3ForCausalLM, prompts: list[list[int]], scheduler: str) -> dict[str, list[int]]:
    """Greedy tokens per request id from ``generate_batch`` with ``scheduler``."""
    gen = GenerationConfig(max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
    cb = ContinuousBatchingConfig(
        page_size=16,
        num_blocks=64,
        max_batch_tokens=96,
        scheduler_type=scheduler,
        use_async_batching=False,  # the kit's adapter runs rounds synchronously
    )
    out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb, warmup=False)
    return {rid: list(o.generated_tokens) for rid, o in out.items()}


def main() -> None:
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
    )
    model = Qwen3ForCausalLM(config).eval()
    model.config._attn_implementation = "sdpa"

    rng = random.Random(0)
    prefix = [rng.randrange(1, 256) for _ in range(48)]
    prompts = [prefix + [rng.randrange(1, 256) for _ in range(rng.randrange(4, 24))] for _ in range(16)]

    fifo = generate(model, prompts, "fifo")
    with kit_scheduler("kit") as factory:
        kit = generate(model, prompts, "kit")
    for rid, tokens in fifo.items():
        if kit.get(rid) != tokens:
            raise SystemExit(f"{rid}: FIFO gave {tokens}, the kit's scheduler {kit.get(rid)}")
    sched = factory.last
    stats = sched.prefix_stats
    assert stats is not None
    print(f"{len(kit)} requests, greedy tokens identical to transformers' FIFO scheduler")
    print(f"kit rounds={sched.num_rounds} preemptions={sched.num_preemptions}")
    print(f"kit prefix cache: {stats.hit_blocks} of {stats.query_blocks} queried blocks hit ({stats.hit_rate:.0%})")


if __name__ == "__main__":
    main()
