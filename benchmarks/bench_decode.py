"""Decode throughput of the engine vs `transformers` generate, against a memory roofline.

Builds a random Qwen3-shaped dense checkpoint with `transformers` (by default the 1.7B
shape: hidden 2048, 28 layers, 16 query / 8 KV heads of 128, intermediate 6144, vocab
151936, tied embeddings, q/k norm; bf16, std-0.02 init) and saves it as a safetensors
folder that both the engine (`build_engine`) and `transformers` load. For each batch size B,
B requests of `--prompt-len` random tokens generate `--new-tokens` N tokens greedily, EOS
ignored, all in lockstep.

Decode is separated from prefill by difference: each system runs the workload once with N
new tokens and once with 1 (prefill and the first token only); decode time is the
difference, spread over the N - 1 decode steps. Each is warmed up with one untimed run,
then the best of `--repeats` is kept; on CUDA the clock is read after a synchronize.

Roofline: a decode step must read every weight once (the tied embedding counted once) and
the KV of every request's context (2 x L x KV heads x head_dim x itemsize per token, at the
mean decode context P + N/2). The bound is those bytes over the copy bandwidth measured in
the same run with a device-to-device `copy_`, counted as 2 x bytes / time (each byte is
read once and written once). "of roofline" = roofline ms / measured ms per step.

    .venv/bin/python benchmarks/bench_decode.py --device cuda      # the 1.7B shape, B = 1, 64
    .venv/bin/python benchmarks/bench_decode.py --device cpu       # small shape (smoke run)
"""

from __future__ import annotations

import argparse
import ast
import gc
import importlib
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch

# (hidden, layers, query heads, KV heads, head_dim, intermediate, vocab)
FULL_SHAPE = (2048, 28, 16, 8, 128, 6144, 151936)
SMALL_SHAPE = (256, 4, 4, 2, 64, 768, 4096)

# A run: (max new tokens) -> (seconds, forward steps, the first request's tokens).
RunFn = Callable[[int], tuple[float, int, list[int]]]


@attrs.frozen(slots=True)
class Timing:
    """One system at one batch size: the best times of the two runs.

    Attributes:
        one_s: seconds of the run generating 1 token per request (prefill + first token).
        full_s: seconds of the run generating N tokens per request.
        decode_steps: forward steps the full run took beyond the 1-token run.
        tokens: the first request's N greedy tokens.
    """

    one_s: float
    full_s: float
    decode_steps: int
    tokens: list[int]

    @property
    def step_ms(self) -> float:
        """Milliseconds per decode step."""
        return (self.full_s - self.one_s) / self.decode_steps * 1e3


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_checkpoint(path: Path, shape: tuple[int, ...], dtype: torch.dtype,
                     device: torch.device, seed: int) -> None:
    """Save a random Qwen3 dense model of ``shape`` (see FULL_SHAPE) to ``path``."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    hidden, layers, heads, kv_heads, head_dim, inter, vocab = shape
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        max_position_embeddings=40960, tie_word_embeddings=True, initializer_range=0.02,
        eos_token_id=vocab - 1, bos_token_id=None, pad_token_id=0,
    )
    # Built directly in the target dtype on the target device: a float32 CPU copy of the
    # 1.7B shape would cost 7 GB and a minute of init.
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen3ForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model.save_pretrained(str(path), safe_serialization=True)
    del model


def weight_bytes(module: torch.nn.Module) -> int:
    """Bytes of the module's parameters, each storage counted once (tied weights once)."""
    seen: dict[int, int] = {}
    for p in module.parameters():
        seen[p.data_ptr()] = p.numel() * p.element_size()
    return sum(seen.values())


def copy_bandwidth(device: torch.device, mib: int, repeats: int = 5) -> float:
    """Bytes/s of a device-to-device ``copy_`` of ``mib`` MiB, counted as 2 x bytes / time
    (read and write), best of ``repeats``."""
    src = torch.ones((mib << 20) // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * (mib << 20) / best


def measure(run: RunFn, new_tokens: int, repeats: int) -> Timing:
    """Warm up once, then the best of ``repeats`` 1-token and N-token runs, interleaved;
    while the N-token best is not above the 1-token best (noise on a busy machine with few
    tokens), up to ``2 * repeats`` more pairs, so the difference is a real decode time."""
    run(new_tokens)
    one = full = float("inf")
    one_steps = full_steps = 0
    tokens: list[int] = []
    done = 0
    while done < repeats or (full <= one and done < 3 * repeats):
        done += 1
        s, one_steps, _ = run(1)
        one = min(one, s)
        s, full_steps, tokens = run(new_tokens)
        full = min(full, s)
    return Timing(one, full, max(full_steps - one_steps, 1), tokens)


def engine_runner(engine: Any, prompts: list[list[int]], device: torch.device) -> RunFn:
    from deepinfer_kit import SamplingParams

    def run(new_tokens: int) -> tuple[float, int, list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        outs = []
        steps = 0
        _sync(device)
        start = time.perf_counter()
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, params)
        while engine.has_unfinished_requests():
            outs.extend(engine.step())
            steps += 1
        outs.extend(engine.flush())
        _sync(device)
        elapsed = time.perf_counter() - start
        engine.check_idle()
        first = next(o for o in outs if o.request_id == "r0")
        return elapsed, steps, list(first.outputs[0].token_ids)

    return run


def hf_runner(model: Any, prompts: list[list[int]], device: torch.device) -> RunFn:
    ids = torch.tensor(prompts, device=device)
    mask = torch.ones_like(ids)

    def run(new_tokens: int) -> tuple[float, int, list[int]]:
        _sync(device)
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                                 eos_token_id=None)
        _sync(device)
        elapsed = time.perf_counter() - start
        return elapsed, new_tokens, out[0, ids.shape[1]:].tolist()

    return run


