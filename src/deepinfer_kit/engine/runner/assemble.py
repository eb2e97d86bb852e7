"""Default model assembly: the models package's decoders with ``deepinfer_kit.moe`` layers.

The models package takes its sparse (MoE) MLPs as an injected :class:`SparseMLPFactory`
and never imports an MoE implementation; this module is where the two are joined. It
offers the default factory and the loaders with it filled in, with the signatures the
engine, the tests and the examples call.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import attrs
import torch

from deepinfer_kit._kernels import Impl
from deepinfer_kit.comm.protocols import Communicator
from deepinfer_kit.models import loader
from deepinfer_kit.models.config import ModelConfig
from deepinfer_kit.models.loader import LoadedModel
from deepinfer_kit.models.protocols import SparseMLP, SparseMLPFactory
from deepinfer_kit.moe.layer import MoELayer, make_router
from deepinfer_kit.moe.protocols import Dispatcher, Router

if TYPE_CHECKING:
    from deepinfer_kit.components import BuildContext, Factory

__all__ = ["moe_layer_factory", "load_model", "build_tiny_model"]


def moe_layer_factory(impl: Impl = "auto", *, router: Factory[Router] | None = None,
                      dispatcher: Factory[Dispatcher] | None = None,
                      context: BuildContext | None = None) -> SparseMLPFactory:
    """A factory building :class:`~deepinfer_kit.moe.layer.MoELayer` for each sparse layer.

    Args:
        impl: the expert kernels, ``"auto" | "ref" | "triton"``.
        router, dispatcher: injected per layer (``Components.router`` / ``dispatcher``),
            each called with ``context`` plus the layer (``layer``, ``moe``, ``device``;
            a router's ``base``: the built-in router holding the gate weights).
        context: what the engine's builder knows (needed with ``router`` or ``dispatcher``).

    Returns:
        ``factory(config, layer, dtype=..., device=...)``; it raises ValueError for a
        config without an MoE section.
    """
    if (router is not None or dispatcher is not None) and context is None:
        raise ValueError("an injected router or dispatcher needs the build context")

    def build(config: ModelConfig, layer: int, /, *, dtype: torch.dtype,
              device: str | torch.device) -> SparseMLP:
        if config.moe is None:
            raise ValueError(f"layer {layer} of {config.architecture} is not sparse")
        gate = make_router(config.moe, device=device)
        mine = routed = None
        if context is not None:
            here = attrs.evolve(context, layer=layer, moe=config.moe, device=str(device))
            mine = dispatcher(here) if dispatcher is not None else None
            routed = router(attrs.evolve(here, base=gate)) if router is not None else None
        built: SparseMLP = MoELayer(config.moe, impl=impl, dtype=dtype, device=device, gate=gate,
                                    router=routed, dispatcher=mine)
        return built

    return build


def load_model(path: str | os.PathLike[str], *, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", attention_impl: Impl = "auto",
               moe_impl: Impl = "auto", tp: Communicator | None = None,
               sparse_mlp_factory: SparseMLPFactory | None = None,
               batch_invariant: bool = False) -> LoadedModel:
    """:func:`deepinfer_kit.models.loader.load_model` with the default MoE layers (with
    ``tp``, this rank's tensor-parallel shard).

    Args:
        moe_impl: the expert kernels of a sparse checkpoint (ignored for a dense one).
        sparse_mlp_factory: the MoE layers instead (:func:`moe_layer_factory` with
            injected routers or dispatchers).
        batch_invariant: the batch-invariant numerics (``TransformerCausalLM``).

    Raises:
        ConfigError, CheckpointError: as ``models.loader.load_model``.
    """
    sparse = sparse_mlp_factory if sparse_mlp_factory is not None else moe_layer_factory(moe_impl)
    return loader.load_model(path, sparse_mlp_factory=sparse, dtype=dtype,
                             device=device, attention_impl=attention_impl, tp=tp,
                             batch_invariant=batch_invariant)


def build_tiny_model(*, seed: int = 0, dtype: torch.dtype = torch.float32,
                     device: str | torch.device = "cpu", attention_impl: Impl = "auto",
                     moe_impl: Impl = "auto", tp: Communicator | None = None,
                     sparse_mlp_factory: SparseMLPFactory | None = None,
                     batch_invariant: bool = False) -> LoadedModel:
    """:func:`deepinfer_kit.models.loader.build_tiny_model` with the default MoE layers
    (or ``sparse_mlp_factory``'s): the embedded tiny Qwen3-MoE-style model, the same for
    the same ``seed`` (with ``tp``, this rank's tensor-parallel shard)."""
    sparse = sparse_mlp_factory if sparse_mlp_factory is not None else moe_layer_factory(moe_impl)
    return loader.build_tiny_model(sparse_mlp_factory=sparse, seed=seed,
                                   dtype=dtype, device=device, attention_impl=attention_impl, tp=tp,
                                   batch_invariant=batch_invariant)
