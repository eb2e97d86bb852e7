"""cache/tiers/: KV beyond the device pool — a host tier and a disk tier under the prefix
index, behind one KV connector (docs/kv_tiers.md).

Torch-free names only here (the simulator and the scheduler's records import them); the
stores and workers are imported from their modules."""

from deepinfer_kit.cache.tiers.config import KVRequestParams, TierConfig
from deepinfer_kit.cache.tiers.protocols import KVConnectorScheduler, KVConnectorWorker, LayerwiseKVConnectorWorker
from deepinfer_kit.cache.tiers.records import KVEvent, TierStats, TransferOutput, TransferPlan

__all__ = [
    "TierConfig",
    "KVRequestParams",
    "KVConnectorScheduler",
    "KVConnectorWorker",
    "LayerwiseKVConnectorWorker",
    "KVEvent",
    "TierStats",
    "TransferOutput",
    "TransferPlan",
]
