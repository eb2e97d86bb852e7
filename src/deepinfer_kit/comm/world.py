"""Joining the ranks: the world group from a rendezvous address or the standard launcher
environment (``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``, ``RANK``, as ``torchrun``
sets them), then the tensor-parallel and expert-parallel groups inside it.

Layout of ``T * E`` ranks: rank ``r = e * T + t`` is tensor-parallel rank ``t`` of
expert-parallel group ``e``. Tensor-parallel group ``e`` holds ranks ``e*T .. e*T+T-1``
(attention and dense MLPs sharded over them); expert-parallel group ``t`` holds ranks
``t, T + t, 2T + t, ...`` (each holds ``1 / E`` of every MoE layer's experts and exchanges
token copies with the others by all-to-all, as with ``T = 1``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import timedelta

import attrs
import torch
import torch.distributed as dist

from deepinfer_kit.comm.local import LocalCommunicator
from deepinfer_kit.comm.protocols import Communicator
from deepinfer_kit.comm.timed import TimedCommunicator
from deepinfer_kit.comm.torch_comm import TorchCommunicator
from deepinfer_kit.errors import ConfigError

__all__ = ["WorldSpec", "ParallelGroups", "world_from_env", "join_world", "ENV_KEYS"]

#: The variables a standard launcher (``torchrun``) sets for every rank.
ENV_KEYS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")


@attrs.frozen(slots=True)
class WorldSpec:
    """How this process joins the world group.

    Attributes:
        rank: this process's global rank, ``0 <= rank < world_size``.
        world_size: ranks in all (``T * E``).
        init_method: ``"tcp://host:port"`` (single-host spawn) or ``"env://"`` (the
            launcher's environment).
        local_rank: this process's index on its host (picks its GPU under NCCL).
    """

    rank: int
    world_size: int
    init_method: str
    local_rank: int = 0


@attrs.frozen(slots=True, eq=False)
class ParallelGroups:
    """This rank's groups once :func:`join_world` returned.

    Attributes:
        tp: the tensor-parallel group's communicator (a :class:`LocalCommunicator` when
            ``T = 1``).
        ep_group: the expert-parallel process group (``None``: the world group, when
            ``T = 1``), for :class:`~deepinfer_kit.moe.ep_dispatcher.ExpertParallelDispatcher`.
        ep_size: ``E``, ranks of the expert-parallel group.
        rank: this process's global rank.
        timed: the timing wrapper inside ``tp`` (``T > 1``), read by per-rank traces.
    """

    tp: Communicator
    ep_group: dist.ProcessGroup | None
    ep_size: int
    rank: int = 0
    timed: TimedCommunicator | None = None


def world_from_env(env: Mapping[str, str] | None = None) -> WorldSpec | None:
    """The :class:`WorldSpec` of a launcher-started rank, or ``None`` when none of
    :data:`ENV_KEYS` is set (a single-host spawn supplies its own).

    Raises:
        ConfigError: some but not all of :data:`ENV_KEYS` are set, or one is not an
            integer where it must be (names the variable and value).
    """
    env = os.environ if env is None else env
    present = [k for k in ENV_KEYS if k in env]
    if not present:
        return None
    missing = [k for k in ENV_KEYS if k not in env]
    if missing:
        raise ConfigError(f"the launcher environment sets {present} but not {missing}")
    values = {}
    for key in ("WORLD_SIZE", "RANK", "MASTER_PORT", "LOCAL_RANK"):
        raw = env.get(key, "0")
        try:
            values[key] = int(raw)
        except ValueError:
            raise ConfigError(f"{key} must be an integer, got {raw!r}") from None
    world, rank = values["WORLD_SIZE"], values["RANK"]
    if world < 1 or not 0 <= rank < world:
        raise ConfigError(f"RANK must be in [0, WORLD_SIZE={world}), got {rank}")
    return WorldSpec(rank, world, "env://", values["LOCAL_RANK"])


def join_world(spec: WorldSpec, *, tensor_parallel: int, expert_parallel: int,
               timeout: float, device: torch.device) -> ParallelGroups:
    """Initialize ``torch.distributed`` (gloo for a CPU ``device``, NCCL for CUDA) and
    build this rank's groups. Collective: every rank of the world calls it once, before
    the model loads. ``timeout`` bounds the rendezvous and every later collective.

    Raises:
        ConfigError: ``spec.world_size != tensor_parallel * expert_parallel``.
        CollectiveError, RuntimeError: the rendezvous failed or timed out.
    """
    if spec.world_size != tensor_parallel * expert_parallel:
        raise ConfigError(
            f"WORLD_SIZE must be tensor_parallel * expert_parallel = "
            f"{tensor_parallel} * {expert_parallel}, got {spec.world_size}")
    backend = "nccl" if device.type == "cuda" else "gloo"
    wait = timedelta(seconds=timeout)
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=spec.init_method, rank=spec.rank,
                                world_size=spec.world_size, timeout=wait)
    T, E = tensor_parallel, expert_parallel
    tp_group: dist.ProcessGroup | None = None
    ep_group: dist.ProcessGroup | None = None
    if T > 1 and E > 1:  # every rank creates every group, in one order
        for e in range(E):
            group = dist.new_group(list(range(e * T, e * T + T)), timeout=wait, backend=backend)
            if spec.rank // T == e:
                tp_group = group
        for t in range(T):
            group = dist.new_group(list(range(t, T * E, T)), timeout=wait, backend=backend)
            if spec.rank % T == t:
                ep_group = group
    timed = TimedCommunicator(TorchCommunicator(tp_group, timeout=timeout, device=device)) if T > 1 else None
    tp: Communicator = timed if timed is not None else LocalCommunicator()
    return ParallelGroups(tp=tp, ep_group=ep_group, ep_size=E, rank=spec.rank, timed=timed)
