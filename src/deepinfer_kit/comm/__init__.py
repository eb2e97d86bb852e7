"""comm/: the one communication layer of multi-rank models (collectives with a timeout over
``torch.distributed``: gloo on CPU, NCCL on CUDA), and how ranks join their groups."""

from deepinfer_kit.comm.local import LocalCommunicator
from deepinfer_kit.comm.protocols import Communicator
from deepinfer_kit.comm.timed import CommStats, TimedCommunicator
from deepinfer_kit.comm.torch_comm import TorchCommunicator
from deepinfer_kit.comm.world import ParallelGroups, WorldSpec, join_world, world_from_env

__all__ = [
    "Communicator",
    "LocalCommunicator",
    "TorchCommunicator",
    "TimedCommunicator",
    "CommStats",
    "ParallelGroups",
    "WorldSpec",
    "join_world",
    "world_from_env",
]
