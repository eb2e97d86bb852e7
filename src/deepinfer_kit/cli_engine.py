"""The engine options shared by the ``deepinfer-kit`` subcommands that build an engine, and
the :class:`EngineConfig` they describe."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from deepinfer_kit._dtypes import DTYPE_ALIASES, DTYPE_NAMES
from deepinfer_kit.errors import ConfigError

if TYPE_CHECKING:
    from deepinfer_kit.components import Components
    from deepinfer_kit.engine.config import EngineConfig

__all__ = ["add_engine_options", "add_parallel_options", "engine_config"]


def add_engine_options(p: argparse.ArgumentParser) -> None:
    """Add the options that describe an engine (model, device, dtype, KV sizing, …) to ``p``."""
    p.add_argument(
        "--model", default="tiny-words",
        help="checkpoint folder, or an embedded model: 'tiny-words' (trained on the project's "
             "docs; default) or 'tiny' (random weights)",
    )
    p.add_argument("--tokenizer", default=None, help="a folder whose tokenizer.json replaces the model's")
    add_component_option(p)
    p.add_argument("--device", default=None,
                   help="cpu, cuda, cuda:1, ... (default: cuda when a GPU is present and --model is "
                        "a checkpoint folder, else cpu)")
    p.add_argument("--dtype", default="auto", choices=(*DTYPE_NAMES, "auto", *DTYPE_ALIASES),
                   help="default 'auto': the checkpoint's torch_dtype, float32 ones in bfloat16 "
                        "on CUDA; the embedded models in float32")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="sequences in one round at most (default 128)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of one round (default 2048)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="reuse cached prompt blocks across requests (default on)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="vLLM's name for --no-cuda-graphs")
    p.add_argument("--num-blocks", type=int, default=None)
    p.add_argument("--kv-cache-memory-mb", type=int, default=None,
                   help="KV memory budget (MiB) when --num-blocks is not given (default: 512 "
                        "on CPU, from --gpu-memory-utilization on CUDA)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="on CUDA, the fraction of device memory the engine may use (weights + KV)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="prompt + output tokens of one request at most (default: the model's, "
                   "capped to what the KV pool holds)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-logprobs", type=int, default=20,
                   help="the most logprobs a request may ask for; -1: no cap, so --logprobs -1 "
                        "(the whole vocabulary) is allowed (default 20, vLLM's)")
    p.add_argument("--kv-tiers", default=None, metavar="JSON",
                   help='host and disk KV tiers under the device pool, e.g. \'{"host_blocks": 4096, '
                        '"disk_blocks": 65536, "disk_path": "/var/kv"}\' (TierConfig; hash_key as hex)')
    p.add_argument("--scheduler", default="continuous", choices=("continuous", "static"),
                   help="continuous batching (admit every round) or static (a batch runs to completion)")
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule step k+1 while step k runs (tokens committed one step late); "
                        "default: on on CUDA unless --num-draft, and with --worker process; off "
                        "otherwise on CPU")
    p.add_argument("--worker", default="inline", choices=("inline", "process", "launched"),
                   help="run the model in this process or in a worker process of its own (the "
                        "host's scheduling then overlaps the forward on CPU too); 'launched': "
                        "this process is one rank started by torchrun (docs/distributed.md)")
    p.add_argument("--expert-parallel", type=int, default=1, metavar="W",
                   help="split the MoE layers' experts over W worker processes (gloo ranks, "
                        "CPU; starts its worker processes unless --worker launched)")
    p.add_argument("--num-draft", type=int, default=0,
                   help="speculative decoding: drafts verified per round (0: off)")
    p.add_argument("--drafter", default="ngram", choices=("ngram", "draft_model", "self", "dspark"),
                   help="who drafts: prompt lookup, a draft checkpoint, the target's first layers, DSpark heads")
    p.add_argument("--draft-model", default=None,
                   help="the draft checkpoint folder of --drafter draft_model ('tiny': embedded)")
    p.add_argument("--draft-layers", type=int, default=None,
                   help="k, the target layers --drafter self drafts with")
    p.add_argument("--dspark-heads", default=None,
                   help="the heads file of --drafter dspark ('tiny-words': the shipped heads)")
    p.add_argument("--no-cuda-graphs", action="store_true",
                   help="on a GPU, run decode rounds eagerly instead of replaying captured graphs")
    p.add_argument("--batch-invariant", action="store_true",
                   help="a sequence's logits (and a greedy or seeded request's tokens) bitwise the same "
                        "whatever else runs beside it (docs/batch_invariance.md)")
    p.add_argument("--eplb-interval", type=int, default=0,
                   help="live expert rebalancing every N steps (0: off; needs an MoE model)")
    p.add_argument("--eplb-window", type=int, default=8, help="steps of expert counts a rebalance plans from")
    p.add_argument("--eplb-redundant", type=int, default=4, help="redundant expert slots per MoE layer")
    p.add_argument("--eplb-gpus", type=int, default=4, help="GPUs the expert slots are split over")
    p.add_argument("--eplb-policy", default="deepseek", help="deepseek, global, refine, forecast, movement or peak")
    p.add_argument("--eplb-dispatch", default="static",
                   help="which replica serves each routed copy, per batch: static, even or balanced")
    p.add_argument(
        "--threads", type=int, default=None,
        help="torch intra-op threads (default: 1 for the embedded models, torch's default otherwise)",
    )


def add_parallel_options(p: argparse.ArgumentParser, *, tensor_parallel_size: bool = True) -> None:
    """Add ``--tensor-parallel-size`` / ``-tp`` (vLLM's name; left out with
    ``tensor_parallel_size=False`` for a parser that has its own) and
    ``--collective-timeout`` to ``p``; :func:`engine_config` reads both when present."""
    if tensor_parallel_size:
        p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="T",
                       help="shard attention, dense MLPs, embedding and LM head over T ranks "
                            "(gloo, CPU; one worker process per rank unless --worker launched); vLLM's name")
    p.add_argument("--collective-timeout", type=float, default=300.0, metavar="S",
                   help="seconds one collective of a multi-rank model may take before the "
                        "engine reports the group dead")


def add_component_option(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--component KIND=package.module:callable`` (repeatable): a component of yours, built
    by that factory from a :class:`~deepinfer_kit.components.BuildContext`."""
    p.add_argument(
        "--component", action="append", default=[], metavar="KIND=MODULE:CALLABLE",
        help="use your component instead of the built-in: KIND is one of the Components fields "
             "(drafter, eviction_policy, admission_policy, sampler, ...), the callable a "
             "module-level factory taking the BuildContext (repeatable; docs/protocols.md)",
    )


