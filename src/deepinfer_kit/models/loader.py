"""Loading a model: from a Hugging Face checkpoint folder, or the embedded tiny default.

It builds :class:`TransformerCausalLM` and fills it from safetensors only. The MoE layers
of sparse models come from an injected :class:`SparseMLPFactory`; the models package
builds none itself (``deepinfer_kit.engine.runner.assemble`` passes the default, built from
``deepinfer_kit.moe``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import attrs
import torch

from deepinfer_kit._dtypes import dtype_name
from deepinfer_kit.comm.protocols import Communicator
from deepinfer_kit.errors import ConfigError
from deepinfer_kit.models.causal_lm import TransformerCausalLM
from deepinfer_kit.models.config import ModelConfig
from deepinfer_kit.models.layers import Impl
from deepinfer_kit.models.protocols import SparseMLPFactory
from deepinfer_kit.models.tiny import tiny_hf_config, tiny_hf_weights
from deepinfer_kit.models.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer
from deepinfer_kit.models.weights import SafetensorsWeights

__all__ = ["LoadedModel", "load_model", "build_tiny_model", "build_model"]


@attrs.define(slots=True, eq=False)
class LoadedModel:
    """A model ready to run, with its configuration and tokenizer.

    Attributes:
        model: the network (an ``nn.Module`` implementing ``CausalLM``), in eval mode.
        config: its configuration (also ``model.config``).
        tokenizer: the checkpoint's tokenizer, or the byte-level one.
    """

    model: TransformerCausalLM
    config: ModelConfig
    tokenizer: Tokenizer


def build_model(config: ModelConfig, weights: Mapping[str, torch.Tensor], *,
                sparse_mlp_factory: SparseMLPFactory | None = None,
                dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                attention_impl: Impl = "auto", tp: Communicator | None = None,
                batch_invariant: bool = False) -> TransformerCausalLM:
    """Build the model of ``config`` and fill it from Hugging Face-named ``weights``.

    Args:
        sparse_mlp_factory: builds the MoE MLP of each sparse layer; required when
            ``config.is_moe``, unused for a dense model.
        tp: a tensor-parallel group: this rank builds and loads only its shard (reading
            only those slices of safetensors-backed ``weights``). Collective when used:
            every rank of ``tp`` builds its model.
        batch_invariant: see :class:`TransformerCausalLM`.

    Raises:
        ConfigError: ``dtype`` is not float32, float16 or bfloat16; a sparse ``config``
            without ``sparse_mlp_factory``.
        CheckpointError: a tensor is missing, mis-shaped or unexpected (named).
    """
    dtype_name(dtype)
    if config.is_moe and sparse_mlp_factory is None:
        raise ConfigError(
            f"sparse_mlp_factory is required for the sparse {config.architecture}, got None "
            "(deepinfer_kit.engine.runner.assemble passes the default MoE layers)"
        )
    model = TransformerCausalLM(config, attention_impl=attention_impl, dtype=dtype, device=device,
                                sparse_mlp_factory=sparse_mlp_factory if config.is_moe else None, tp=tp,
                                batch_invariant=batch_invariant)
    model.load_hf_weights(weights)
    model.eval()
    return model


def load_model(path: str | os.PathLike[str], *,
               sparse_mlp_factory: SparseMLPFactory | None = None,
               dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               attention_impl: Impl = "auto", tp: Communicator | None = None,
               batch_invariant: bool = False) -> LoadedModel:
    """Load a Hugging Face checkpoint folder (with ``tp``, this rank's shard only: see
    :func:`build_model`).

    Reads ``config.json`` (+ ``generation_config.json`` EOS ids), the weights from
    ``model.safetensors`` or the shards of ``model.safetensors.index.json`` (never a pickle
    file), converting them to ``dtype`` on ``device``, and ``tokenizer.json`` when
    ``tokenizers`` is installed (else the byte-level tokenizer).

    Args:
        sparse_mlp_factory: builds the MoE MLP of each sparse layer; required for a
            sparse checkpoint (see :func:`build_model`).

    Raises:
        ConfigError: unsupported architecture or invalid config field (named), bad dtype,
            a sparse checkpoint without ``sparse_mlp_factory``.
        CheckpointError: missing folder/config, no safetensors (pickle-only folders are
            refused unread), a missing, mis-shaped or unexpected tensor (named).
    """
    config = ModelConfig.from_pretrained(path)
    with SafetensorsWeights(path) as weights:
        model = build_model(config, weights, sparse_mlp_factory=sparse_mlp_factory, dtype=dtype,
                            device=device, attention_impl=attention_impl, tp=tp,
                            batch_invariant=batch_invariant)
    tokenizer = load_tokenizer(path, eos_token_id=config.eos_token_ids[0] if config.eos_token_ids else None,
                               bos_token_id=config.bos_token_id)
    return LoadedModel(model=model, config=config, tokenizer=tokenizer)


def build_tiny_model(*, sparse_mlp_factory: SparseMLPFactory, seed: int = 0,
                     dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                     attention_impl: Impl = "auto", tp: Communicator | None = None,
                     batch_invariant: bool = False) -> LoadedModel:
    """The embedded default: a tiny Qwen3-MoE-style model (2 layers, hidden 64, 8 experts
    top-2) with seeded random weights and the :class:`ByteTokenizer`, its sparse layers
    built by ``sparse_mlp_factory`` (with ``tp``, this rank's shard). No file, no
    download; the same ``seed`` gives the same model."""
    config = ModelConfig.from_hf_config(tiny_hf_config())
    model = build_model(config, tiny_hf_weights(config, seed=seed),
                        sparse_mlp_factory=sparse_mlp_factory, dtype=dtype, device=device,
                        attention_impl=attention_impl, tp=tp, batch_invariant=batch_invariant)
    return LoadedModel(model=model, config=config, tokenizer=ByteTokenizer())
