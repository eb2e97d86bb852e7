"""TransformerCausalLM: the one decoder definition behind every supported family.

Llama, Qwen2, Qwen3, Qwen3-MoE, Mixtral and GLM-4-MoE differ only in flags read from
:class:`ModelConfig` (projection biases, q/k norm, RoPE variant and partial rotary, sliding
windows, which layers are sparse) and in their expert naming; the sparse MLPs come from an
injected :class:`SparseMLPFactory` (the engine's default builds ``deepinfer_kit.moe`` layers).
Gemma 3's flags (``models.gemma3_config``) add sandwich norms, ``(1 + weight)`` norms and
a GELU MLP (``fused_ops.family_ops``), scaled embeddings and a second RoPE for the sliding
layers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer_kit.comm.protocols import Communicator
from deepinfer_kit.errors import CheckpointError, ConfigError
from deepinfer_kit.models.config import ModelConfig
from deepinfer_kit.models.fused_ops import FusedOps, family_ops, select_fused_ops
from deepinfer_kit.models.invariant import select_numerics, set_numerics
from deepinfer_kit.models.layers import GatedMLP, Impl, Linear, PagedSelfAttention, RMSNorm
from deepinfer_kit.models.parallel.shard import VocabShard, vocab_shard
from deepinfer_kit.models.parallel.vocab import embed_vocab_parallel, gather_logits, load_vocab_rows
from deepinfer_kit.models.protocols import CausalLM, PagedKVStore, SparseMLP, SparseMLPFactory
from deepinfer_kit.models.layer_attention import attention_by_layer
from deepinfer_kit.models.mla import LatentSelfAttention
from deepinfer_kit.models.records import AttentionMetadata, ForwardBatch
from deepinfer_kit.models.rope import RotaryEmbedding
from deepinfer_kit.models.rope_kv import RopeKvOp, rope_kv_unsupported
from deepinfer_kit.models.weights import TrackedWeights, take

__all__ = ["TransformerCausalLM"]

Weights = Mapping[str, torch.Tensor]


class DecoderLayer(nn.Module):
    """Pre-norm block ``h += attn(norm(h)); h += mlp(norm(h))``, with each residual add fused
    into the norm after it (vLLM style).

    The layer returns its MLP output and the residual stream separately; the next layer's
    input norm (or the model's final norm) adds them. Same values as the unfused block.
    With ``config.sandwich_norms`` (Gemma 3) the attention output and the MLP output are
    each normed (``attn_out_norm``, ``mlp_out_norm``) before their residual adds.
    """

    def __init__(self, config: ModelConfig, layer: int, rotary: RotaryEmbedding, *,
                 attention_impl: Impl, dtype: torch.dtype, device: str | torch.device,
                 sparse_mlp: SparseMLP | None, ops: FusedOps, rope_kv: RopeKvOp | None,
                 tp: Communicator | None = None, batch_invariant: bool = False) -> None:
        super().__init__()
        eps, size = config.rms_norm_eps, config.hidden_size
        self.input_layernorm = RMSNorm(size, eps, dtype=dtype, device=device, ops=ops)
        self.self_attn: PagedSelfAttention | LatentSelfAttention = (
            LatentSelfAttention(config, layer, rotary, attention_impl=attention_impl, dtype=dtype,
                                device=device, ops=ops, tp=tp, batch_invariant=batch_invariant)
            if config.mla is not None else  # DeepSeek-V3: multi-head latent attention
            PagedSelfAttention(config, layer, rotary, attention_impl=attention_impl,
                               dtype=dtype, device=device, rope_kv=rope_kv, tp=tp,
                               batch_invariant=batch_invariant))
        self.post_attention_layernorm = RMSNorm(size, eps, dtype=dtype, device=device, ops=ops)
        # Gemma 3 sandwich norms: the attention and MLP outputs are normed before their adds
        # (its checkpoint's post_attention_layernorm is attn_out_norm; the pre-MLP norm above
        # reads pre_feedforward_layernorm).
        sandwich = config.sandwich_norms
        self.attn_out_norm: RMSNorm | None = (
            RMSNorm(size, eps, dtype=dtype, device=device, ops=ops) if sandwich else None)
        self.mlp_out_norm: RMSNorm | None = (
            RMSNorm(size, eps, dtype=dtype, device=device, ops=ops) if sandwich else None)
        self.is_sparse = sparse_mlp is not None
        self.mlp: nn.Module
        if sparse_mlp is not None:
            if not isinstance(sparse_mlp, nn.Module):
                raise TypeError("the sparse MLP factory must return an nn.Module")
            self.mlp = sparse_mlp
            self.mlp_prefix = config.moe_weight_prefix + "."
        else:
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, bias=config.mlp_bias,
                                dtype=dtype, device=device, ops=ops, tp=tp)
            self.mlp_prefix = "mlp."

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, kv_cache: PagedKVStore, batch: ForwardBatch,
                attn: AttentionMetadata | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer over ``T`` tokens; writes their K/V into this layer's cache.

        Args:
            hidden: ``[T, H]`` the previous layer's MLP output, or the embeddings for the
                first layer.
            residual: ``[T, H]`` the residual stream before ``hidden`` is added; ``None``
                for the first layer (the embeddings are the stream).
            attn: this layer's attention metadata (its cache group's slots and blocks,
                ``models.layer_attention``); ``None``: ``batch.attn``.

        Returns:
            ``(mlp_out, residual)``, both ``[T, H]``: the layer's output is their sum.
        """
        if residual is None:
            residual, attn_in = hidden, self.input_layernorm.forward(hidden)
        else:
            attn_in, residual = self.input_layernorm.forward_add(hidden, residual)
        attn_out = self.self_attn.forward(attn_in, cos, sin, kv_cache, attn or batch.attn)
        if self.attn_out_norm is not None:
            attn_out = self.attn_out_norm.forward(attn_out)
        mlp_in, residual = self.post_attention_layernorm.forward_add(attn_out, residual)
        real = batch.real_rows
        out: torch.Tensor = self.mlp(mlp_in) if real is None or not self.is_sparse else self.mlp(mlp_in, real)
        if self.mlp_out_norm is not None:
            out = self.mlp_out_norm.forward(out)
        return out, residual

    def load_hf_weights(self, weights: Weights, prefix: str) -> None:
        """Load ``prefix`` (``model.layers.<i>.``) tensors. Raises CheckpointError."""
        self.input_layernorm.load_hf_weights(weights, f"{prefix}input_layernorm.")
        if self.attn_out_norm is not None and self.mlp_out_norm is not None:
            self.attn_out_norm.load_hf_weights(weights, f"{prefix}post_attention_layernorm.")
            self.mlp_out_norm.load_hf_weights(weights, f"{prefix}post_feedforward_layernorm.")
            self.post_attention_layernorm.load_hf_weights(weights, f"{prefix}pre_feedforward_layernorm.")
        else:
            self.post_attention_layernorm.load_hf_weights(weights, f"{prefix}post_attention_layernorm.")
        self.self_attn.load_hf_weights(weights, f"{prefix}self_attn.")
        sparse = self.sparse_mlp
        if sparse is not None:
            sparse.load_hf_weights(weights, prefix + self.mlp_prefix)
        else:
            cast(GatedMLP, self.mlp).load_hf_weights(weights, prefix + self.mlp_prefix)

    @property
    def sparse_mlp(self) -> SparseMLP | None:
        """The MoE MLP of this layer, ``None`` for a dense layer."""
        return cast(SparseMLP, self.mlp) if self.is_sparse else None


class TransformerCausalLM(nn.Module):
    """A decoder-only model over the paged KV cache (implements :class:`CausalLM`).

    Build it with ``models.loader.load_model`` (a checkpoint folder) or
    ``build_tiny_model``; constructing it directly allocates uninitialized parameters that
    :meth:`load_hf_weights` fills.

    Args:
        config: the architecture.
        attention_impl: ``"auto" | "ref" | "triton"`` for every PagedAttention.
        fused_impl: ``"auto" | "ref" | "triton"`` for the norms, fused residual add + norm,
            SiLU-and-mul and the fused q/k norm + RoPE + KV write (``models.fused_ops``);
            ``None`` follows ``attention_impl``. The RoPE + KV write kernel is used only
            with ``"triton"`` and a config it supports (:attr:`rope_kv_reason` says why not).
        dtype: parameter and activation dtype.
        device: where parameters live.
        sparse_mlp_factory: builds the MoE MLP of each sparse layer; required when
            ``config.is_moe``.
        tp: a tensor-parallel group: attention and dense MLPs are sharded over it
            (``models.parallel``), the embedding and LM head by vocabulary rows (logits
            gathered before they are returned); the MoE MLPs stay whole on every rank
            (their experts may be split by expert parallelism). ``None``: one rank.
        batch_invariant: every row's logits bitwise the same whatever else the batch holds
            and however its request is chunked: every matmul through
            :func:`~deepinfer_kit.models.invariant.select_numerics` (set on each
            submodule with ``numerics``, the MoE routers and experts included), the
            fused ops' invariant SiLU and the
            invariant attention (docs/batch_invariance.md). Refused with ``tp``: a
            row-parallel layer sums each row's partial products over the ranks.

    Raises:
        ConfigError: an unknown ``attention_impl`` or ``fused_impl``; ``batch_invariant``
            with ``tp`` or on a machine whose GEMMs fail the invariance probe.
        DeviceUnavailableError: ``"triton"`` without CUDA and without the interpreter.
    """

    def __init__(self, config: ModelConfig, *, attention_impl: Impl = "auto",
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 sparse_mlp_factory: SparseMLPFactory | None = None,
                 fused_impl: Impl | None = None, tp: Communicator | None = None,
                 batch_invariant: bool = False) -> None:
        super().__init__()
        if batch_invariant and tp is not None and tp.world_size > 1:
            raise ConfigError(
                f"batch_invariant=True with tensor_parallel_size={tp.world_size}: a row-parallel "
                f"layer sums each row's partial products over the ranks, so a row's logits "
                f"depend on the parallel layout; run batch-invariant models on one rank")
        self.numerics = select_numerics(batch_invariant, device)
        self.batch_invariant = batch_invariant
        self.config = config
        self.tp = tp
        self.vocab: VocabShard | None = (
            vocab_shard(config.vocab_size, tp.world_size, tp.rank) if tp is not None else None)
        rows = config.vocab_size if self.vocab is None else self.vocab.size
        self.dtype = dtype
        self.fused_ops = select_fused_ops(
            attention_impl if fused_impl is None else fused_impl,
            on_cuda=torch.device(device).type == "cuda",
            field="attention_impl" if fused_impl is None else "fused_impl", batch_invariant=batch_invariant)
        self.fused_ops = family_ops(config, self.fused_ops, batch_invariant=batch_invariant)
        # Rounded as transformers' Gemma 3 rounds it: a float32 buffer cast to the model dtype.
        self.embed_multiplier: float | None = (
            None if config.embed_scale is None
            else float(torch.tensor(config.embed_scale, dtype=torch.float32).to(dtype)))
        """Multiplies the embeddings (Gemma 3's ``sqrt(H)`` in the model dtype); ``None``: 1."""
        ops = self.fused_ops
        self.rope_kv_reason: str | None = (
            "the fused ops are the torch references" if ops.rope_kv is None
            else rope_kv_unsupported(config))
        """Why the layers run the unfused q/k norm, RoPE and KV write; ``None``: fused."""
        rope_kv = ops.rope_kv if self.rope_kv_reason is None else None
        self.embed_tokens = nn.Parameter(
            torch.empty(rows, config.hidden_size, dtype=dtype, device=device),
            requires_grad=False)
        self.rotary = RotaryEmbedding(config.rope, device=device)
        self.local_rotary = (None if config.local_rope is None
                             else RotaryEmbedding(config.local_rope, device=device))
        """The sliding layers' RoPE when ``config.local_rope`` (Gemma 3), else ``None``."""
        sparse = set(config.sparse_layers)
        if sparse and sparse_mlp_factory is None:
            raise ValueError(f"{config.architecture} has sparse layers: pass sparse_mlp_factory")
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, self.rotary, attention_impl=attention_impl, dtype=dtype,
                         device=device,
                         sparse_mlp=(sparse_mlp_factory(config, i, dtype=dtype, device=device)
                                     if i in sparse and sparse_mlp_factory else None), ops=ops,
                         rope_kv=rope_kv, tp=tp, batch_invariant=batch_invariant)
            for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device,
                            ops=ops)
        self.lm_head: Linear | None = None
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, rows, bias=False,
                                  dtype=dtype, device=device)
        set_numerics(self, self.numerics)

    def forward(self, batch: ForwardBatch, kv_cache: PagedKVStore) -> torch.Tensor:
        """Run one step; see :meth:`CausalLM.forward`. Returns ``[N, V]`` float32 logits.

        Only the ``N`` rows of ``batch.logits_indices`` go through the final residual add,
        the final norm and the LM head.
        """
        return self.forward_layers(batch, kv_cache, len(self.layers))

    def forward_layers(self, batch: ForwardBatch, kv_cache: PagedKVStore,
                       num_layers: int) -> torch.Tensor:
        """:meth:`forward` through the first ``num_layers`` decoder layers only, then the
        final norm and the LM head (self-speculation drafts with it).

        Writes the K/V of layers ``0 .. num_layers - 1`` into the same cache layers of
        ``kv_cache`` (which may hold only those layers). Returns ``[N, V]`` float32.
        """
        return self.project(self.hidden_layers(batch, kv_cache, num_layers))

    def hidden_layers(self, batch: ForwardBatch, kv_cache: PagedKVStore,
                      num_layers: int) -> torch.Tensor:
        """The final-normed hidden states ``[N, H]`` (model dtype) of the rows
        ``batch.logits_indices`` after the first ``num_layers`` layers (the DSpark drafter's
        backbone). Writes K/V like :meth:`forward_layers`; raises nothing of its own."""
        with torch.inference_mode():
            hidden = (F.embedding(batch.input_ids, self.embed_tokens) if self.tp is None or self.vocab is None
                      else embed_vocab_parallel(batch.input_ids, self.embed_tokens, self.vocab, self.tp))
            if self.embed_multiplier is not None:
                hidden = hidden * self.embed_multiplier
            ropes = self._layer_cos_sin(batch.positions, hidden.dtype)
            residual: torch.Tensor | None = None
            layers = self.decoder_layers[:num_layers]
            per_layer = attention_by_layer(kv_cache, batch.attn, len(layers), batch.shared_rows)
            for i, (layer, attn) in enumerate(zip(layers, per_layer)):
                cos, sin = ropes[i]
                hidden, residual = layer.forward(hidden, residual, cos, sin, kv_cache, batch, attn)
            rows = batch.logits_indices
            if residual is None:
                return self.norm.forward(hidden[rows])
            normed, _ = self.norm.forward_add(hidden[rows], residual[rows])
            return normed

    def _layer_cos_sin(self, positions: torch.Tensor,
                       dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the ``(cos, signed_sin)`` ``[T, 1, rot]`` of ``positions`` ``[T]``:
        :attr:`local_rotary`'s on the sliding layers when set, else :attr:`rotary`'s (each
        computed once per step)."""
        whole = self.rotary.cos_sin(positions, dtype)
        if self.local_rotary is None:
            return [whole] * self.config.num_layers
        local = self.local_rotary.cos_sin(positions, dtype)
        return [whole if self.config.sliding_window(i) is None else local
                for i in range(self.config.num_layers)]

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, H]`` final-normed hidden states -> ``[N, V]`` float32 logits (the LM head,
        or the tied embeddings; under tensor parallelism each rank's rows, gathered)."""
        weight = self.embed_tokens if self.lm_head is None else self.lm_head.weight
        with torch.inference_mode():
            if self.tp is not None and self.vocab is not None:
                return gather_logits(hidden, weight, self.vocab, self.tp)
            return self.numerics.linear(hidden.to(weight.dtype), weight, None).float()

    @property
    def decoder_layers(self) -> list[DecoderLayer]:
        """The ``L`` decoder layers, typed."""
        return [cast(DecoderLayer, layer) for layer in self.layers]

    def expert_counts(self) -> torch.Tensor | None:
        """``[L_moe, E]`` int64 tokens per expert in the last forward, or ``None``."""
        sparse = [layer.sparse_mlp for layer in self.decoder_layers if layer.is_sparse]
        counts = [mlp.last_expert_counts for mlp in sparse if mlp is not None]
        if not counts or any(c is None for c in counts):
            return None
        return torch.stack([c for c in counts if c is not None])

    def load_hf_weights(self, weights: Weights) -> None:
        """Fill every parameter from Hugging Face tensor names (``model.embed_tokens.weight``,
        ``model.layers.<i>.…``, ``model.norm.weight``, ``lm_head.weight``).

        Raises:
            CheckpointError: naming a missing, mis-shaped or unexpected tensor.
        """
        tracked = TrackedWeights(weights)
        config = self.config
        with torch.no_grad():
            if self.vocab is not None:
                load_vocab_rows(self.embed_tokens, tracked, "model.embed_tokens.weight", self.vocab)
            else:
                embed = take(tracked, "model.embed_tokens.weight", tuple(self.embed_tokens.shape))
                self.embed_tokens.copy_(embed)
            for i, layer in enumerate(self.decoder_layers):
                layer.load_hf_weights(tracked, f"model.layers.{i}.")
            self.norm.load_hf_weights(tracked, "model.norm.")
            if self.lm_head is not None and self.vocab is not None:
                load_vocab_rows(self.lm_head.weight, tracked, "lm_head.weight", self.vocab)
            elif self.lm_head is not None:
                self.lm_head.load_hf_weights(tracked, "lm_head.")
        unexpected = [name for name in tracked.unread() if not _ignorable(name, config)]
        if unexpected:
            shown = ", ".join(repr(n) for n in unexpected[:5])
            more = f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else ""
            raise CheckpointError(
                f"unexpected checkpoint tensor(s) for {config.architecture}: {shown}{more}")


def _ignorable(name: str, config: ModelConfig) -> bool:
    """Tensors a valid checkpoint may carry that this model does not use."""
    if name.endswith("rotary_emb.inv_freq"):
        return True
    if name == "lm_head.weight" and config.tie_word_embeddings:
        return True
    # GLM-4-MoE and DeepSeek-V3 ship their multi-token-prediction layers after the decoder layers.
    if config.model_type in ("glm4_moe", "deepseek_v3") and name.startswith("model.layers."):
        index = name.split(".")[2]
        return index.isdigit() and int(index) >= config.num_layers
    return False


if TYPE_CHECKING:
    _check: type[CausalLM] = TransformerCausalLM
