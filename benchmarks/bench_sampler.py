"""Benchmark: VectorizedSampler against the per-row NaiveSampler and vLLM's
TopKTopPSampler native path, on the same logits, in the same run.

Rows cycle through four parameter sets — top-k 50, top-p 0.9, both, neither — all seeded.
Two kinds of logits: ``llm`` (a few dozen plausible tokens well above a Gaussian floor, like
a language model's next-token logits) and ``flat`` (i.i.d. N(0, 3^2): a top-p 0.9 set of
thousands of tokens, the hard case for a sampler that avoids sorting). vLLM gets top-k /
top-p tensors and no per-request generators (its fastest path); it sorts every row.

``--issue-mix`` times issue 18's mixed rows (per-row temperatures 0.5–1.5, top-k 50 / top-p
0.9 / both) against vLLM.

``--sweep`` measures the top-p path across nucleus widths instead: every row top-p 0.9
without top-k, seeded; temperatures {0.5, 1, 1.5} x nucleus widths {10, 100, 1k, 10k, 60k}
at batch 256 x vocab 151,936 (``--quick``: batch 8 x vocab 32,000, widths 10 / 1k / 20k).
The width is set by the spread of the logits: rows are i.i.d. ``N(0, s^2)`` with ``s``
bisected so that, at the row's temperature, a probe row's top-p 0.9 nucleus holds the asked
number of tokens. The sweep's baseline, :func:`sort_sampler`, is what vLLM's
``TopKTopPSampler`` native (non-FlashInfer) path does, written here from its description:
divide by the temperature, sort every row, mask past top-k and past the top-p mass, softmax,
draw with exponential noise. When vLLM imports, its own ``forward_native`` (after dividing
by the temperature, as its sampler does) is timed beside both, with an "x vllm" column.
Each rep times them back to back and the table keeps each one's fastest rep: on a shared
machine the slow reps measure the neighbours' load, and timing them in turn lets all see
the same load.

vLLM on a CPU-only machine without its CUDA dependencies:
``pip install --no-deps --target DIR vllm==0.33.0`` plus the pure-Python modules it imports
(see benchmarks/bench_prefix_cache.py), then run with ``PYTHONPATH=src:DIR``.

Run: ``.venv/bin/python benchmarks/bench_sampler.py [--quick] [--sweep]``. The script sets
``OMP_WAIT_POLICY=PASSIVE`` unless the environment already sets it: on a machine with few,
oversubscribed cores, OpenMP threads spinning after each parallel op otherwise stall every
following op by up to a scheduler slice, which swamps a pipeline of many small ops (export
``OMP_WAIT_POLICY=ACTIVE`` to measure that case; both samplers run under the same policy).
The naive sampler is a per-row loop; above 32 rows it is timed on 32 rows and scaled
linearly (marked ``*``).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # read once, when torch loads OpenMP

import argparse  # noqa: E402
import contextlib  # noqa: E402
import io  # noqa: E402
import logging  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from deepinfer_kit.sample import NaiveSampler, SamplingParams, VectorizedSampler  # noqa: E402
from deepinfer_kit.testing.sample import make_batch  # noqa: E402

NAIVE_ROWS = 32

KINDS = {
    "top_k": {"top_k": 50},
    "top_p": {"top_p": 0.9},
    "both": {"top_k": 50, "top_p": 0.9},
    "neither": {},
}


def make_logits(kind: str, rows: int, vocab: int, seed: int) -> torch.Tensor:
    """``[rows, vocab]`` float32 logits of the given kind (see the module docstring)."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "flat":
        return torch.randn(rows, vocab, generator=gen) * 3
    x = torch.randn(rows, vocab, generator=gen) * 2
    boost = torch.rand(rows, 64, generator=gen).sort(dim=-1, descending=True).values * 14
    x.scatter_add_(1, torch.randint(0, vocab, (rows, 64), generator=gen), boost)
    return x


def row_kinds(rows: int) -> list[str]:
    """The parameter set of each row: the four kinds in turn."""
    names = list(KINDS)
    return [names[i % len(names)] for i in range(rows)]


