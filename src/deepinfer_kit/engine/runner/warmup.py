"""warm_up: run every kernel specialization a serving engine will use before the first
request, so that no Triton compilation (and no graph capture) happens inside a step.

A specialization is Triton's launch key (``engine.kernel_keys``): constexprs, launch
options, and per argument its type, whether a pointer is 16-byte aligned, whether an
integer is 1 or divisible by 16. Warm-up reaches every key a serving round can produce:
forwards of each tile regime (lone prefills short and as long as a step allows, decode
batches, mixed and multi-token verify rounds, every split count, every static ladder
size), each sampler path (greedy, full-vocabulary, nucleus, candidate sets of every
block size, penalties, logprobs and their row normaliser), the block copy of
copy-on-write, and the verify kernels when the engine speculates. Integers that take
any value in serving (the MoE's copy count, the attention's table width and tile count)
and the block copy's id pointers (at an 8-byte offset for an odd number of copies) are
not specialised by their kernels, so they add no key. Dummy rounds write their K/V only
to the pool's scratch slot (:attr:`PagedKVCache.pad_slot`) and read blocks they never
write, so the addressable blocks keep their contents.
"""

from __future__ import annotations

import torch

from deepinfer_kit.engine.runner.model_runner import ModelRunner
from deepinfer_kit.models.packing import last_token_batch
from deepinfer_kit.models.attention.splits import num_splits_witnesses, split_target

SPLIT_MAX_QUERY = 8  # the longest query per request whose round may split (splits.num_splits_for)
from deepinfer_kit.sample.logprobs import row_logsumexp
from deepinfer_kit.sample.params import SamplingParams
from deepinfer_kit.sample.plan import MAX_TOPK_WIDTH, MIN_TOPK_WIDTH
from deepinfer_kit.sample.records import SamplingBatch
from deepinfer_kit.sample.vectorized import VectorizedSampler
from deepinfer_kit.spec.verify.kernels import select_verify_ops

__all__ = ["warm_up", "warm_up_shapes", "split_rounds", "dummy_forward"]


