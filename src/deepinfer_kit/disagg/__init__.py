"""disagg/: prefill/decode disaggregation — a prefill engine computes prompts' KV and
hands it to a decode engine through the KV tiers or a device link (docs/disaggregation.md)."""

from deepinfer_kit.disagg.device_pair import build_device_disaggregated
from deepinfer_kit.disagg.engine import DisaggregatedEngine, build_disaggregated, push_kv_down

__all__ = ["DisaggregatedEngine", "build_disaggregated", "build_device_disaggregated", "push_kv_down"]
