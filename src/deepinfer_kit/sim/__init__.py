"""sim: the real scheduler and KV cache manager driven at scale by a cost-model runner on a
virtual clock. Host-only: nothing here imports torch (``sim.profile`` and, with
expert placement on, ``sim.experts`` do, lazily)."""

from deepinfer_kit.sim.build import build_simulator, pool_blocks
from deepinfer_kit.sim.clock import VirtualClock
from deepinfer_kit.sim.cost_analytic import H200, QWEN3_1_7B, AnalyticCost, GpuSpec, ModelShape
from deepinfer_kit.sim.cost_profiled import ProfiledCost, fit_profiled_cost
from deepinfer_kit.sim.expert_records import ExpertReport, ExpertRouting
from deepinfer_kit.sim.lengths import LengthDist
from deepinfer_kit.sim.metrics import MetricsRecorder, Percentiles, SimReport, percentile
from deepinfer_kit.sim.protocols import CostModel
from deepinfer_kit.sim.records import SimRequest, SimStep, StepShape
from deepinfer_kit.sim.runner import SimRunner
from deepinfer_kit.sim.simulator import Simulator
from deepinfer_kit.sim.tokens import SyntheticTokens
from deepinfer_kit.sim.workload import WorkloadConfig, generate

__all__ = [
    "build_simulator", "pool_blocks", "VirtualClock", "H200", "QWEN3_1_7B", "AnalyticCost",
    "GpuSpec", "ModelShape", "ProfiledCost", "fit_profiled_cost", "LengthDist",
    "MetricsRecorder", "Percentiles", "SimReport", "percentile", "CostModel", "SimRequest",
    "SimStep", "StepShape", "SimRunner", "Simulator", "SyntheticTokens", "WorkloadConfig",
    "generate", "ExpertRouting", "ExpertReport",
]
