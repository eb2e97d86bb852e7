"""Layer-by-layer KV tier loads against whole-round loads, on the real engine (CPU).

A random Qwen2 checkpoint (``--layers`` layers, ``--hidden`` wide, 4 KV heads) is served
conversations whose long prefix (``--prefix`` tokens) comes back from the host tier: each
measured request is a prefix another request pushed out of the device pool, plus a short
new tail (``--tail`` tokens), so its first round loads the whole prefix and computes only
the tail. The steps that load are timed (``engine.step()``, wall) with
``TierConfig.layerwise_loads`` on (the copies of layer ``i + 1`` run beside layer ``i``'s
compute, in a thread; the forward waits per layer) and off (every copy before the
forward), the two engines alternating request by request in one process. Tokens must be
equal between the two.

    .venv/bin/python benchmarks/bench_layerwise_loads.py [--quick] [--threads 1]
        [--layers 16] [--hidden 512] [--prefix 2048] [--tail 16] [--repeats 8]

Prints the median loading-round time of each and their ratio, and the same for the
copy alone (``start_load_kv`` + ``wait_for_load`` of the whole-round engine). Torch runs
``--threads`` intra-op threads (default 1: on the CI's 2 cores the copy thread then has
a core of its own). No timing is asserted; the times are this machine's.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from deepinfer_kit import SamplingParams, build_engine

P = 16


def checkpoint(folder: Path, layers: int, hidden: int, context: int) -> None:
    """A random Qwen2 with ``layers`` layers of width ``hidden`` (head dim 64, 4 KV heads)."""
    import transformers as T

    config = T.Qwen2Config(vocab_size=512, hidden_size=hidden, num_hidden_layers=layers,
                           num_attention_heads=hidden // 64, num_key_value_heads=4,
                           intermediate_size=hidden * 2, max_position_embeddings=context + 64)
    config.architectures = ["Qwen2ForCausalLM"]
    torch.manual_seed(0)
    T.Qwen2ForCausalLM(config).save_pretrained(folder)


class LoadTimer:
    """Wall time of the engine's steps that loaded, and of the device side's load calls
    in them."""

    def __init__(self, engine: Any) -> None:
        self.rounds: list[float] = []
        self.copy: list[float] = []
        self._loaded = False
        self._copy = 0.0
        worker = engine.runner.kv_transfer
        for name in ("start_load_kv", "wait_for_load"):
            self._wrap(worker, name)

    def _wrap(self, worker: Any, name: str) -> None:
        inner = getattr(worker, name)

        def timed(*args: Any) -> Any:
            if name == "start_load_kv" and args[0].loads:
                self._loaded = True
            t0 = time.perf_counter()
            try:
                return inner(*args)
            finally:
                self._copy += time.perf_counter() - t0

        setattr(worker, name, timed)

    def run(self, engine: Any) -> list[list[int]]:
        """Step ``engine`` until idle, timing each step that loaded; the tokens of what ended."""
        out: list[list[int]] = []
        while engine.has_unfinished_requests():
            self._loaded, self._copy = False, 0.0
            t0 = time.perf_counter()
            outs = engine.step()
            if self._loaded:
                self.rounds.append(time.perf_counter() - t0)
                self.copy.append(self._copy)
            out += [list(o.outputs[0].token_ids) for o in outs]
        return out + [list(o.outputs[0].token_ids) for o in engine.flush()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a smaller model and fewer repeats (about 20 s)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--prefix", type=int, default=2048)
    ap.add_argument("--tail", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=8)
    args = ap.parse_args()
    if args.quick:
        args.layers, args.prefix, args.repeats = 8, 1024, 4
    torch.set_num_threads(args.threads)
    context = args.prefix + args.tail + 16
    blocks = context // P + 8  # one long request at a time: the next one evicts the last one's prefix
    rng = random.Random(0)
    prefixes = [[rng.randrange(512) for _ in range(args.prefix)] for _ in range(args.repeats + 1)]
    greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint(Path(tmp), args.layers, args.hidden, context)
        engines, timers, tokens = {}, {}, {}
        for name, layerwise in (("layerwise", True), ("whole round", False)):
            e = build_engine(model=tmp, num_blocks=blocks, block_size=P, max_num_seqs=1, max_model_len=context,
                             max_num_batched_tokens=max(256, args.tail + 16), seed=0,
                             kv_tiers={"host_blocks": 4 * blocks, "layerwise_loads": layerwise})
            engines[name], tokens[name] = e, []
        for name, e in engines.items():  # warm-up: one prefix pushed out and loaded back
            for rid, prompt in (("w0", prefixes[-1] + [1] * args.tail), ("w1", prefixes[0] + [2] * args.tail),
                                ("w2", prefixes[-1] + [3] * args.tail)):
                e.add_request(rid, prompt, greedy)
                e.run()
            timers[name] = LoadTimer(e)
        for i in range(args.repeats):
            for name, e in engines.items():
                e.add_request(f"a{i}", prefixes[i] + [4] * args.tail, greedy)   # computes the prefix, saves it
                e.run()
                e.add_request(f"b{i}", prefixes[i + 1] + [5] * args.tail, greedy)  # pushes it out of the pool
                e.run()
                e.add_request(f"c{i}", prefixes[i] + [6] * args.tail, greedy)   # loads it back: the timed round
                tokens[name] += timers[name].run(e)
        for e in engines.values():
            e.check_idle()
            e.close()
    lay, whole = timers["layerwise"], timers["whole round"]
    med = {k: statistics.median(t.rounds) for k, t in timers.items()}
    print(f"model: {args.layers} layers x {args.hidden}, prefix {args.prefix} tokens loaded, tail {args.tail} "
          f"computed, {args.threads} torch thread(s), {len(lay.rounds)} loading rounds each")
    print(f"{'':14s} {'loading round (median)':>24s}")
    for name, t in timers.items():
        print(f"{name:14s} {med[name] * 1e3:21.1f} ms")
    print(f"ratio layerwise / whole round: {med['layerwise'] / med['whole round']:.3f}x")
    print(f"the whole-round engine's copies alone: {statistics.median(whole.copy) * 1e3:.1f} ms per loading round")
    print(f"tokens equal: {tokens['layerwise'] == tokens['whole round']}")


if __name__ == "__main__":
    main()