def inside_filtered_set(logits: torch.Tensor, kinds: list[str], tokens: torch.Tensor) -> bool:
    """Whether every token is inside its row's top-k / top-p set (value-based, no sort:
    fewer than k logits strictly above it; top-p mass strictly above it below p)."""
    x = logits.double()
    chosen = x.gather(1, tokens.unsqueeze(1))
    above = x > chosen
    w = torch.exp(x - x.amax(dim=-1, keepdim=True))
    ok = torch.ones(x.shape[0], dtype=torch.bool)
    for i, name in enumerate(kinds):
        spec = KINDS[name]
        k = int(spec.get("top_k", x.shape[1]))
        if int(above[i].sum()) >= k:
            ok[i] = False
        if "top_p" in spec:
            z = float(torch.topk(w[i], k).values.sum())
            ok[i] &= float(w[i][above[i]].sum()) < float(spec["top_p"]) * z
    return bool(ok.all())


def time_call(fn: Callable[[], Any], reps: int) -> tuple[float, Any]:
    """Median seconds of ``reps`` calls after one warm-up, and the last result."""
    out = fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        out = fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def time_together(fns: list[Callable[[], Any]], reps: int) -> list[tuple[float, Any]]:
    """Fastest of ``reps`` calls of each function after one warm-up each, all timed back
    to back in every rep (so each sees the same load), with each one's last result."""
    outs = [fn() for fn in fns]
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            outs[i] = fn()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times[i].append(time.perf_counter() - start)
    return [(min(t), out) for t, out in zip(times, outs)]


def load_vllm() -> Any | None:
    """vLLM's TopKTopPSampler, or None when vLLM cannot be imported here."""
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    try:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler
    except Exception as exc:  # noqa: BLE001 - any import failure means "not available"
        print(f"vLLM unavailable: {type(exc).__name__}: {exc}")
        return None
    return TopKTopPSampler()


def run_config(
    kind: str, rows: int, vocab: int, reps: int, vllm: Any | None, impl: str, naive: bool
) -> dict[str, Any]:
    """Time every sampler on one configuration; batch 1 averages one row of each kind."""
    batches = [[k] for k in KINDS] if rows == 1 else [row_kinds(rows)]
    result: dict[str, Any] = {"ours": 0.0, "naive": None, "vllm": None, "inside": True}
    ours = VectorizedSampler(impl)  # type: ignore[arg-type]
    for b, kinds in enumerate(batches):
        logits = make_logits(kind, len(kinds), vocab, seed=rows * 7 + b)
        params = [SamplingParams(seed=i, **KINDS[k]) for i, k in enumerate(kinds)]  # type: ignore[arg-type]
        batch = make_batch(params)
        t, res = time_call(lambda: ours(logits, batch), reps)
        result["ours"] += t / len(batches)
        result["inside"] &= inside_filtered_set(logits, kinds, res.token_ids)
        if naive:
            few = min(len(kinds), NAIVE_ROWS)
            part = make_batch(params[:few])
            t, _ = time_call(lambda: NaiveSampler()(logits[:few], part), 1)
            result["naive"] = (result["naive"] or 0.0) + t * len(kinds) / few / len(batches)
        if vllm is not None:
            k = torch.tensor([int(KINDS[n].get("top_k", vocab)) for n in kinds])
            p = torch.tensor([float(KINDS[n].get("top_p", 1.0)) for n in kinds])
            t, out = time_call(lambda: vllm.forward_native(logits.clone(), {}, k, p), 1)
            result["vllm"] = (result["vllm"] or 0.0) + t / len(batches)
            result["vllm_inside"] = result.get("vllm_inside", True) & inside_filtered_set(
                logits, kinds, out[0]
            )
    return result


TOP_P = 0.9
TEMPERATURES = (0.5, 1.0, 1.5)


def sort_sampler(
    logits: torch.Tensor, temperature: torch.Tensor, k: torch.Tensor, p: torch.Tensor
) -> torch.Tensor:
    """``[B]`` tokens: the sort-based top-k / top-p sampler (the baseline)."""
    x = logits / temperature.unsqueeze(1)
    vals, order = x.sort(dim=-1, descending=False)
    vocab = x.shape[1]
    kth = vals.gather(1, (vocab - k.clamp(max=vocab)).unsqueeze(1))
    vals = vals.masked_fill(vals < kth, float("-inf"))
    probs = vals.softmax(dim=-1)
    cum = probs.cumsum(dim=-1)
    drop = cum <= (1 - p).unsqueeze(1)
    drop[:, -1] = False
    vals = vals.masked_fill(drop, float("-inf"))
    x = torch.empty_like(x).scatter_(1, order, vals)
    probs = x.softmax(dim=-1)
    noise = torch.empty_like(probs).exponential_()
    return (probs / noise).argmax(dim=-1)


