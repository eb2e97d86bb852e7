"""A served app on 127.0.0.1 for the serve tests: an AsyncLLM over the tiny model behind
uvicorn in a thread, with the ServeOptions a test module asks for."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")
uvicorn = pytest.importorskip("uvicorn")

from deepinfer_kit.serve import AsyncLLM  # noqa: E402
from deepinfer_kit.serve.api import build_app  # noqa: E402
from deepinfer_kit.serve.options import ServeOptions  # noqa: E402

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def free_port() -> int:
    """A TCP port nobody listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class App:
    """``build_app`` over a fresh tiny AsyncLLM, served by uvicorn on a thread."""

    def __init__(self, options: ServeOptions, **engine: Any) -> None:
        config = dict(num_blocks=256, block_size=8, max_model_len=256, max_num_seqs=16)
        config.update(engine)
        self.llm = AsyncLLM("tiny", **config)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = build_app(self.llm, model_name="tiny", chat_template=CHATML, options=options)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)

    def wait_idle(self) -> None:
        """Wait until the engine holds nothing, then run its idle check."""
        asyncio.run(asyncio.wait_for(self.llm.wait_idle(), 30))

    def stop(self) -> None:
        """Stop uvicorn and the engine."""
        self.server.should_exit = True
        self.thread.join(10)
        self.llm.shutdown()