def warm_up_shapes(max_num_seqs: int, max_num_batched_tokens: int) -> list[list[int]]:
    """The query lengths of the eager dummy rounds: a lone prefill of a few lengths (the
    attention kernel's tile sizes differ below and above 16 query rows) and of the
    longest chunk a step allows (MoE tiles grow with the tokens per expert), a batch of
    single-token rows (an eager decode when the static path is off or too small), a
    mixed round, and batches of 2- and 4-token rows (speculative verify rounds)."""
    rounds: list[list[int]] = []
    for length in sorted({1, 8, 17, 128, max_num_batched_tokens}):
        if length <= max_num_batched_tokens:
            rounds.append([length])
    decode = min(max_num_seqs, max_num_batched_tokens, 64)
    rounds.append([1] * decode)
    if max_num_seqs >= 2 and max_num_batched_tokens >= 33:
        rounds.append([32, 1])
    for width in (2, 4):
        requests = min(max_num_seqs, max_num_batched_tokens // width, 64)
        if requests >= 2:
            rounds.append([width] * requests)
    return rounds


def split_rounds(runner: ModelRunner, *, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int) -> list[tuple[list[int], list[int]]]:
    """``(query_lens, seq_lens)`` of one round per split count the Triton paged attention
    can choose for this engine (``attention.splits.num_splits_witnesses`` asked with the
    runner's device and the model's KV heads): decode rounds of up to
    ``min(max_num_seqs, max_num_batched_tokens)`` requests of contexts up to
    ``max_model_len``; and, when a short multi-token round (a verify round, at most
    ``SPLIT_MAX_QUERY`` tokens per request, which may split too) has more query rows per
    KV head than a 16-row tile (``q * GQA group > 16``), the same with the shortest such
    query length, so the 64-row tiles are warmed with every split count as well. Reads
    nothing but those sizes."""
    config = runner.model.config
    groups = config.num_heads // config.num_kv_heads
    rounds: list[tuple[list[int], list[int]]] = []
    for query in sorted({1, 16 // groups + 1}):
        requests = min(max_num_seqs, max_num_batched_tokens // query)
        if query > SPLIT_MAX_QUERY or requests < 1:
            continue
        witnesses = num_splits_witnesses(requests, max_model_len, config.num_kv_heads,
                                         split_target(runner.device))
        rounds += [([query] * r, [max(seq_len, query)] * r)
                   for _, (r, seq_len) in sorted(witnesses.items())]
    return rounds


def warm_up(
    runner: ModelRunner, *, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
    capture: bool,
) -> None:
    """Compile and run every kernel specialization of the forward, the sampler, the block
    copy and the verifier once (see the module docstring), the attention with every split
    count it can choose (:func:`split_rounds`); run every static ladder size eagerly;
    then capture the static decode graphs when ``capture`` (CUDA only).

    Called by ``build_engine`` on a CUDA device, before the engine serves; may be called
    on CPU (it compiles nothing there; under the Triton interpreter it runs every launch
    a CUDA warm-up would compile). Mutates the scratch block of the KV pool and, with
    ``capture``, the runner's :class:`StaticDecode` graphs. Raises what the model,
    sampler or capture raise.
    """
    max_len = min(max_num_batched_tokens, max_model_len)
    rounds = [(q, list(q)) for q in warm_up_shapes(max_num_seqs, max_len)]
    rounds += split_rounds(runner, max_num_seqs=max_num_seqs,
                           max_num_batched_tokens=max_num_batched_tokens,
                           max_model_len=max_model_len)
    for query_lens, seq_lens in rounds:
        _dummy_round(runner, query_lens, seq_lens)
    static = runner.static
    if static is not None:
        for size in static.sizes:
            static.run_padded(size)
    with torch.inference_mode():
        runner.kv_cache.copy_scratch()
        _warm_candidates(runner)
        _warm_verify(runner)
    if capture and static is not None:
        static.capture()
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)


def _dummy_round(runner: ModelRunner, query_lens: list[int], seq_lens: list[int]) -> None:
    """One forward and sampling round (:func:`dummy_forward`, then every sampler variant)."""
    with torch.inference_mode():
        logits = dummy_forward(runner, query_lens, seq_lens)
        _sample_variants(runner, logits)
        _warm_row_norm(runner, logits)


def dummy_forward(runner: ModelRunner, query_lens: list[int], seq_lens: list[int]) -> torch.Tensor:
    """One forward of the runner's model over requests that read block 0 for their whole
    context and write their K/V only to the pool's pad slot (the addressable blocks keep
    their contents).

    Args:
        query_lens: ``[R]`` tokens fed per request.
        seq_lens: ``[R]`` context lengths, each ``>= query_lens[r]``.

    Returns:
        ``[R, V]`` logits of each request's last token, on the runner's device (not
        synchronised). Mutates only the pad slot of the KV pool.
    """
    cache = runner.kv_cache
    tables = [[0] * -(-s // cache.block_size) for s in seq_lens]
    positions = [p for q, s in zip(query_lens, seq_lens) for p in range(s - q, s)]
    forward = last_token_batch(
        [0] * sum(query_lens), positions, query_lens, seq_lens, tables,
        block_size=cache.block_size, device=runner.device,
    )  # fmt: skip
    forward.attn.slot_mapping.fill_(cache.pad_slot)
    with torch.inference_mode():
        logits: torch.Tensor = runner.model(forward, cache)
    return logits


def _sample_variants(runner: ModelRunner, logits: torch.Tensor) -> None:
    """Draw from ``logits`` with greedy, random (top-k, top-p, min-p), penalised and
    logprob rows, seeded and unseeded, alone and mixed, as serving rounds do."""
    variants = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05),
        SamplingParams(temperature=0.8, top_p=0.9),  # top-p alone: the nucleus kernel
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5),
        SamplingParams(temperature=0.0, logprobs=5),
    ]
    n = logits.shape[0]
    for count in sorted({1, min(n, len(variants))}):
        for start in range(len(variants)):
            params = [variants[(start + i) % len(variants)] for i in range(count)]
            batch = SamplingBatch(
                params=params,
                seeds=[None if (start + i) % 2 else 1234 + i for i in range(count)],
                positions=[0] * count,
                prompt_token_ids=[[0]] * count,
                output_token_ids=[[0]] * count,
                eos_token_ids=[None] * count,
                generator=runner.generator,
            )
            runner.sampler(logits[:count], batch)


def _warm_row_norm(runner: ModelRunner, logits: torch.Tensor) -> None:
    """Run the logprobs' normaliser (:func:`row_logsumexp`: the sampler's Triton
    ``row_norm`` on CUDA, every row, ``1 / T = 1``) over the float32 ``logits`` and over
    its rows after the first (prompt logprobs read the rows after the sampled ones: a view
    whose start need not be 16-byte aligned, another variant); and the sampler's own
    ``row_norm`` over the same views (on a :class:`VectorizedSampler`: so a CPU run
    under the interpreter launches, and counts, what a GPU compiles here)."""
    raw = logits.to(torch.float32)
    views = [raw, raw[1:]] if raw.shape[0] > 1 else [raw]
    sampler = runner.sampler
    for x in views:
        row_logsumexp(x)
        if isinstance(sampler, VectorizedSampler):
            n, dev = x.shape[0], x.device
            sampler.ops_for(dev).row_norm(x, torch.arange(n, device=dev),
                                          torch.ones(n, dtype=torch.float32, device=dev))


def _warm_candidates(runner: ModelRunner) -> None:
    """Run the sampler's candidate-set draw at every block size it can pick: top-k widths
    ``MIN_TOPK_WIDTH .. MAX_TOPK_WIDTH`` (powers of two), histogram-threshold sets wider
    than that (their width any integer: one divisible by 16 and one not), and the whole
    vocabulary (rows whose top-k set would not be smaller). Only for a
    :class:`VectorizedSampler`; an injected sampler warms itself."""
    sampler = runner.sampler
    if not isinstance(sampler, VectorizedSampler):
        return
    ops, dev = sampler.ops_for(runner.device), runner.device
    vocab = runner.model.config.vocab_size
    widths = {vocab}
    width = MIN_TOPK_WIDTH
    while width <= MAX_TOPK_WIDTH and width < vocab:
        widths.add(width)
        width *= 2
    widths |= {w for w in (MAX_TOPK_WIDTH + 16, MAX_TOPK_WIDTH + 17) if w < vocab}
    for w in sorted(widths):
        vals = torch.linspace(1.0, -1.0, w, device=dev).unsqueeze(0)
        idx = torch.arange(w, dtype=torch.int64, device=dev).unsqueeze(0)
        ops.candidate_draw(
            vals, idx, torch.ones(1, device=dev), torch.full((1,), w, dtype=torch.int64, device=dev),
            torch.full((1,), 0.9, dtype=torch.float64, device=dev), torch.zeros(1, device=dev),
            torch.zeros(1, dtype=torch.float64, device=dev),
            torch.full((1,), 0.5, dtype=torch.float64, device=dev),
        )  # fmt: skip


def _warm_verify(runner: ModelRunner) -> None:
    """Run the verify kernels (greedy and rejection) with draft widths 0, 1 and 2 (Triton
    specialises the width on being 1 or divisible by 16), when the runner verifies."""
    verifier = runner.verifier
    if verifier is None:
        return
    ops, _ = select_verify_ops(getattr(verifier, "impl", "auto"))
    dev, vocab = runner.device, runner.model.config.vocab_size
    for width in (0, 1, 2):
        logits = torch.zeros(width + 1, vocab, device=dev)
        ids = torch.zeros(1, width, dtype=torch.int64, device=dev)
        lengths = torch.full((1,), width, dtype=torch.int64, device=dev)
        ops.greedy_verify(logits, torch.zeros(1, dtype=torch.int64, device=dev), ids, lengths)
        target = torch.full((1, width + 1, vocab), 1.0 / vocab, dtype=torch.float64, device=dev)
        u = torch.full((1, width + 1), 0.5, dtype=torch.float64, device=dev)
        ops.rejection_sample(target, target[:, :width].contiguous(), ids, lengths,
                             u[:, :width].contiguous(), u)
