"""``deepinfer-kit serve``: build the engine from the command's options and run the
OpenAI-compatible app under uvicorn until interrupted."""

from __future__ import annotations

import argparse
from pathlib import Path

import attrs

from deepinfer_kit.errors import ConfigError

__all__ = ["run_serve_command"]


def run_serve_command(args: argparse.Namespace) -> int:
    """Serve until Ctrl-C; returns the exit status.

    Raises:
        ConfigError: FastAPI / uvicorn missing (names the extra to install), an unreadable
            ``--chat-template``, or as ``build_engine``.
    """
    try:
        import uvicorn
    except ImportError:
        raise ConfigError(
            "deepinfer-kit serve needs FastAPI and uvicorn: pip install 'deepinfer_kit[serve]'"
        ) from None
    from deepinfer_kit.cli_engine import engine_config
    from deepinfer_kit.serve.api import build_app
    from deepinfer_kit.serve.async_llm import AsyncLLM

    template = None
    if args.chat_template is not None:
        try:
            template = Path(args.chat_template).read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"--chat-template {args.chat_template!r} cannot be read: {exc}") from None
    config = engine_config(args)
    options = {k: v for k, v in attrs.asdict(config, recurse=False).items() if k != "model"}
    llm = AsyncLLM(config.model, **options)
    app = build_app(llm, model_name=args.served_model_name or args.model, chat_template=template)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    finally:
        llm.shutdown()
    return 0
