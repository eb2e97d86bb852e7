"""models/attention/: paged attention over the KV block pool (torch reference + Triton)."""

from deepinfer_kit.models.attention.backend import PagedAttention
from deepinfer_kit.models.attention.layout import make_attention_metadata, slots_for

__all__ = ["PagedAttention", "make_attention_metadata", "slots_for"]
