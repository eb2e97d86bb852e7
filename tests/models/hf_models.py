"""Tiny ``transformers`` models of every supported family, saved as real checkpoint folders.

Weights are re-drawn from a seed with a scale that keeps logits peaked (embeddings
unit-variance, projections ``1/sqrt(fan_in)``, norm weights and biases perturbed so a
swapped or skipped tensor changes the output), then saved with ``save_pretrained``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

COMMON: dict[str, Any] = dict(
    vocab_size=160, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, eos_token_id=None, bos_token_id=None,
    pad_token_id=None,
)


def _configs() -> dict[str, Callable[[], Any]]:
    import transformers as T

    return {
        "llama": lambda: T.LlamaConfig(**COMMON, intermediate_size=96),
        # llama3 RoPE with a short original context so scaling changes the frequencies used;
        # MQA, tied embeddings, attention and MLP biases.
        "llama-llama3": lambda: T.LlamaConfig(
            **(COMMON | {"num_key_value_heads": 1}), intermediate_size=96,
            tie_word_embeddings=True, attention_bias=True, mlp_bias=True,
            rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 16}),
        "llama-linear": lambda: T.LlamaConfig(
            **COMMON, intermediate_size=96,
            rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 3.0}),
        "mistral": lambda: T.MistralConfig(**COMMON, intermediate_size=96, head_dim=32),
        # every layer slides (window 5: the oracle prompts and decodes run past it)
        "mistral-sliding": lambda: T.MistralConfig(**COMMON, intermediate_size=96, sliding_window=5),
        "qwen2-yarn": lambda: T.Qwen2Config(
            **COMMON, intermediate_size=96,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 32}),
        "qwen3": lambda: T.Qwen3Config(**COMMON, intermediate_size=96, head_dim=32,
                                       tie_word_embeddings=True),
        "qwen3_moe": lambda: T.Qwen3MoeConfig(
            **(COMMON | {"num_hidden_layers": 3}), intermediate_size=96, head_dim=16,
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            norm_topk_prob=True, mlp_only_layers=[1]),
        "qwen2_moe": lambda: T.Qwen2MoeConfig(
            **COMMON, intermediate_size=96, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, shared_expert_intermediate_size=48),
        "mixtral": lambda: T.MixtralConfig(**COMMON, intermediate_size=48, num_local_experts=4,
                                           num_experts_per_tok=2),
        "mixtral-sliding": lambda: T.MixtralConfig(
            **COMMON, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
            sliding_window=5),
        "glm4_moe": lambda: T.Glm4MoeConfig(
            **(COMMON | {"num_hidden_layers": 3}), intermediate_size=96, head_dim=16,
            moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
            topk_group=1, first_k_dense_replace=1, n_shared_experts=1,
            routed_scaling_factor=2.5, attention_bias=True, use_qk_norm=True),
        # multi-head latent attention: q through a rank-24 latent, a 32-dim KV latent plus an
        # 8-dim shared rotary key (interleaved pairs; the 40-dim cache row differs from every
        # per-head width), YaRN whose mscale_all_dim scales the softmax; DeepSeek routing
        # (groups, correction bias, shared expert) after a dense layer.
        "deepseek_v3": lambda: T.DeepseekV3Config(
            **(COMMON | {"num_hidden_layers": 3, "num_key_value_heads": 4}), intermediate_size=96,
            moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
            topk_group=1, first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.5,
            q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 16.0,
                             "original_max_position_embeddings": 32, "mscale": 1.0,
                             "mscale_all_dim": 1.0}),
        # MLA without the query latent (one q_proj), rotate-half RoPE, biased a/o projections,
        # v_head_dim != qk_nope_head_dim; ungrouped routing without renormalisation.
        "deepseek_v3-plain": lambda: T.DeepseekV3Config(
            **(COMMON | {"num_key_value_heads": 4}), intermediate_size=96,
            moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
            topk_group=1, first_k_dense_replace=1, n_shared_experts=1, norm_topk_prob=False,
            q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
            v_head_dim=20, rope_interleave=False, attention_bias=True),
        # attention sinks, q/k/v/o biases, sliding (window 5) / full layers alternating,
        # YaRN over a 16-token original context; MoE on every layer with a biased
        # top-k-then-softmax router and biased experts whose clamped SwiGLU clamps at 1.5
        # (not 7.0, so the clamp bites at these scales); 2I = 48 != H = 64 (no square mix-up).
        "gpt_oss": lambda: T.GptOssConfig(
            **(COMMON | {"num_hidden_layers": 4}), head_dim=16, intermediate_size=24,
            num_local_experts=4, num_experts_per_tok=2, sliding_window=5, swiglu_limit=1.5,
            rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                             "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                             "original_max_position_embeddings": 16}),
        # 5 local : 1 global layers, window 5 (prompts and decodes run past it), softmax
        # scale from query_pre_attn_scalar != head_dim, local and global RoPE bases differ,
        # linear scaling on the global layers only; (1 + w) norms, GELU-tanh, tied.
        "gemma3": lambda: T.Gemma3TextConfig(
            **(COMMON | {"num_hidden_layers": 6}), intermediate_size=96, head_dim=32,
            sliding_window=5, query_pre_attn_scalar=20,
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 2000.0},
                             "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                "rope_theta": 50000.0}}),
    }


FAMILIES = tuple(_configs())


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int) -> None:
    """Re-draw every parameter (and the routing bias buffers) from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    # Gemma 3 multiplies its embeddings by sqrt(H): unit-variance ones would swamp the
    # residual stream, and greedy decoding would repeat the last token whatever attention does.
    embed_std = 1.0 if getattr(model.config, "model_type", "") != "gemma3_text" else None
    for name, param in model.named_parameters():
        if param.ndim >= 2:
            std = (embed_std or param.shape[-1] ** -0.5) if "embed" in name else param.shape[-1] ** -0.5
            param.copy_(torch.randn(param.shape, generator=gen) * std)
        elif name.endswith("sinks"):  # gpt-oss: some heads mostly sink, some barely
            param.copy_(2.0 * torch.randn(param.shape, generator=gen))
        elif "norm" in name:
            param.copy_(1 + 0.2 * torch.randn(param.shape, generator=gen))
        else:
            param.copy_(0.2 * torch.randn(param.shape, generator=gen))
    for name, buf in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buf.copy_(0.1 * torch.randn(buf.shape, generator=gen))