def engine_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig fields from ``--engine-arg`` and the flags for knobs that may not exist
    yet (a flag whose field is absent is reported and ignored)."""
    from deepinfer_kit.engine.config import EngineConfig

    fields = attrs.fields_dict(EngineConfig)
    extra: dict[str, Any] = {}
    if args.no_cuda_graphs:
        if "cuda_graphs" in fields:
            extra["cuda_graphs"] = False
        else:
            print("note: EngineConfig has no cuda_graphs field; --no-cuda-graphs has no effect")
    for item in args.engine_arg:
        key, sep, text = item.partition("=")
        if not sep or key not in fields:
            raise SystemExit(f"--engine-arg must be <EngineConfig field>=<value>, got {item!r}")
        try:
            extra[key] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            extra[key] = text
    return extra


def run_engine(path: Path, prompts_by_batch: dict[int, list[list[int]]],
               args: argparse.Namespace, extra: dict[str, Any]) -> tuple[dict[int, Timing], int]:
    """Engine timings per batch size, and the bytes of its weights; ``extra`` overrides
    EngineConfig fields."""
    from deepinfer_kit import build_engine
    from deepinfer_kit.engine.config import EngineConfig

    device = torch.device(args.device)
    max_batch = max(prompts_by_batch)
    max_len = args.prompt_len + args.new_tokens
    block = int(extra.get("block_size", EngineConfig().block_size))
    knobs: dict[str, Any] = dict(
        model=str(path), dtype=args.dtype, device=args.device, seed=args.seed,
        max_num_seqs=max_batch, max_num_batched_tokens=max(2048, max_batch * args.prompt_len),
        max_model_len=max_len, num_blocks=max_batch * -(-max_len // block) + 1,
        # the 1-token and N-token runs share prompts: a prefix hit would shrink the prefill
        enable_prefix_caching=False,
    )
    knobs.update(extra)
    if extra:
        print(f"engine overrides: {extra}")
    engine = build_engine(**knobs)
    model = engine.runner.model
    nbytes = weight_bytes(model) if isinstance(model, torch.nn.Module) else 0
    timings = {b: measure(engine_runner(engine, p, device), args.new_tokens, args.repeats)
               for b, p in prompts_by_batch.items()}
    del engine, model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return timings, nbytes


def run_transformers(path: Path, prompts_by_batch: dict[int, list[list[int]]],
                     args: argparse.Namespace, dtype: torch.dtype, attn: str) -> dict[int, Timing]:
    from transformers import AutoModelForCausalLM

    device = torch.device(args.device)
    model: Any = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype,
                                                      attn_implementation=attn)
    model = model.to(device).eval()
    timings = {b: measure(hf_runner(model, p, device), args.new_tokens, args.repeats)
               for b, p in prompts_by_batch.items()}
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return timings


def leading_agreement(a: list[int], b: list[int]) -> int:
    """How many leading tokens two greedy sequences share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


COLUMNS = ("batch", "system", "1-tok ms", "ms/step", "tok/s", "roofline ms",
           "of roofline", "engine/this", "agree")


