"""Train the embedded "tiny-words" model: a byte-level Qwen3-MoE decoder on the project's own docs.

    PYTHONPATH=src python scripts/train_embedded.py                    # full run: writes the shipped weights
    PYTHONPATH=src python scripts/train_embedded.py --refresh-corpus   # re-snapshot README.md + docs/*.md first

The corpus is a snapshot (``scripts/embedded_corpus.txt``: README.md then docs/*.md in sorted
order, each after a ``# file: <name>`` line), so later edits to the docs do not change what a
re-run trains on; its SHA-256 is checked before training and stored in the weights' metadata.

Everything is seeded: the initial weights and every batch offset come from private
``torch.Generator`` s, and training runs in float32 on the CPU on one thread (``--threads``),
so re-running with the same torch version and CPU regenerates the same fp16 file bit for bit
(other thread counts, CPUs or torch versions change the reduction order: the same loss curve
to about 1e-3, not the same bits; see docs/models.md).

The training forward below (:class:`WordsModel`) is the Qwen3-MoE math written for autograd
over whole sequences (dense routing over few experts); :func:`hf_weights` names its tensors as
a Hugging Face checkpoint, and ``deepinfer_kit`` loads that checkpoint through its normal
loader (tests/models/test_embedded_words.py checks the logits agree).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer_kit.models.tiny import tiny_hf_config

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "scripts" / "embedded_corpus.txt"
OUT_DIR = ROOT / "src" / "deepinfer_kit" / "models" / "embedded" / "tiny-words"

#: The tiny model's config.json (same layout, byte tokenizer, special ids) at a size that learns words.
HF_CONFIG: dict[str, Any] = {
    **tiny_hf_config(),
    "hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 128, "num_hidden_layers": 4,
    "head_dim": 32, "num_experts": 4, "torch_dtype": "float16",
}

FULL = {"steps": 700, "batch": 16, "seq": 128, "lr": 3e-3, "warmup": 50, "seed": 0}
SHORT = {"steps": 20, "batch": 4, "seq": 64, "lr": 3e-3, "warmup": 5, "seed": 0}


def build_corpus() -> str:
    """README.md then docs/*.md (sorted), each after a ``# file: <name>`` line."""
    parts = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        parts.append(f"# file: {path.relative_to(ROOT)}\n\n{path.read_text(encoding='utf-8')}")
    return "\n".join(parts)


def load_corpus() -> tuple[torch.Tensor, str]:
    """The snapshot's bytes as an int64 tensor ``[N]`` and their SHA-256."""
    data = CORPUS.read_bytes()
    return torch.tensor(list(data), dtype=torch.int64), hashlib.sha256(data).hexdigest()


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), w, eps)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class WordsModel(nn.Module):
    """Qwen3-MoE decoder for training: ``forward(ids [B, S]) -> (logits [B, S, V], aux loss)``.

    Experts are stacked per layer (``gate_up [L][E, 2I, H]``, ``down [L][E, H, I]``) and every
    expert runs on every token, weighted by the renormalized top-k softmax (zero elsewhere):
    with 4 experts that costs 2x the routed FLOPs but no gathers, which is faster on a CPU.
    """

    def __init__(self, cfg: dict[str, Any], gen: torch.Generator) -> None:
        super().__init__()
        self.cfg = cfg
        h, d, v = cfg["hidden_size"], cfg["head_dim"], cfg["vocab_size"]
        nh, nkv, e, i = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["num_experts"], cfg["moe_intermediate_size"]
        L = cfg["num_hidden_layers"]

        def p(*shape: int, std: float = 0.02) -> nn.Parameter:
            return nn.Parameter(torch.randn(*shape, generator=gen) * std)

        def ones(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.ones(*shape))

        out_std = 0.02 / math.sqrt(2 * L)
        self.embed = p(v, h)
        self.lm_head = p(v, h)
        self.norm = ones(h)
        self.layers = nn.ModuleList()
        for _ in range(L):
            layer = nn.ParameterDict({
                "in_norm": ones(h), "post_norm": ones(h), "q_norm": ones(d), "k_norm": ones(d),
                "q": p(nh * d, h), "k": p(nkv * d, h), "v": p(nkv * d, h), "o": p(h, nh * d, std=out_std),
                "gate": p(e, h), "gate_up": p(e, 2 * i, h), "down": p(e, h, i, std=out_std),
            })
            self.layers.append(layer)
        theta = cfg["rope_parameters"]["rope_theta"]
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).to(torch.float32) / d))

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        b, s = ids.shape
        nh, nkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
        e, k, eps = cfg["num_experts"], cfg["num_experts_per_tok"], cfg["rms_norm_eps"]
        freqs = torch.arange(s, dtype=torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        x = self.embed[ids]
        aux = x.new_zeros(())
        for layer in self.layers:
            hs = _rms(x, layer["in_norm"], eps)
            q = _rms((hs @ layer["q"].T).view(b, s, nh, d), layer["q_norm"], eps).transpose(1, 2)
            kk = _rms((hs @ layer["k"].T).view(b, s, nkv, d), layer["k_norm"], eps).transpose(1, 2)
            vv = (hs @ layer["v"].T).view(b, s, nkv, d).transpose(1, 2)
            q, kk = _rotate(q, cos, sin), _rotate(kk, cos, sin)
            kk = kk.repeat_interleave(nh // nkv, dim=1)
            vv = vv.repeat_interleave(nh // nkv, dim=1)
            att = F.scaled_dot_product_attention(q, kk, vv, is_causal=True)
            x = x + att.transpose(1, 2).reshape(b, s, nh * d) @ layer["o"].T
            hs = _rms(x, layer["post_norm"], eps)
            probs = torch.softmax(hs @ layer["gate"].T, dim=-1)
            top_w, top_i = probs.topk(k, dim=-1)
            top_w = top_w / top_w.sum(-1, keepdim=True)
            dense_w = torch.zeros_like(probs).scatter(-1, top_i, top_w)
            gate, up = torch.einsum("bsh,efh->bsef", hs, layer["gate_up"]).chunk(2, dim=-1)
            act = F.silu(gate) * up * dense_w.unsqueeze(-1)
            x = x + torch.einsum("bsei,ehi->bsh", act, layer["down"])
            frac = torch.zeros_like(probs).scatter(-1, top_i, 1.0).mean((0, 1)) / k
            aux = aux + e * (frac * probs.mean((0, 1))).sum()
        return _rms(x, self.norm, eps) @ self.lm_head.T, aux / len(self.layers)


def hf_weights(model: WordsModel) -> dict[str, torch.Tensor]:
    """The model's tensors under Hugging Face Qwen3-MoE names (float32, CPU, contiguous)."""
    out = {"model.embed_tokens.weight": model.embed, "model.norm.weight": model.norm, "lm_head.weight": model.lm_head}
    i_size = model.cfg["moe_intermediate_size"]
    for n, layer in enumerate(model.layers):
        p = f"model.layers.{n}."
        out.update({
            p + "input_layernorm.weight": layer["in_norm"], p + "post_attention_layernorm.weight": layer["post_norm"],
            p + "self_attn.q_proj.weight": layer["q"], p + "self_attn.k_proj.weight": layer["k"],
            p + "self_attn.v_proj.weight": layer["v"], p + "self_attn.o_proj.weight": layer["o"],
            p + "self_attn.q_norm.weight": layer["q_norm"], p + "self_attn.k_norm.weight": layer["k_norm"],
            p + "mlp.gate.weight": layer["gate"],
        })
        for x in range(model.cfg["num_experts"]):
            q = f"{p}mlp.experts.{x}."
            out[q + "gate_proj.weight"] = layer["gate_up"][x, :i_size]
            out[q + "up_proj.weight"] = layer["gate_up"][x, i_size:]
            out[q + "down_proj.weight"] = layer["down"][x]
    return {name: t.detach().clone().contiguous() for name, t in out.items()}


def load_hf_weights(model: WordsModel, weights: dict[str, torch.Tensor]) -> None:
    """Fill ``model`` in place from Hugging Face-named tensors (the inverse of :func:`hf_weights`)."""
    named = hf_weights(model)
    if sorted(named) != sorted(weights):
        raise ValueError(f"tensor names differ: {sorted(set(named) ^ set(weights))[:5]}")
    i_size = model.cfg["moe_intermediate_size"]
    with torch.no_grad():
        for name, param in [("model.embed_tokens.weight", model.embed), ("model.norm.weight", model.norm),
                            ("lm_head.weight", model.lm_head)]:
            param.copy_(weights[name])
        keys = {"input_layernorm": "in_norm", "post_attention_layernorm": "post_norm", "self_attn.q_proj": "q",
                "self_attn.k_proj": "k", "self_attn.v_proj": "v", "self_attn.o_proj": "o",
                "self_attn.q_norm": "q_norm", "self_attn.k_norm": "k_norm", "mlp.gate": "gate"}
        for n, layer in enumerate(model.layers):
            p = f"model.layers.{n}."
            for hf_name, key in keys.items():
                layer[key].copy_(weights[f"{p}{hf_name}.weight"])
            for x in range(model.cfg["num_experts"]):
                q = f"{p}mlp.experts.{x}."
                layer["gate_up"][x, :i_size].copy_(weights[q + "gate_proj.weight"])
                layer["gate_up"][x, i_size:].copy_(weights[q + "up_proj.weight"])
                layer["down"][x].copy_(weights[q + "down_proj.weight"])


def fp16_bytes_sha256(weights: dict[str, torch.Tensor]) -> str:
    """SHA-256 over the sorted names and fp16 bytes of ``weights`` (independent of file layout)."""
    digest = hashlib.sha256()
    for name in sorted(weights):
        digest.update(name.encode())
        digest.update(weights[name].to(torch.float16).contiguous().view(torch.int16).numpy().tobytes())
    return digest.hexdigest()


def train(steps: int, batch: int, seq: int, lr: float, warmup: int, seed: int,
          log_every: int = 100, log: Any = print) -> tuple[WordsModel, list[tuple[int, float]]]:
    """Train from scratch; returns the model and ``(step, mean loss since last log)`` pairs.

    Deterministic for a fixed torch version, thread count and CPU.
    """
    data, _ = load_corpus()
    gen = torch.Generator().manual_seed(seed)
    model = WordsModel(HF_CONFIG, gen)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": other, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.98), eps=1e-8)
    batch_gen = torch.Generator().manual_seed(seed + 1)
    curve: list[tuple[int, float]] = []
    running, count = 0.0, 0
    for step in range(1, steps + 1):
        scale = step / warmup if step <= warmup else 0.1 + 0.9 * 0.5 * (
            1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))
        for group in opt.param_groups:
            group["lr"] = lr * scale
        starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=batch_gen)
        window = data[starts[:, None] + torch.arange(seq + 1)[None, :]]
        logits, aux = model(window[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), window[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        (loss + 0.01 * aux).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        running += loss.item()
        count += 1
        if step % log_every == 0 or step == steps:
            curve.append((step, running / count))
            log(f"step {step}/{steps} loss {running / count:.4f} lr {lr * scale:.2e}")
            running, count = 0.0, 0
    return model, curve


def save(model: WordsModel, out_dir: Path, metadata: dict[str, str]) -> Path:
    """Write ``config.json`` and fp16 ``model.safetensors`` into ``out_dir``; returns the latter."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(HF_CONFIG, indent=2) + "\n")
    weights = {n: t.to(torch.float16) for n, t in sorted(hf_weights(model).items())}
    path = out_dir / "model.safetensors"
    save_file(weights, str(path), metadata=metadata)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--refresh-corpus", action="store_true", help="re-snapshot README.md + docs/*.md first")
    parser.add_argument("--short", action="store_true", help="the 20-step run the slow test checks")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    args = parser.parse_args()
    if args.refresh_corpus:
        CORPUS.write_text(build_corpus(), encoding="utf-8")
    torch.set_num_threads(args.threads)
    hp = dict(SHORT if args.short else FULL)
    if args.steps is not None:
        hp["steps"] = args.steps
    _, corpus_sha = load_corpus()
    start = time.perf_counter()
    model, curve = train(**hp, log_every=1 if args.short else 50)
    elapsed = time.perf_counter() - start
    meta = {"corpus_sha256": corpus_sha, "final_loss": f"{curve[-1][1]:.4f}",
            "hyperparameters": json.dumps(hp, sort_keys=True), "threads": str(args.threads),
            "torch": torch.__version__}
    path = save(model, args.out, meta)
    file_sha = hashlib.sha256(path.read_bytes()).hexdigest()
    print(f"trained {hp['steps']} steps in {elapsed:.0f}s; final loss {curve[-1][1]:.4f}")
    print(f"weights sha256 (fp16 tensors) {fp16_bytes_sha256(hf_weights(model))}")
    print(f"wrote {path} ({path.stat().st_size} bytes, file sha256 {file_sha})")


if __name__ == "__main__":
    main()
