"""Train the DSpark heads of the embedded "tiny-words" model: distil the parallel + Markov heads
and the confidence head from the target's own greedy outputs, then calibrate them with
Sequential Temperature Scaling on held-out continuations, greedy and sampled.

    PYTHONPATH=src python scripts/train_dspark.py            # full run: writes the shipped heads
    PYTHONPATH=src python scripts/train_dspark.py --short --out /tmp/heads.safetensors

Data: prompts are seeded windows of the frozen corpus (``scripts/embedded_corpus.txt``) and
random bytes, 4..40 long,; the
target continues each greedily through the engine. One forward of the target over each whole
sequence gives, at every position, the target's distribution (the distillation target) and the
backbone's hidden state (the target's first ``k`` layers, final-normed: what the drafter sees).

Training (float32, CPU, one thread, seeded): at a position ``t`` the heads see ``h_t`` and, for
draft ``k``, the true previous token ``s[t+k-1]``; the draft distribution is pulled to the
target's at ``t+k-1`` (soft cross-entropy), the confidence head to the acceptance probability
of a sampled draft, ``c* = 1 − ½‖p_draft − p_target‖₁`` (the DSpark paper's eq. 8; binary
cross-entropy with that soft label, on detached inputs, so it does not bend the drafts).

Calibration (Sequential Temperature Scaling, one temperature per position, left to right, each
for the lowest expected calibration error of the survival: :func:`deepinfer_kit.spec.drafters.sts.fit_sts`),
on held-out text, half fitted and half reported, once per decoding mode:

- sampled: continuations sampled at temperature 1; the target of position ``k`` is the expected
  survival ``prod_{i<=k} c*_i`` along the text (teacher-forced, as in training) — what strict
  rejection sampling keeps on average; these temperatures are the file's ``sts.temperature``.
- greedy: greedy continuations; the heads draft exactly as the engine's greedy rounds do (their
  own argmax drafts feed the Markov head; each round starts after the previous one's accepted
  drafts) and the target is the event that drafts ``0..k`` all equal the target's argmax; these
  are ``sts.temperature_greedy``.

Prints the ECE of the survival per position before and after, for both modes, and the mean
accepted length per greedy block.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from deepinfer_kit import SamplingParams, build_engine
from deepinfer_kit.cache.kv_cache import PagedKVCache
from deepinfer_kit.engine.runner.assemble import load_model
from deepinfer_kit.models.packing import pack_inputs, unpack_inputs
from deepinfer_kit.models.embedded import TINY_WORDS, embedded_checkpoint
from deepinfer_kit.models.truncated import LayerTruncatedLM
from deepinfer_kit.spec.drafters.dspark_heads import DSparkHeads, load_heads, save_heads
from deepinfer_kit.spec.drafters.sts import expected_calibration_error, fit_sts, survival

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "scripts" / "embedded_corpus.txt"
EMBEDDED_HEADS = ROOT / "src" / "deepinfer_kit" / "models" / "embedded" / "dspark" / f"{TINY_WORDS}.safetensors"

FULL = {"train_prompts": 384, "held_prompts": 192, "length": 128, "steps": 1500,
        "batch": 512, "lr": 3e-3, "gamma": 4, "layers": 2, "rank": 32, "seed": 0}
SHORT = {**FULL, "train_prompts": 24, "held_prompts": 16, "length": 80, "steps": 60}


def prompts(count: int, rng: random.Random) -> list[list[int]]:
    """``count`` seeded prompts of 4..40 bytes: corpus windows, every fourth random bytes
    (what the drafter meets: short and long contexts, text and noise)."""
    data = CORPUS.read_bytes()
    out = []
    for i in range(count):
        n = rng.randint(4, 40)
        if i % 4 == 3:
            out.append([rng.randrange(256) for _ in range(n)])
        else:
            start = rng.randrange(len(data) - n)
            out.append(list(data[start:start + n]))
    return out


def continue_text(prompt_ids: list[list[int]], length: int, *, temperature: float = 0.0,
                  seed: int = 0) -> list[list[int]]:
    """The target's continuation of each prompt to ``length`` tokens through the engine
    (greedy, or sampled at ``temperature`` with seeds ``seed + i``): prompt + output."""
    engine = build_engine(model=TINY_WORDS, max_model_len=256, num_blocks=2048, block_size=16)
    for i, p in enumerate(prompt_ids):
        params = SamplingParams(temperature=temperature, max_tokens=length - len(p),
                                ignore_eos=True, seed=seed + i if temperature else None)
        engine.add_request(f"p{i}", p, params)
    outs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = list(o.outputs[0].token_ids)
    return [p + outs[f"p{i}"] for i, p in enumerate(prompt_ids)]


def features(seqs: list[list[int]], layers: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Target logits ``[S, L, V]`` and backbone hidden states ``[S, L, H]`` at every position
    of the equal-length sequences ``seqs`` (the library's own forward, float32), and the
    target's LM head ``[V, H]``."""
    loaded = load_model(embedded_checkpoint(TINY_WORDS), dtype=torch.float32,
                        attention_impl="ref", moe_impl="ref")
    backbone = LayerTruncatedLM(loaded.model, layers)  # type: ignore[arg-type]
    cfg, length, bs = loaded.config, len(seqs[0]), 16
    per_seq = -(-length // bs)
    logits, hidden = [], []
    for lo in range(0, len(seqs), 32):
        chunk = seqs[lo:lo + 32]
        kv = PagedKVCache(cfg.num_layers, per_seq * len(chunk), bs, cfg.num_kv_heads, cfg.head_dim,
                          dtype=torch.float32, device=torch.device("cpu"), impl="ref")
        tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(chunk))]
        host, layout = pack_inputs([t for s in chunk for t in s],
                                   [p for _ in chunk for p in range(length)],
                                   [length] * len(chunk), [length] * len(chunk), tables,
                                   list(range(length * len(chunk))), block_size=bs,
                                   pin_memory=False)
        batch = unpack_inputs(host, layout)
        logits.append(loaded.model(batch, kv).view(len(chunk), length, -1).clone())
        hidden.append(backbone.hidden(batch, kv).float().view(len(chunk), length, -1).clone())
    lm = loaded.model.lm_head.weight.detach().float().clone()  # type: ignore[union-attr]
    return torch.cat(logits), torch.cat(hidden), lm