def make_checkpoint(family: str, folder: Path, *, seed: int = 0) -> Any:
    """Build the tiny ``family`` model, save it to ``folder``; returns the HF model (eval)."""
    import transformers as T

    torch.manual_seed(seed)
    config = _configs()[family]()
    model = T.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize(model, seed)
    model.eval()
    model.save_pretrained(folder, safe_serialization=True)
    return model


def five_to_one(folder: Path, window: int, seed: int) -> Any:
    """A Qwen2 with 5 sliding layers (``window``) then 1 full one, randomized and saved to
    ``folder``; returns the HF model (eval). The hybrid KV cache's test model."""
    import transformers as T

    config = T.Qwen2Config(**(COMMON | {"num_hidden_layers": 6}), intermediate_size=96,
                           use_sliding_window=True, sliding_window=window, max_window_layers=0,
                           layer_types=["sliding_attention"] * 5 + ["full_attention"])
    config.architectures = ["Qwen2ForCausalLM"]
    model = T.Qwen2ForCausalLM(config).eval()
    randomize(model, seed)
    model.save_pretrained(folder)
    return model


@torch.no_grad()
def hf_greedy(model: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    """``transformers`` greedy generation (its own KV cache); the new tokens only."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                         min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return [int(t) for t in out[0, len(prompt):]]


def hf_greedy_full(model: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy tokens from one full forward per token (no cache): the oracle for windowed
    models, whose transformers cache this does not trust."""
    seq = list(prompt)
    for _ in range(max_new_tokens):
        seq.append(int(hf_logits(model, seq)[-1].argmax()))
    return seq[len(prompt):]


@torch.no_grad()
def hf_logits(model: Any, prompt: list[int]) -> torch.Tensor:
    """``[len(prompt), V]`` float32 logits of one forward over ``prompt``."""
    return model(torch.tensor([prompt])).logits[0].float()


def serve_in_turn(engine: Any, prompts: list[list[int]], params: Any) -> tuple[list[list[int]], list[list[float]]]:
    """Serve ``prompts`` on a kit ``engine`` one after another (each run to the end before
    the next is added, so later ones find the earlier ones' prefixes); per prompt its tokens
    and each token's logprob (``params`` must ask for ``logprobs``)."""
    tokens: list[list[int]] = []
    logprobs: list[list[float]] = []
    for p in prompts:
        rid = engine.add_request(None, p, params)
        for o in engine.run():
            if o.request_id == rid:
                tokens.append(list(o.outputs[0].token_ids))
                logprobs.append([lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, tokens[-1])])
    return tokens, logprobs