def print_table(rows: list[tuple[int, str, Timing]], engine: dict[int, Timing],
                roofline_ms: dict[int, float], new_tokens: int) -> None:
    print(f"{COLUMNS[0]:>5} {COLUMNS[1]:24} {COLUMNS[2]:>9} {COLUMNS[3]:>8} {COLUMNS[4]:>9} "
          f"{COLUMNS[5]:>11} {COLUMNS[6]:>11} {COLUMNS[7]:>11} {COLUMNS[8]:>9}")
    for batch, name, t in rows:
        tok_s = batch / t.step_ms * 1e3
        ratio = t.step_ms / engine[batch].step_ms
        agree = leading_agreement(t.tokens, engine[batch].tokens)
        print(f"{batch:5d} {name:24} {t.one_s * 1e3:9.2f} {t.step_ms:8.3f} {tok_s:9.1f} "
              f"{roofline_ms[batch]:11.3f} {roofline_ms[batch] / t.step_ms:11.1%} "
              f"{ratio:10.2f}x {agree:>4d}/{new_tokens:<4d}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cpu or cuda[:i]; both systems run there (default: cuda if present)")
    shape = parser.add_mutually_exclusive_group()
    shape.add_argument("--small", action="store_true",
                       help="small shape (hidden 256, 4 layers, vocab 4096); the default on cpu")
    shape.add_argument("--full", action="store_true", help="the 1.7B shape even on cpu")
    parser.add_argument("--dtype", default=None, choices=("float32", "float16", "bfloat16"),
                        help="default: bfloat16 (full shape), float32 (small shape)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=None,
                        help="N generated per request (default: 128 full shape, 16 small)")
    parser.add_argument("--repeats", type=int, default=3, help="best of this many timed runs")
    parser.add_argument("--hf-attn", nargs="+", default=None,
                        help="transformers attention implementations (default: eager; "
                             "eager and sdpa on cuda)")
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--copy-mib", type=int, default=None,
                        help="size of the bandwidth copy (default: 1024 on cuda, 256 on cpu)")
    parser.add_argument("--no-cuda-graphs", action="store_true",
                        help="cuda_graphs=False, when EngineConfig has that field")
    parser.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="an EngineConfig field (repeatable), e.g. attention_impl=ref")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    cuda = torch.device(args.device).type == "cuda"
    args.small = args.small or (not cuda and not args.full)
    args.dtype = args.dtype or ("float32" if args.small else "bfloat16")
    if args.new_tokens is None:
        args.new_tokens = 16 if args.small else 128
    args.hf_attn = args.hf_attn or (["eager", "sdpa"] if cuda else ["eager"])
    args.copy_mib = args.copy_mib or (1024 if cuda else 256)
    if args.new_tokens < 2:
        parser.error(f"--new-tokens must be >= 2 (decode = N-token run - 1-token run), "
                     f"got {args.new_tokens}")
    if args.prompt_len < 1 or args.repeats < 1 or min(args.batch_sizes) < 1:
        parser.error("--prompt-len, --repeats and --batch-sizes must be >= 1")
    return args


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    hf_logging: Any = importlib.import_module("transformers.utils.logging")

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    extra = engine_overrides(args)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    shape = SMALL_SHAPE if args.small else FULL_SHAPE
    hidden, layers, heads, kv_heads, head_dim, inter, vocab = shape
    rng = random.Random(args.seed)
    prompts_by_batch = {
        b: [[rng.randrange(1, vocab - 1) for _ in range(args.prompt_len)] for _ in range(b)]
        for b in args.batch_sizes
    }
    bandwidth = copy_bandwidth(device, args.copy_mib)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model"
        build_checkpoint(path, shape, dtype, device, args.seed)
        engine, wbytes = run_engine(path, prompts_by_batch, args, extra)
        hf = {} if args.no_transformers else {
            attn: run_transformers(path, prompts_by_batch, args, dtype, attn) for attn in args.hf_attn
        }
    itemsize = torch.empty((), dtype=dtype).element_size()
    kv_per_token = 2 * layers * kv_heads * head_dim * itemsize
    mean_ctx = args.prompt_len + args.new_tokens / 2
    roofline_ms = {b: (wbytes + b * mean_ctx * kv_per_token) / bandwidth * 1e3
                   for b in args.batch_sizes}

    print(f"model: Qwen3-shaped dense, hidden {hidden}, {layers} layers, {heads}/{kv_heads} heads "
          f"x {head_dim}, intermediate {inter}, vocab {vocab}, tied embeddings, {args.dtype} "
          f"on {args.device} ({'small' if args.small else 'full'} shape)")
    print(f"weights read per decode step: {wbytes / 1e6:.1f} MB (tied embedding counted once); "
          f"KV {kv_per_token} bytes per token of context")
    print(f"workload: batch sizes {args.batch_sizes}, prompt {args.prompt_len} tokens, "
          f"{args.new_tokens} new tokens each, greedy, EOS ignored; best of {args.repeats}; "
          f"torch threads {torch.get_num_threads()}")
    print(f"copy bandwidth: {bandwidth / 1e9:.1f} GB/s (device-to-device copy_ of "
          f"{args.copy_mib} MiB, counted as 2 x bytes / time: read + write; best of 5)")
    print(f"roofline ms/step = (weights + KV read at mean decode context {mean_ctx:g}) / "
          f"copy bandwidth; ms/step = (N-token run - 1-token run) / decode steps; "
          f"tok/s = batch / step; engine/this = this row's ms/step / the engine's; "
          f"agree = leading greedy tokens of request 0 equal to the engine's")
    rows = [(b, "engine", engine[b]) for b in args.batch_sizes]
    rows += [(b, f"transformers {attn}", hf[attn][b]) for attn in hf for b in args.batch_sizes]
    rows.sort(key=lambda r: r[0])
    print_table(rows, engine, roofline_ms, args.new_tokens)
    for b, t in engine.items():
        if t.decode_steps != args.new_tokens - 1:
            print(f"note: batch {b}: the engine took {t.decode_steps} decode steps, not "
                  f"{args.new_tokens - 1} (prefill chunked or batch split); ms/step is per its step")
    for attn, timings in hf.items():
        ratios = ", ".join(f"batch {b} {timings[b].step_ms / engine[b].step_ms:.2f}x"
                           for b in args.batch_sizes)
        print(f"engine vs transformers {attn}, decode tok/s: {ratios}")


if __name__ == "__main__":
    main()
