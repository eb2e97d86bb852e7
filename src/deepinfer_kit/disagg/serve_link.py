"""ServeLink: the device link between prefill servers and a decode server
(``deepinfer-kit serve --kv-role prefill|decode --kv-link HOST:PORT``) — the processes
meet at one address, agree on a hash key, and each prefill server's prompt blocks go to
the decode server's landing slots as it computes them (NCCL between GPUs)."""

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


@attrs.define(eq=False)
class ServeLink:
    """One server's end of a link group: ``size - 1`` prefill servers (ranks ``0 ..
    size - 2``) and one decode server (rank ``size - 1``); two servers, the default, are
    one pair.

    :meth:`connect` joins the group at ``address`` (rank 0 listens; each waits for the
    others up to ``connect_timeout_s``), checks the roles, and puts the block bytes on an
    NCCL group when every engine runs on CUDA, else on the gloo group (a GPU side then
    sends from host memory); rank 0 draws the hash key the block identities share and
    sends it to the others. :meth:`components` adds this end's connector to the engine's
    components; :meth:`start` starts the decode server's receivers (one per prefill
    server) once its engine is built; :meth:`close` ends the channels (a prefill server
    tells the decode server nothing more comes) after the engine closed. A link does not
    reconnect: a server that restarts needs the others restarted too.
    """

    role: str
    rank: int
    size: int
    key: bytes
    group: Any
    data_group: Any
    landing_slots: int = 1024
    send_slots: int = 256
    timeout_s: float = 5.0
    receivers: list[KVLinkReceiver] = attrs.field(factory=list)
    _engine: Engine | None = None

    @classmethod
    def connect(cls, address: str, role: str, device: str, *, size: int = 2, rank: int | None = None,
                connect_timeout_s: float = 300.0, **sizes: Any) -> ServeLink:
        """Join the link group at ``address`` (``HOST:PORT``) as ``role``; ``rank``
        defaults to 0 for a prefill server, ``size - 1`` for the decode server.
        ``sizes``: ``landing_slots``, ``send_slots``, ``timeout_s``.

        Raises:
            ConfigError: a bad role, address, size or rank, a process group already
                here, the others not met within ``connect_timeout_s``, or a group whose
                roles are not prefill servers then one decode server.
        """
        if role not in ("prefill", "decode"):
            raise ConfigError(f"--kv-link needs --kv-role prefill or decode, got {role!r}")
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ConfigError(f"--kv-link must be HOST:PORT, got {address!r}")
        if isinstance(size, bool) or not isinstance(size, int) or size < 2:
            raise ConfigError(f"--kv-link-size must be an int >= 2 (prefill servers and one decode server), "
                              f"got {size!r}")
        rank = (0 if role == "prefill" else size - 1) if rank is None else rank
        if (role == "decode") != (rank == size - 1) or not 0 <= rank < size:
            raise ConfigError(f"--kv-link-rank {rank} of {size}: the decode server is rank {size - 1}, "
                              f"the prefill servers ranks 0..{size - 2}")
        if dist.is_initialized():
            raise ConfigError("--kv-link: this process already belongs to a torch.distributed group")
        try:
            dist.init_process_group("gloo", init_method=f"tcp://{address}", rank=rank, world_size=size,
                                    timeout=datetime.timedelta(seconds=connect_timeout_s))
        except (RuntimeError, ValueError) as exc:
            raise ConfigError(f"--kv-link {address}: the {role} server met no peers: {exc}") from exc
        key = torch.frombuffer(bytearray(secrets.token_bytes(32)), dtype=torch.uint8) if rank == 0 \
            else torch.empty(32, dtype=torch.uint8)
        dist.broadcast(key, 0)
        cuda = torch.device(device).type == "cuda"
        sides = [torch.zeros(2, dtype=torch.int64) for _ in range(size)]
        dist.all_gather(sides, torch.tensor([int(role == "decode"), int(cuda)]))
        decodes = [r for r, t in enumerate(sides) if int(t[0])]
        if decodes != [size - 1]:
            dist.destroy_process_group()
            raise ConfigError(f"--kv-link: decode servers at ranks {decodes} of {size}; a link group has one, "
                              f"rank {size - 1}")
        data = None
        if all(int(t[1]) for t in sides):  # every engine on a GPU: the bytes go GPU to GPU
            torch.cuda.set_device(torch.device(device))
            data = dist.new_group(backend="nccl")
        idle = dist.new_group(backend="gloo", timeout=_IDLE)  # headers: a wait between requests is no failure
        return cls(role, rank, size, bytes(key.tolist()), idle, data, **sizes)

    def components(self, base: Components | None) -> Components:
        """``base`` with this end's connector (``components.kv_connector`` must be free).

        Raises:
            ConfigError: ``base`` already has a KV connector.
        """
        base = base if base is not None else Components()
        if base.kv_connector is not None:
            raise ConfigError("--kv-link builds the KV connector: do not also give --component kv_connector=...")
        if self.role == "prefill":
            factory = link_sender(self.size - 1, self.key, group=self.group, data_group=self.data_group,
                                  send_slots=self.send_slots, source=self.rank)
        else:
            factory = link_receiver(self.key, landing_slots=self.landing_slots, timeout_s=self.timeout_s,
                                    sources=self.size - 1)
        return attrs.evolve(base, kv_connector=factory)

    def start(self, engine: Engine) -> None:
        """After the engine is built: the decode server starts a receiver per prefill
        server (requests come by HTTP; the links carry blocks only)."""
        self._engine = engine
        if self.role == "decode":
            self.receivers = [receive_into(engine, lambda *_: None, p, group=self.group, data_group=self.data_group,
                                           source=p) for p in range(self.size - 1)]

    def close(self) -> None:
        """After the engine closed: a prefill server ends its channel; the decode server
        waits for that briefly. Leaves the process group."""
        try:
            if self.role == "prefill" and self._engine is not None:
                sender = link_connector(self._engine).sender
                if isinstance(sender, LinkSender):
                    send_close(sender)
            for receiver in self.receivers:
                receiver.join(5.0)
        finally:
            dist.destroy_process_group()