def init_heads(cfg: dict[str, Any], hidden: int, vocab: int, gen: torch.Generator) -> DSparkHeads:
    """Small random parallel heads and Markov embedding; zero projections (start = backbone)."""
    g, r = cfg["gamma"], cfg["rank"]
    return DSparkHeads(
        parallel_weight=torch.randn(g, hidden, hidden, generator=gen) * hidden ** -0.5,
        parallel_bias=torch.zeros(g, hidden), w1=torch.randn(vocab, r, generator=gen) * 0.1,
        w2=torch.zeros(r, vocab), conf_weight=torch.zeros(hidden + r), conf_bias=torch.zeros(1),
        temperature=torch.ones(g), backbone_layers=cfg["layers"],
    )


def windows(seqs: torch.Tensor, gamma: int, first: torch.Tensor) -> torch.Tensor:
    """``[M, 2]`` (sequence, t) pairs with ``first[sequence] <= t`` and ``t + gamma`` inside."""
    num, length = seqs.shape
    pairs = torch.cartesian_prod(torch.arange(num), torch.arange(length - gamma))
    return pairs[pairs[:, 1] >= first[pairs[:, 0]]]


def head_outputs(heads: DSparkHeads, lm: torch.Tensor, h: torch.Tensor, prev: torch.Tensor,
                 k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft logits ``[M, V]`` and raw confidence logits ``[M]`` of position ``k``."""
    states = heads.position_states(h)[:, k]
    e, bias = heads.markov(prev)
    return states @ lm.T + bias, heads.confidence_logit(states.detach(), e.detach())


def train(heads: DSparkHeads, lm: torch.Tensor, seqs: torch.Tensor, logits: torch.Tensor,
          hidden: torch.Tensor, cfg: dict[str, Any], gen: torch.Generator) -> None:
    """Adam over the heads' tensors (temperatures stay 1), in place."""
    params = [heads.parallel_weight, heads.parallel_bias, heads.w1, heads.w2, heads.conf_weight,
              heads.conf_bias]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=cfg["lr"])
    pairs = windows(seqs, cfg["gamma"], torch.zeros(len(seqs), dtype=torch.int64))
    start = time.time()
    for step in range(cfg["steps"]):
        pick = pairs[torch.randint(len(pairs), (cfg["batch"],), generator=gen)]
        n, t = pick[:, 0], pick[:, 1]
        kd = bce = torch.zeros(())
        for k in range(cfg["gamma"]):
            target = logits[n, t + k]
            draft, conf = head_outputs(heads, lm, hidden[n, t], seqs[n, t + k], k)
            kd = kd + torch.sum(-F.softmax(target, -1) * F.log_softmax(draft, -1), -1).mean()
            bce = bce + F.binary_cross_entropy_with_logits(conf, acceptance(draft.detach(), target))
        opt.zero_grad()
        (kd + bce).backward()
        opt.step()
        if step % max(cfg["steps"] // 10, 1) == 0 or step == cfg["steps"] - 1:
            print(f"step {step:5d}  distil {kd.item() / cfg['gamma']:.4f}  "
                  f"conf bce {bce.item() / cfg['gamma']:.4f}  {time.time() - start:.0f}s", flush=True)
    for p in params:
        p.requires_grad_(False)


def acceptance(draft: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``[M]`` the chance strict rejection sampling keeps a draft drawn from ``softmax(draft)``
    against ``softmax(target)`` (``[M, V]`` logits each): ``1 − ½‖p_d − p_t‖₁`` (eq. 8)."""
    gap = (F.softmax(draft.float(), -1) - F.softmax(target.float(), -1)).abs().sum(-1)
    return (1.0 - 0.5 * gap).clamp(0.0, 1.0)


def soft_blocks(heads: DSparkHeads, lm: torch.Tensor, seqs: torch.Tensor, logits: torch.Tensor,
                hidden: torch.Tensor, first: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampled mode: a block at every position ``t >= first`` of each sequence, teacher-forced
    (the text's tokens feed the Markov head, as in training); returns raw confidence logits and
    the expected survivals ``prod_{i<=k} c*_i`` ``[M, γ]``."""
    gamma = heads.num_positions
    pairs = windows(seqs, gamma, first)
    n, t = pairs[:, 0], pairs[:, 1]
    raw, accept = [], []
    with torch.no_grad():
        for k in range(gamma):
            draft, conf = head_outputs(heads, lm, hidden[n, t], seqs[n, t + k], k)
            raw.append(conf)
            accept.append(acceptance(draft, logits[n, t + k]))
    return torch.stack(raw, 1), torch.cumprod(torch.stack(accept, 1).double(), 1).float()


def report(mode: str, heads_t: torch.Tensor, raw: torch.Tensor, target: torch.Tensor) -> None:
    """Print, per position, the temperature, the mean target, and the survival's mean and
    ECE before (T = 1) and after calibration."""
    before = survival(raw, torch.ones(len(heads_t)))
    after = survival(raw, heads_t)
    for k in range(len(heads_t)):
        y = target[:, k]
        print(f"{mode} position {k + 1}: T={heads_t[k]:.3f}  acceptance {y.mean():.3f}  "
              f"mean survival before {before[:, k].mean():.3f} after {after[:, k].mean():.3f}  "
              f"ECE before {expected_calibration_error(before[:, k], y):.4f} "
              f"after {expected_calibration_error(after[:, k], y):.4f}")


def draft_blocks(heads: DSparkHeads, lm: torch.Tensor, seqs: torch.Tensor, logits: torch.Tensor,
                 hidden: torch.Tensor, first: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft as the engine does, round after round, along each held-out greedy continuation:
    the first block after the prompt's last token, each next one after the previous block's
    accepted drafts and the target's token. Own argmax drafts feed the Markov head. (Rounds
    start more often where a draft was just rejected than positions do uniformly, so blocks
    sampled uniformly would calibrate too high.) Returns raw confidence logits and survival
    events ``[M, γ]``."""
    gamma, length = heads.num_positions, seqs.shape[1]
    raw, events = [], []
    t = first.clone()
    live = t + gamma < length
    with torch.no_grad():
        while bool(live.any()):
            n, tt = torch.nonzero(live).squeeze(1), t[live]
            prev, alive = seqs[n, tt], torch.ones(len(n), dtype=torch.bool)
            block_raw, block_ev = [], []
            for k in range(gamma):
                draft, conf = head_outputs(heads, lm, hidden[n, tt], prev, k)
                tok = draft.argmax(-1)
                alive = alive & (tok == logits[n, tt + k].argmax(-1))
                block_raw.append(conf)
                block_ev.append(alive.clone())
                prev = tok
            ev = torch.stack(block_ev, 1)
            raw.append(torch.stack(block_raw, 1))
            events.append(ev.float())
            t[n] = tt + ev.sum(1) + 1
            live = t + gamma < length
    return torch.cat(raw), torch.cat(events)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--short", action="store_true", help="a quick run (tests)")
    parser.add_argument("--out", type=Path, default=EMBEDDED_HEADS)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--heads", type=Path, default=None,
                        help="calibrate these trained heads again instead of training new ones")
    args = parser.parse_args()
    cfg = SHORT if args.short else FULL
    torch.set_num_threads(args.threads)
    rng, gen = random.Random(cfg["seed"]), torch.Generator().manual_seed(cfg["seed"])
    began = time.time()
    train_p = prompts(cfg["train_prompts"], rng)
    held_p = prompts(cfg["held_prompts"], rng)
    seqs = continue_text(train_p + held_p, cfg["length"])
    sampled = continue_text(held_p, cfg["length"], temperature=1.0, seed=cfg["seed"])
    logits, hidden, lm = features(seqs + sampled, cfg["layers"])
    tokens = torch.tensor(seqs + sampled)
    cut, held = cfg["train_prompts"], cfg["held_prompts"]
    print(f"data: {len(tokens)} sequences of {tokens.shape[1]} tokens ({time.time() - began:.0f}s)")
    if args.heads is not None:
        heads = load_heads(args.heads, vocab_size=logits.shape[-1], hidden_size=hidden.shape[-1],
                           num_layers=4)
    else:
        heads = init_heads(cfg, hidden.shape[-1], logits.shape[-1], gen)
        train(heads, lm, tokens[:cut], logits[:cut], hidden[:cut], cfg, gen)
    first = torch.tensor([len(p) - 1 for p in held_p])
    half = held // 2  # calibrate on half the held-out sequences, report on the rest
    spans = {"fit": (0, half), "report": (half, held)}

    def part(offset: int, lo: int, hi: int) -> tuple[torch.Tensor, ...]:
        a, b = offset + lo, offset + hi
        return tokens[a:b], logits[a:b], hidden[a:b], first[lo:hi]

    greedy = {name: draft_blocks(heads, lm, *part(cut, *span)) for name, span in spans.items()}
    soft = {name: soft_blocks(heads, lm, *part(cut + held, *span)) for name, span in spans.items()}
    print(f"held-out: calibrating on {len(greedy['fit'][0])} greedy drafting rounds and "
          f"{len(soft['fit'][0])} sampled blocks, reporting on {len(greedy['report'][0])} and "
          f"{len(soft['report'][0])}")
    heads.temperature = fit_sts(*soft["fit"])
    heads.temperature_greedy = fit_sts(*greedy["fit"])
    report("sampled", heads.temperature, *soft["report"])
    report("greedy", heads.temperature_greedy, *greedy["report"])
    print(f"mean accepted drafts per block of {heads.num_positions}: "
          f"{greedy['report'][1].sum(1).mean():.3f}")
    save_heads(heads, args.out, {"target": TINY_WORDS, "seed": str(cfg["seed"])})
    args.out.chmod(0o644)
    print(f"wrote {args.out} ({time.time() - began:.0f}s)")


if __name__ == "__main__":
    main()