def components_of(args: argparse.Namespace) -> Components | None:
    """The :class:`~deepinfer_kit.components.Components` of ``--component`` flags, or ``None``.

    Raises:
        ConfigError: a malformed flag, an unknown kind, a path that does not import, or a
            kind given twice (each named).
    """
    from deepinfer_kit.components import Components, parse_component

    given: dict[str, Any] = {}
    for text in getattr(args, "component", None) or []:
        kind, factory = parse_component(text)
        if kind in given:
            raise ConfigError(f"--component {kind} given twice")
        given[kind] = factory
    return Components(**given) if given else None


def engine_config(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    """The :class:`EngineConfig` the engine options of ``args`` describe (``overrides``
    win); also sets torch's thread count from ``--threads``."""
    import torch

    from deepinfer_kit.engine.config import EngineConfig
    from deepinfer_kit.models.generation_defaults import default_device
    from deepinfer_kit.models.embedded import is_embedded

    threads = args.threads if args.threads is not None else (1 if is_embedded(args.model) else 0)
    if threads > 0:
        torch.set_num_threads(threads)
    device = args.device if args.device is not None else default_device(args.model)
    fields: dict[str, Any] = dict(
        model=args.model,
        tokenizer=args.tokenizer,
        device=device,
        dtype=args.dtype,
        num_blocks=args.num_blocks,
        kv_cache_memory_mb=args.kv_cache_memory_mb,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        max_logprobs=args.max_logprobs,
        overlap=args.overlap,
        # more than one rank starts a worker process per rank unless a launcher's (vLLM's -tp)
        worker=("process" if args.worker == "inline" and max(
            args.expert_parallel, getattr(args, "tensor_parallel_size", 1)) > 1 else args.worker),
        expert_parallel=args.expert_parallel,
        tensor_parallel=getattr(args, "tensor_parallel_size", 1),
        collective_timeout=getattr(args, "collective_timeout", 300.0),
        scheduler=args.scheduler,
        cuda_graphs=not (args.no_cuda_graphs or args.enforce_eager),
        batch_invariant=args.batch_invariant,
        speculative=_speculative(args),
        eplb=({"interval": args.eplb_interval, "window": args.eplb_window, "policy": args.eplb_policy,
               "num_redundant": args.eplb_redundant, "num_gpus": args.eplb_gpus,
               "dispatch": args.eplb_dispatch}
              if args.eplb_interval else None),
    )
    if getattr(args, "kv_tiers", None) is not None:
        fields["kv_tiers"] = _json_option(args.kv_tiers, "--kv-tiers")
    for name in ("max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching"):
        if getattr(args, name, None) is not None:
            fields[name] = getattr(args, name)
    fields.update(overrides)
    return EngineConfig(**fields)


def _json_option(text: str, flag: str) -> Any:
    """A JSON option's value.

    Raises:
        ConfigError: not JSON (names the flag).
    """
    import json

    from deepinfer_kit.errors import ConfigError

    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{flag} must be JSON, got {text!r}: {exc}") from None


def _speculative(args: argparse.Namespace) -> dict[str, Any] | None:
    """The ``speculative`` dict of the flags (``None`` without ``--num-draft``); only the
    draft fields given are passed, so SpecConfig names a missing or misplaced one."""
    if not args.num_draft:
        return None
    spec: dict[str, Any] = {"drafter": args.drafter, "num_draft": args.num_draft}
    if args.draft_model is not None:
        spec["draft_model"] = args.draft_model
    if args.draft_layers is not None:
        spec["draft_layers"] = args.draft_layers
    if args.dspark_heads is not None:
        spec["dspark_heads"] = args.dspark_heads
    return spec
