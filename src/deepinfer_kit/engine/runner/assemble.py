"""Default model assembly: the models package's decoders with ``deepinfer_kit.moe`` layers.

The models package takes its sparse (MoE) MLPs as an injected :class:`SparseMLPFactory`
and never imports an MoE implementation; this module is where the two are joined. It
offers the default factory and the loaders with it filled in, with the signatures the
engine, the tests and the examples call.
"""

from __future__ import annotations

import os

import torch

from deepinfer_kit._kernels import Impl
from deepinfer_kit.comm.protocols import Communicator
from deepinfer_kit.models import loader
from deepinfer_kit.models.config import ModelConfig
from deepinfer_kit.models.loader import LoadedModel
from deepinfer_kit.models.protocols import SparseMLP, SparseMLPFactory
from deepinfer_kit.moe.layer import MoELayer

__all__ = ["moe_layer_factory", "load_model", "build_tiny_model"]


def moe_layer_factory(impl: Impl = "auto") -> SparseMLPFactory:
    """A factory building :class:`~deepinfer_kit.moe.layer.MoELayer` for each sparse layer.

    Args:
        impl: the expert kernels, ``"auto" | "ref" | "triton"``.

    Returns:
        ``factory(config, layer, dtype=..., device=...)``; it raises ValueError for a
        config without an MoE section.
    """

    def build(config: ModelConfig, layer: int, /, *, dtype: torch.dtype,
              device: str | torch.device) -> SparseMLP:
        if config.moe is None:
            raise ValueError(f"layer {layer} of {config.architecture} is not sparse")
        built: SparseMLP = MoELayer(config.moe, impl=impl, dtype=dtype, device=device)
        return built

    return build


def load_model(path: str | os.PathLike[str], *, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", attention_impl: Impl = "auto",
               moe_impl: Impl = "auto", tp: Communicator | None = None) -> LoadedModel:
    """:func:`deepinfer_kit.models.loader.load_model` with the default MoE layers (with
    ``tp``, this rank's tensor-parallel shard).

    Args:
        moe_impl: the expert kernels of a sparse checkpoint (ignored for a dense one).

    Raises:
        ConfigError, CheckpointError: as ``models.loader.load_model``.
    """
    return loader.load_model(path, sparse_mlp_factory=moe_layer_factory(moe_impl), dtype=dtype,
                             device=device, attention_impl=attention_impl, tp=tp)


def build_tiny_model(*, seed: int = 0, dtype: torch.dtype = torch.float32,
                     device: str | torch.device = "cpu", attention_impl: Impl = "auto",
                     moe_impl: Impl = "auto", tp: Communicator | None = None) -> LoadedModel:
    """:func:`deepinfer_kit.models.loader.build_tiny_model` with the default MoE layers:
    the embedded tiny Qwen3-MoE-style model, the same for the same ``seed`` (with ``tp``,
    this rank's tensor-parallel shard)."""
    return loader.build_tiny_model(sparse_mlp_factory=moe_layer_factory(moe_impl), seed=seed,
                                   dtype=dtype, device=device, attention_impl=attention_impl, tp=tp)
