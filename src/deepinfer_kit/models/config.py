"""ModelConfig: the validated shape of a supported checkpoint, read from a Hugging Face config.

One parser serves every family; the per-family differences (biases, q/k norm, which layers
are sparse, expert naming) are decided here once, so the model code only reads flags.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs

from deepinfer_kit.errors import ConfigError
from deepinfer_kit.models.config_parts import (
    RopeConfig,
    as_bool,
    as_float,
    as_int,
    as_optional_int,
    parse_rope,
    sparse_layer_indices,
)
from deepinfer_kit.models.gemma3_config import GEMMA3_TEXT, gemma3_fields
from deepinfer_kit.models.mla_config import CacheRow, MLAConfig, parse_mla
from deepinfer_kit.models.gpt_oss import gpt_oss_hf_config, layer_type_windows
from deepinfer_kit.moe.config import MoEConfig

__all__ = ["ModelConfig", "RopeConfig", "SUPPORTED_ARCHITECTURES"]

#: architecture name (``config.json`` ``architectures[0]``) -> ``model_type``.
SUPPORTED_ARCHITECTURES: Mapping[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "Glm4MoeForCausalLM": "glm4_moe",
    "Gemma3ForCausalLM": GEMMA3_TEXT,
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "GptOssForCausalLM": "gpt_oss",
}
_BY_MODEL_TYPE = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}


@attrs.frozen(slots=True)
class ModelConfig:
    """What the model definitions need to know about a checkpoint.

    Build it with :meth:`from_hf_config` (a ``config.json`` dict) or :meth:`from_pretrained`
    (a folder); both validate and raise :class:`ConfigError` naming the field at fault, or
    the architecture when it is not supported.

    Attributes:
        architecture: e.g. ``"Qwen3ForCausalLM"`` (one of :data:`SUPPORTED_ARCHITECTURES`).
        model_type: e.g. ``"qwen3"``.
        vocab_size: ``V``.
        hidden_size: ``H``.
        num_layers: ``L`` decoder layers.
        num_heads: query heads.
        num_kv_heads: key/value heads (divides ``num_heads``; GQA when smaller).
        head_dim: per-head size (may differ from ``H / num_heads``, e.g. Qwen3).
        max_position_embeddings: longest sequence the checkpoint declares.
        eos_token_ids: ids that end a generation (``config.json`` plus
            ``generation_config.json``), possibly empty.
        bos_token_id: the beginning-of-sequence id, if any.
        tie_word_embeddings: ``lm_head`` shares the embedding matrix.
        rms_norm_eps: epsilon of every RMSNorm.
        intermediate_size: hidden size of the dense (non-expert) MLPs.
        rope: rotary embedding parameters.
        qkv_bias: q/k/v projections carry a bias (Qwen2; ``attention_bias`` elsewhere).
        o_bias: the output projection carries a bias (Llama/Qwen3 ``attention_bias``).
        mlp_bias: dense MLP projections carry a bias (Llama ``mlp_bias``).
        qk_norm: per-head RMSNorm on queries and keys before RoPE (Qwen3, GLM option).
        sliding_windows: per layer, the attention window in tokens or ``None`` for full
            attention; length ``num_layers``.
        moe: the MoE layer shape and routing (``deepinfer_kit.moe.MoEConfig``) shared by
            every sparse layer, ``None`` for dense models.
        sparse_layers: indices of the layers whose MLP is ``moe`` (the others are dense).
        mla: DeepSeek-V3 multi-head latent attention (``models.mla_config.MLAConfig``),
            ``None`` for the other families; with it ``num_kv_heads`` is 1 and ``head_dim``
            ``kv_lora_rank + qk_rope_head_dim``: the one latent row each token caches (as
            vLLM counts an MLA cache; a pool built from them has the row's shape), and
            ``rope`` rotates ``qk_rope_head_dim`` dims. The per-head sizes are ``mla``'s.
        hidden_act: the gated MLP's activation: ``"silu"`` (SwiGLU) or
            ``"gelu_pytorch_tanh"`` (GeGLU, Gemma 3's ``hidden_activation``).
        norm_offset: every RMSNorm (q/k norms and the final norm included) scales by
            ``1 + weight`` in float32 (Gemma 3; ``fused_ops.offset_rms_norm``).
        sandwich_norms: each layer also norms its attention output and its MLP output
            before their residual adds (Gemma 3: four norms per layer).
        embed_scale: the embeddings are multiplied by this (rounded to float32, then to the
            model dtype, as transformers' Gemma 3 does); ``None``: not scaled.
        attn_scale: the softmax scale; ``None``: ``head_dim ** -0.5`` (Gemma 3:
            ``query_pre_attn_scalar ** -0.5``).
        local_rope: the rotary embedding of the sliding-window layers (Gemma 3's local base
            frequency); ``None``: every layer uses ``rope``.
        attention_sinks: every attention layer has a learned per-query-head sink logit
            (``self_attn.sinks`` ``[num_heads]``, gpt-oss) in its softmax denominator.
        raw: the ``config.json`` dict as read (not compared, not printed).
        folder: the checkpoint folder it was read from (:meth:`from_pretrained`), else
            ``None`` (not compared); lets errors about the folder's other files name them.
    """

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    tie_word_embeddings: bool
    rms_norm_eps: float
    intermediate_size: int
    rope: RopeConfig
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_windows: tuple[int | None, ...] = ()
    moe: MoEConfig | None = None
    sparse_layers: tuple[int, ...] = ()
    mla: MLAConfig | None = None
    hidden_act: str = "silu"
    norm_offset: bool = False
    sandwich_norms: bool = False
    embed_scale: float | None = None
    attn_scale: float | None = None
    local_rope: RopeConfig | None = None
    attention_sinks: bool = False
    raw: Mapping[str, Any] = attrs.field(factory=dict, eq=False, repr=False)
    folder: str | None = attrs.field(default=None, eq=False)

    def __attrs_post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "max_position_embeddings", "intermediate_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an int >= 1, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads must be a multiple of num_kv_heads, got num_heads={self.num_heads} "
                f"and num_kv_heads={self.num_kv_heads}"
            )
        if not self.rms_norm_eps > 0:
            raise ConfigError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps!r}")
        if self.hidden_act not in ("silu", "gelu_pytorch_tanh"):
            raise ConfigError(f"hidden_act must be 'silu' or 'gelu_pytorch_tanh', got {self.hidden_act!r}")
        if len(self.sliding_windows) not in (0, self.num_layers):
            raise ConfigError(
                f"sliding_windows must have num_layers={self.num_layers} entries, "
                f"got {len(self.sliding_windows)}"
            )
        if any(not 0 <= i < self.num_layers for i in self.sparse_layers):
            raise ConfigError(f"sparse_layers must be in [0, {self.num_layers}), got {self.sparse_layers}")
        if self.sparse_layers and self.moe is None:
            raise ConfigError(f"sparse_layers {self.sparse_layers} need an moe config, got None")
        for token in self.eos_token_ids + ((self.bos_token_id,) if self.bos_token_id is not None else ()):
            if not 0 <= token < self.vocab_size:
                raise ConfigError(f"special token id must be in [0, {self.vocab_size}), got {token}")

    @property
    def is_moe(self) -> bool:
        """True when some layer is sparse (has experts)."""
        return bool(self.sparse_layers)

    @property
    def moe_weight_prefix(self) -> str:
        """The sparse MLP's module name in checkpoint tensor names (Mixtral's differs)."""
        return "block_sparse_moe" if self.model_type == "mixtral" else "mlp"

    def sliding_window(self, layer: int) -> int | None:
        """The attention window of ``layer`` in tokens, ``None`` for full causal attention."""
        return self.sliding_windows[layer] if self.sliding_windows else None

    def cache_row(self, num_kv_heads: int | None = None) -> CacheRow:
        """What one token of one layer stores in the KV pool (the engine's pool is built
        and sized from it): with :attr:`mla` one keys-only row of ``kv_lora_rank +
        qk_rope_head_dim``; else a key and a value of ``num_kv_heads`` (this rank's heads;
        default all) x ``head_dim``. Pure."""
        if self.mla is not None:
            return self.mla.cache_row()
        return CacheRow(self.num_kv_heads if num_kv_heads is None else num_kv_heads, self.head_dim)

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> ModelConfig:
        """Parse a Hugging Face ``config.json`` dict (transformers 4.x or 5.x layout).

        Raises:
            ConfigError: unsupported architecture (named), missing or invalid field (named),
                an unsupported RoPE scaling type or activation.
        """
        architecture = _architecture(config)
        model_type = SUPPORTED_ARCHITECTURES[architecture]
        if model_type == "gpt_oss":  # transformers' GptOssConfig defaults for absent keys
            config = gpt_oss_hf_config(config)
        gemma = model_type == GEMMA3_TEXT
        act = config.get("hidden_act", "silu")
        if act != "silu" and not gemma:  # Gemma 3 reads hidden_activation (gemma3_fields)
            raise ConfigError(f"hidden_act must be 'silu', got {act!r}")
        hidden = as_int(config, "hidden_size")
        heads = as_int(config, "num_attention_heads")
        # transformers reads a missing, null or 0 head_dim as hidden_size // heads (Gemma 3: 256).
        head_dim = as_optional_int(config, "head_dim") or (256 if gemma else hidden // heads if heads else 0)
        mla = parse_mla(config, model_type)  # DeepSeek-V3 (its head_dim names the rope dims)
        num_layers = as_int(config, "num_hidden_layers")
        max_pos = as_int(config, "max_position_embeddings", 2048)
        # Gemma 3's norms, activation, scales, layer types and two RoPEs replace the generic parse.
        family = (gemma3_fields(config, hidden_size=hidden, head_dim=head_dim, num_layers=num_layers,
                                max_pos=max_pos) if gemma else {})
        attention_bias = as_bool(config, "attention_bias", False)
        # Per-family attention layout (what the transformers reference builds).
        qkv_bias = {"qwen2": True, "qwen2_moe": as_bool(config, "qkv_bias", True),
                    "mixtral": False}.get(model_type, attention_bias)
        o_bias = attention_bias if model_type in ("llama", "qwen3", "qwen3_moe", "gpt_oss") else False
        qk_norm = model_type in ("qwen3", "qwen3_moe") or (
            model_type == "glm4_moe" and as_bool(config, "use_qk_norm", False)
        )
        sparse = sparse_layer_indices(config, model_type, num_layers)
        parsed = cls(
            architecture=architecture,
            model_type=model_type,
            vocab_size=as_int(config, "vocab_size"),
            hidden_size=hidden,
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=as_int(config, "num_key_value_heads", heads) if mla is None else 1,
            head_dim=head_dim if mla is None else mla.latent_row,
            max_position_embeddings=max_pos,
            eos_token_ids=_token_ids(config.get("eos_token_id"), "eos_token_id"),
            bos_token_id=_optional_token(config.get("bos_token_id"), "bos_token_id"),
            tie_word_embeddings=as_bool(config, "tie_word_embeddings", gemma),
            rms_norm_eps=as_float(config, "rms_norm_eps", 1e-6),
            intermediate_size=as_int(config, "intermediate_size"),
            rope=family["rope"] if gemma else parse_rope(
                config, model_type, head_dim if mla is None else mla.qk_rope_head_dim, max_pos),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=model_type == "llama" and as_bool(config, "mlp_bias", False),
            qk_norm=qk_norm,
            sliding_windows=_sliding_windows(config, model_type, num_layers),
            moe=MoEConfig.from_hf(config) if sparse else None,
            sparse_layers=sparse,
            mla=mla,
            attention_sinks=model_type == "gpt_oss",
            raw=dict(config),
        )
        return attrs.evolve(parsed, **family) if family else parsed

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str]) -> ModelConfig:
        """Read ``config.json`` (and the EOS ids of ``generation_config.json``) from a folder.

        Raises:
            CheckpointError: the folder or ``config.json`` is missing or not valid JSON.
            ConfigError: as :meth:`from_hf_config`, the message also naming the file.
        """
        from deepinfer_kit.errors import CheckpointError

        folder = Path(path)
        config_file = folder / "config.json"
        if not config_file.is_file():
            raise CheckpointError(f"checkpoint folder {str(folder)!r} has no config.json")
        try:
            config = json.loads(config_file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{str(config_file)!r} is not valid JSON: {exc}") from None
        if not isinstance(config, dict):
            raise CheckpointError(f"{str(config_file)!r} must hold a JSON object")
        generation_file = folder / "generation_config.json"
        if generation_file.is_file():
            try:
                extra = json.loads(generation_file.read_text()).get("eos_token_id")
            except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
                extra = None
            with _naming(config_file):
                merged = list(_token_ids(config.get("eos_token_id"), "eos_token_id"))
            with _naming(generation_file):
                extra_ids = _token_ids(extra, "eos_token_id")
            merged += [t for t in extra_ids if t not in merged]
            config["eos_token_id"] = merged
        with _naming(config_file):
            return attrs.evolve(cls.from_hf_config(config), folder=str(folder))


@contextmanager
def _naming(file: Path) -> Iterator[None]:
    """Re-raise a ConfigError with the file it came from appended to its message."""
    try:
        yield
    except ConfigError as exc:
        raise type(exc)(f"{exc} (in {str(file)!r})") from None


def _architecture(config: Mapping[str, Any]) -> str:
    names = config.get("architectures")
    if isinstance(names, list) and names:
        name = names[0]
    elif config.get("model_type") in _BY_MODEL_TYPE:
        name = _BY_MODEL_TYPE[config["model_type"]]
    else:
        name = names if names else config.get("model_type")
    if name not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(
            f"architecture {name!r} is not supported; supported: {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    return str(name)


def _token_ids(value: Any, field: str) -> tuple[int, ...]:
    if value is None:
        return ()
    values = value if isinstance(value, (list, tuple)) else [value]
    if any(isinstance(v, bool) or not isinstance(v, int) for v in values):
        raise ConfigError(f"{field} must be an int or a list of ints, got {value!r}")
    return tuple(dict.fromkeys(values))


def _optional_token(value: Any, field: str) -> int | None:
    ids = _token_ids(value, field)
    return ids[0] if ids else None


def _sliding_windows(
    config: Mapping[str, Any], model_type: str, num_layers: int
) -> tuple[int | None, ...]:
    if model_type == "gpt_oss":  # layer_types alternate sliding / full
        return layer_type_windows(config, num_layers)
    window = config.get("sliding_window")
    if model_type in ("mixtral", "mistral"):  # every layer slides when a window is set
        return (as_int(config, "sliding_window"),) * num_layers if window is not None else ()
    qwen = model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
    if not qwen or not as_bool(config, "use_sliding_window", False):
        return ()
    if window is None:
        return ()
    size = as_int(config, "sliding_window")
    layer_types = config.get("layer_types")
    if isinstance(layer_types, list) and len(layer_types) == num_layers:
        return tuple(size if t == "sliding_attention" else None for t in layer_types)
    if model_type == "qwen3_moe":
        return (size,) * num_layers
    first = as_int(config, "max_window_layers", num_layers)
    return tuple(size if i >= first else None for i in range(num_layers))