def nucleus_width(row: torch.Tensor, temperature: float) -> int:
    """Tokens in the top-p ``TOP_P`` nucleus of one row at ``temperature``."""
    probs = torch.softmax(row.double() / temperature, dim=0).sort(descending=True).values
    return int((torch.cumsum(probs, 0) - probs < TOP_P).sum())


def spread_for_width(width: int, temperature: float, probe: torch.Tensor) -> float:
    """The ``s`` for which ``s * probe`` has a nucleus of about ``width`` tokens."""
    lo, hi = 1e-3, 1e3  # the width falls as the spread grows
    for _ in range(40):
        mid = (lo * hi) ** 0.5
        if nucleus_width(probe * mid, temperature) > width:
            lo = mid
        else:
            hi = mid
    return (lo * hi) ** 0.5


def in_nucleus(logits: torch.Tensor, temperature: float, tokens: torch.Tensor) -> bool:
    """Whether every token lies in its row's nucleus (mass strictly above it ``< TOP_P``)."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    chosen = logits.gather(1, tokens.unsqueeze(1))
    above = torch.where(logits > chosen, probs, torch.zeros_like(probs)).sum(dim=-1)
    return bool((above < TOP_P).all())


def run_sweep(quick: bool, impl: str, reps: int, vllm: Any | None) -> None:
    """Print the nucleus-width sweep table (see the module docstring)."""
    batch, vocab, widths = 256, 151_936, [10, 100, 1_000, 10_000, 60_000]
    if quick:
        batch, vocab, widths, reps = 8, 32_000, [10, 1_000, 20_000], 1
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sampler = VectorizedSampler(impl)  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(batch, vocab, generator=gen)
    print(f"torch {torch.__version__}, {device}, {torch.get_num_threads()} threads, "
          f"impl={sampler.impl}, batch {batch} x vocab {vocab}, top-p {TOP_P}, no top-k")
    header = (f"{'temp':>4s} {'width':>6s} {'got':>6s} | {'ours ms':>9s} {'sort ms':>9s} {'x sort':>7s} | "
              f"{'vllm ms':>9s} {'x vllm':>7s} | in-set")
    print(header)
    print("-" * len(header))
    for temperature in TEMPERATURES:
        for width in widths:
            s = spread_for_width(width, temperature, base[0])
            logits = (base * s).to(device)
            params = [SamplingParams(temperature=temperature, top_p=TOP_P, seed=i) for i in range(batch)]
            sampling = make_batch(params)
            temp = torch.full((batch,), temperature, device=device)
            k = torch.full((batch,), vocab, device=device)
            p = torch.full((batch,), TOP_P, device=device)
            fns = [lambda: sampler(logits, sampling), lambda: sort_sampler(logits, temp, k, p)]
            if vllm is not None:  # vLLM's sampler divides by the temperature first
                fns.append(lambda: vllm.forward_native(logits / temp.unsqueeze(1), {}, k, p)[0])
            timed = time_together(fns, reps)
            (t_ours, res), (t_sort, tok) = timed[0], timed[1]
            inside = in_nucleus(logits.cpu(), temperature, res.token_ids.cpu())
            inside_sort = in_nucleus(logits.cpu(), temperature, tok.cpu())
            got = nucleus_width(logits[0].cpu(), temperature)
            vl = f"{'-':>9s} {'-':>7s}"
            if vllm is not None:
                t_vllm, vtok = timed[2]
                vl = f"{t_vllm * 1e3:9.1f} {t_vllm / t_ours:6.2f}x"
                inside_sort = inside_sort and in_nucleus(logits.cpu(), temperature, vtok.cpu())
            print(f"{temperature:4.1f} {width:6d} {got:6d} | {t_ours * 1e3:9.1f} {t_sort * 1e3:9.1f} "
                  f"{t_sort / t_ours:6.2f}x | {vl} | {'yes' if inside else 'NO'}"
                  f"/peers {'yes' if inside_sort else 'NO'}", flush=True)


def run_issue_mix(quick: bool, impl: str, reps: int, vllm: Any | None) -> None:
    """Issue 18's mixed rows: per-row temperatures uniform in [0.5, 1.5], even rows top-k
    50, odd rows top-p 0.9, every fourth row both, all seeded; batch 256 x vocab 151,936
    (``quick``: 16 x 32,000), ``llm`` and ``flat`` logits. vLLM's ``forward_native`` gets
    the temperature-divided logits with the top-k / top-p tensors (what its sampler does);
    both are timed back to back, fastest of ``reps``."""
    rows, vocab = (16, 32_000) if quick else (256, 151_936)
    gen = torch.Generator().manual_seed(0)
    temps = (0.5 + torch.rand(rows, generator=gen)).tolist()
    params = [SamplingParams(seed=i, temperature=temps[i],  # type: ignore[arg-type]
                             **({"top_k": 50} if i % 2 == 0 else {}),
                             **({"top_p": 0.9} if i % 2 == 1 or i % 4 == 0 else {}))
              for i in range(rows)]
    batch = make_batch(params)
    ours = VectorizedSampler(impl)  # type: ignore[arg-type]
    k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params])
    p_ = torch.tensor([p.top_p for p in params])
    divide = torch.tensor(temps).unsqueeze(1)
    print(f"issue 18's mixed rows: batch {rows} x vocab {vocab}, {torch.get_num_threads()} threads, impl={impl}")
    for kind in ("llm", "flat"):
        logits = make_logits(kind, rows, vocab, seed=1)
        fns: list[Callable[[], Any]] = [lambda: ours(logits, batch)]
        if vllm is not None:
            fns.append(lambda: vllm.forward_native(logits / divide, {}, k, p_))
        timed = time_together(fns, reps)
        line = f"{kind:5s} ours {timed[0][0] * 1e3:8.1f} ms"
        if vllm is not None:
            line += f" | vllm {timed[1][0] * 1e3:8.1f} ms  x{timed[1][0] / timed[0][0]:.1f}"
        print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, one rep (smoke run)")
    parser.add_argument("--logits", choices=["llm", "flat", "both"], default="both")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--impl", choices=["auto", "ref", "triton"], default="auto")
    parser.add_argument("--vocab", type=int, nargs="+", default=[32_000, 152_064])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--no-vllm", action="store_true")
    parser.add_argument("--no-naive", action="store_true")
    parser.add_argument("--sweep", action="store_true", help="the nucleus-width sweep instead")
    parser.add_argument("--issue-mix", action="store_true", help="issue 18's mixed rows instead")
    args = parser.parse_args()
    vllm = None if args.no_vllm or args.quick else load_vllm()
    if args.sweep:
        run_sweep(args.quick, args.impl, args.reps, vllm)
        return
    if args.issue_mix:
        run_issue_mix(args.quick, args.impl, args.reps, vllm)
        return
    vocabs, batch_sizes, reps = args.vocab, args.batch, args.reps
    if args.quick:
        vocabs, batch_sizes, reps = [8_000], [1, 16], 1
    kinds = ["llm", "flat"] if args.logits == "both" else [args.logits]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}, impl={args.impl}")
    header = (f"{'logits':6s} {'batch':>5s} {'vocab':>7s} | {'ours ms':>8s} {'tok/s':>9s} | "
              f"{'naive ms':>9s} {'x naive':>8s} | {'vllm ms':>8s} {'x vllm':>7s} | in-set")
    print(header)
    print("-" * len(header))
    for kind in kinds:
        for vocab in vocabs:
            for rows in batch_sizes:
                r = run_config(kind, rows, vocab, reps, vllm, args.impl, not args.no_naive)
                ours = r["ours"]
                star = "*" if rows > NAIVE_ROWS else " "
                naive = (
                    f"{r['naive'] * 1e3:8.1f}{star} {r['naive'] / ours:7.1f}x"
                    if r["naive"]
                    else f"{'-':>9s} {'-':>8s}"
                )
                vl = f"{r['vllm'] * 1e3:8.1f} {r['vllm'] / ours:6.1f}x" if r["vllm"] else f"{'-':>8s} {'-':>7s}"
                inside = "yes" if r["inside"] else "NO"
                if "vllm_inside" in r:
                    inside += "/vllm " + ("yes" if r["vllm_inside"] else "NO")
                print(f"{kind:6s} {rows:5d} {vocab:7d} | {ours * 1e3:8.1f} {rows / ours:9.0f} | "
                      f"{naive} | {vl} | {inside}", flush=True)


if __name__ == "__main__":
    main()
