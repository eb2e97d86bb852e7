"""``deepinfer-kit serve``: its options (vLLM's names where vLLM has one), and building the
engine from them to run the OpenAI-compatible app under uvicorn until interrupted."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import attrs

from deepinfer_kit.errors import ConfigError

__all__ = ["add_serve_options", "run_serve_command"]


def add_serve_options(p: argparse.ArgumentParser) -> None:
    """Add the server's own options to the ``serve`` parser (the engine's are added by
    ``add_engine_options``). Imports nothing heavy."""
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the checkpoint folder (vLLM's positional model; same as --model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="the model's name in the API (default: the model)")
    p.add_argument("--chat-template", default=None, metavar="PATH",
                   help="a jinja file used for chat requests instead of the model's template")
    p.add_argument("--seed", type=int, default=None, dest="engine_seed",
                   help="the engine's seed (unseeded requests' generator, the embedded model's weights)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="ranks the model is sharded over (the engine's tensor_parallel; vLLM's name)")
    p.add_argument("--generation-config", default="auto",
                   help="sampling defaults: 'auto' the model's generation_config.json, 'vllm' none, "
                        "or a folder holding one")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize, /detokenize "
                        "(default: $DEEPINFER_API_KEY, else none)")
    p.add_argument("--allowed-hosts", default="", metavar="NAMES",
                   help="comma-separated Host names requests may carry (default: any); set it "
                        "when the server is reachable from a browser, against DNS rebinding")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="accept a chat_template in request bodies (runs the client's jinja)")
    p.add_argument("--max-body-bytes", type=int, default=8 * 2**20, help="larger bodies answer 413")
    p.add_argument("--max-n", type=int, default=None,
                   help="completions one request may ask for (default: --max-num-seqs)")
    p.add_argument("--max-prompts-per-request", type=int, default=128)
    p.add_argument("--max-stop-strings", type=int, default=32)
    p.add_argument("--chat-template-timeout", type=float, default=5.0, metavar="SECONDS")
    p.add_argument("--kv-role", default=None, choices=("prefill", "decode"),
                   help="this server's part in a prefill/decode pair sharing --kv-tiers' disk_path "
                        "and hash_key: prefill computes a prompt's KV (one token) and answers once "
                        "it is on disk; decode loads it (docs/disaggregation.md; `deepinfer-kit "
                        "pd-proxy` routes between them)")
    p.add_argument("--kv-link", default=None, metavar="HOST:PORT",
                   help="with --kv-role: move the KV device to device instead of through a folder "
                        "(NCCL on CUDA, gloo on CPU); every server of the link gives the same address, "
                        "where rank 0 listens (docs/disaggregation.md)")
    p.add_argument("--kv-link-size", type=int, default=2, metavar="N",
                   help="servers on the --kv-link: N - 1 prefill servers and one decode server")
    p.add_argument("--kv-link-rank", type=int, default=None, metavar="R",
                   help="this server's rank on the --kv-link: 0..N-2 for a prefill server (default 0), "
                        "N-1 for the decode server")


def run_serve_command(args: argparse.Namespace) -> int:
    """Serve until Ctrl-C; returns the exit status.

    Raises:
        ConfigError: FastAPI / uvicorn / prometheus_client missing (names the extra to
            install), an unreadable ``--chat-template``, a positional model that
            contradicts ``--model``, or as ``build_engine``.
    """
    try:
        import prometheus_client  # noqa: F401
        import uvicorn
    except ImportError:
        raise ConfigError(
            "deepinfer-kit serve needs FastAPI, uvicorn and prometheus_client: "
            "pip install 'deepinfer_kit[serve]'"
        ) from None
    from deepinfer_kit.cli_engine import components_of, engine_config
    from deepinfer_kit.engine.llm import tensor_parallel_options
    from deepinfer_kit.serve.api import build_app
    from deepinfer_kit.serve.async_llm import AsyncLLM
    from deepinfer_kit.serve.options import ServeOptions

    if args.model_tag is not None:
        args.model = args.model_tag
    template = None
    if args.chat_template is not None:
        try:
            template = Path(args.chat_template).read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"--chat-template {args.chat_template!r} cannot be read: {exc}") from None
    overrides = tensor_parallel_options(args.tensor_parallel_size, args.worker)
    if args.engine_seed is not None:
        overrides["seed"] = args.engine_seed
    config = engine_config(args, **overrides)
    options = ServeOptions.from_env(
        api_key=args.api_key, trust_request_chat_template=args.trust_request_chat_template,
        max_body_bytes=args.max_body_bytes, max_n=args.max_n or config.max_num_seqs,
        max_prompts=args.max_prompts_per_request, max_stop=args.max_stop_strings,
        chat_template_timeout_s=args.chat_template_timeout,
        allowed_hosts=tuple(args.allowed_hosts.split(",")),
    )
    engine_options = {k: v for k, v in attrs.asdict(config, recurse=False).items() if k != "model"}
    components, link = components_of(args), None
    if args.kv_link is not None:
        from deepinfer_kit.disagg.serve_link import ServeLink

        if args.kv_role is None:
            raise ConfigError("--kv-link needs --kv-role prefill or decode")
        if config.kv_tiers is not None:
            raise ConfigError("--kv-link moves the KV itself: give it without --kv-tiers (a pair shares a folder "
                              "or a link, not both)")
        link = ServeLink.connect(args.kv_link, args.kv_role, config.device, size=args.kv_link_size,
                                 rank=args.kv_link_rank)
        components = link.components(components)
    try:
        llm = AsyncLLM(config.model, generation_config=args.generation_config, components=components,
                       kv_role=args.kv_role, **engine_options)
    except BaseException:
        if link is not None:
            link.close()
        raise
    if link is not None:
        link.start(llm.engine)
    app = build_app(llm, model_name=args.served_model_name or args.model, chat_template=template,
                    options=options, root=args.model)
    if not logging.getLogger().handlers:  # the access log and refusals, beside uvicorn's
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    finally:
        llm.shutdown()
        if link is not None:
            link.close()
    return 0
