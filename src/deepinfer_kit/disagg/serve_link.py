"""ServeLink: the device link between a prefill server and a decode server
(``deepinfer-kit serve --kv-role prefill|decode --kv-link HOST:PORT``) — the two processes
meet at one address, agree on a hash key, and the prefill server's prompt blocks go to the
decode server's landing slots as it computes them (NCCL between GPUs)."""

from __future__ import annotations

import datetime
import secrets
from typing import Any

import attrs
import torch
import torch.distributed as dist

from deepinfer_kit.components import Components
from deepinfer_kit.disagg.device_link import link_connector, link_receiver, link_sender, receive_into
from deepinfer_kit.disagg.link import KVLinkReceiver, send_close
from deepinfer_kit.disagg.link_sender import LinkSender
from deepinfer_kit.engine.engine import Engine
from deepinfer_kit.errors import ConfigError

__all__ = ["ServeLink"]

_IDLE = datetime.timedelta(days=365)  # the receiver waits between requests; gloo's wait is bounded by this


class ServeLink:
    """One end of a prefill/decode link between two server processes.

    :meth:`connect` joins a two-rank ``torch.distributed`` group at ``address`` (the
    prefill server rank 0, the decode server rank 1; each waits for the other up to
    ``connect_timeout_s``), with the block bytes on an NCCL group when both engines run
    on CUDA and on the gloo group otherwise (a GPU side then sends from host memory);
    the prefill server draws the hash key the block identities share and sends it over.
    A link does not reconnect: a server that restarts needs its peer restarted too. :meth:`components` adds the link's
    connector to the engine's components, :meth:`start` starts the decode server's
    receiver once its engine is built, :meth:`close` ends the channel (the prefill side
    tells the decode side nothing more comes) after the engine closed.
    """

    def __init__(self, role: str, key: bytes, group: Any, data_group: Any, landing_slots: int, send_slots: int,
                 timeout_s: float) -> None:
        self.role = role
        self.group = group
        self.key = key
        self.data_group = data_group
        self.landing_slots = landing_slots
        self.send_slots = send_slots
        self.timeout_s = timeout_s
        self.receiver: KVLinkReceiver | None = None
        self._engine: Engine | None = None

    @classmethod
    def connect(cls, address: str, role: str, device: str, *, connect_timeout_s: float = 300.0,
                landing_slots: int = 1024, send_slots: int = 256, timeout_s: float = 5.0) -> ServeLink:
        """Meet the other server at ``address`` (``HOST:PORT``; the prefill server listens).

        Raises:
            ConfigError: a bad role or address, a process group already here, or the
                other server not met within ``connect_timeout_s``.
        """
        if role not in ("prefill", "decode"):
            raise ConfigError(f"--kv-link needs --kv-role prefill or decode, got {role!r}")
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ConfigError(f"--kv-link must be HOST:PORT, got {address!r}")
        if dist.is_initialized():
            raise ConfigError("--kv-link: this process already belongs to a torch.distributed group")
        rank = 0 if role == "prefill" else 1
        try:
            dist.init_process_group("gloo", init_method=f"tcp://{address}", rank=rank, world_size=2,
                                    timeout=datetime.timedelta(seconds=connect_timeout_s))
        except (RuntimeError, ValueError) as exc:
            raise ConfigError(f"--kv-link {address}: the {role} server met no peer: {exc}") from exc
        key = torch.frombuffer(bytearray(secrets.token_bytes(32)), dtype=torch.uint8) if rank == 0 \
            else torch.empty(32, dtype=torch.uint8)
        dist.broadcast(key, 0)
        cuda = torch.device(device).type == "cuda"
        sides = [torch.zeros(1, dtype=torch.int64) for _ in range(2)]
        dist.all_gather(sides, torch.tensor([int(cuda)]))
        data = None
        if all(int(t) for t in sides):  # both on GPUs: the bytes go GPU to GPU
            torch.cuda.set_device(torch.device(device))
            data = dist.new_group(backend="nccl")
        for_idle = dist.new_group(backend="gloo", timeout=_IDLE)  # headers: a wait between requests is no failure
        return cls(role, bytes(key.tolist()), for_idle, data, landing_slots, send_slots, timeout_s)

    def components(self, base: Components | None) -> Components:
        """``base`` with this end's connector (``components.kv_connector`` must be free).

        Raises:
            ConfigError: ``base`` already has a KV connector.
        """
        base = base if base is not None else Components()
        if base.kv_connector is not None:
            raise ConfigError("--kv-link builds the KV connector: do not also give --component kv_connector=...")
        if self.role == "prefill":
            factory = link_sender(1, self.key, group=self.group, data_group=self.data_group,
                                  send_slots=self.send_slots)
        else:
            factory = link_receiver(self.key, landing_slots=self.landing_slots, timeout_s=self.timeout_s)
        return attrs.evolve(base, kv_connector=factory)

    def start(self, engine: Engine) -> None:
        """After the engine is built: the decode server starts receiving (requests come by
        HTTP; the link carries blocks only)."""
        self._engine = engine
        if self.role == "decode":
            self.receiver = receive_into(engine, lambda *_: None, 0, group=self.group, data_group=self.data_group)

    def close(self) -> None:
        """After the engine closed: the prefill server ends the channel; the decode server
        waits for that briefly. Leaves the process group."""
        try:
            if self.role == "prefill" and self._engine is not None:
                sender = link_connector(self._engine).sender
                if isinstance(sender, LinkSender):
                    send_close(sender)
            elif self.receiver is not None:
                self.receiver.join(5.0)
        finally:
            dist.destroy_process_group()
