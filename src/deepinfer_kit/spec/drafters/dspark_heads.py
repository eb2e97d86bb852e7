"""DSparkHeads: the DSpark drafter's light heads above a backbone hidden state — parallel
position heads, the low-rank Markov head, the confidence head and the STS temperatures — with
their math (shared by the drafter and the training script) and their safetensors file.

Shapes: ``R`` rows, ``γ`` head positions, ``H`` backbone hidden size, ``V`` vocabulary,
``r`` Markov rank.

- Parallel head (one residual MLP per position): ``h_k = h + silu(A_k h + b_k)``, base logits
  ``z_k = LMhead(h_k)`` through the target's (frozen) LM head — γ states from one hidden state.
- Markov head: ``e_k = W1[x_{k-1}]`` (``[r]``), logits ``z_k + e_k W2`` — the prefix-dependent
  bias, applied left to right as drafts are drawn.
- Confidence head: ``c_k = σ((wᵀ[h_k; e_k] + b) / T_k)``, ``T_k`` the Sequential Temperature
  Scaling temperature of position ``k`` (1 before calibration). The head is trained on the
  acceptance probability of a sampled draft, ``1 − ½‖p_draft − p_target‖₁`` (the DSpark
  paper's eq. 8); a greedy draft is kept on another event (its argmax equals the target's),
  so a file may carry a second set of temperatures, ``T^greedy``, calibrated on that event
  and used for greedy requests.
"""

from __future__ import annotations

import os
from pathlib import Path

import attrs
import torch
import torch.nn.functional as F

from deepinfer_kit.errors import CheckpointError, ConfigError

__all__ = ["DSparkHeads", "load_heads", "save_heads", "check_num_draft", "heads_positions", "HEADS_FORMAT", "TENSOR_NAMES"]

HEADS_FORMAT = "deepinfer-kit-dspark-heads/1"
TENSOR_NAMES = ("parallel.weight", "parallel.bias", "markov.w1", "markov.w2",
                "confidence.weight", "confidence.bias", "sts.temperature")
OPTIONAL_NAMES = ("sts.temperature_greedy",)


@attrs.define(slots=True, eq=False)
class DSparkHeads:
    """The heads' tensors (float32, one device) and the backbone depth they were trained on.

    Attributes:
        parallel_weight: ``[γ, H, H]`` ``A_k``.
        parallel_bias: ``[γ, H]`` ``b_k``.
        w1: ``[V, r]`` Markov embedding of the previous token.
        w2: ``[r, V]`` Markov projection to a logit bias.
        conf_weight: ``[H + r]`` ``w`` of the confidence head.
        conf_bias: ``[1]`` its bias.
        temperature: ``[γ]`` STS temperatures (``> 0``) of sampled requests.
        backbone_layers: ``k``, the target's first layers the heads read.
        temperature_greedy: ``[γ]`` STS temperatures of greedy requests, or ``None`` (they
            use ``temperature`` too).
    """

    parallel_weight: torch.Tensor
    parallel_bias: torch.Tensor
    w1: torch.Tensor
    w2: torch.Tensor
    conf_weight: torch.Tensor
    conf_bias: torch.Tensor
    temperature: torch.Tensor
    backbone_layers: int
    temperature_greedy: torch.Tensor | None = None

    @property
    def num_positions(self) -> int:
        """``γ``: the most drafts per round the heads can make."""
        return int(self.parallel_weight.shape[0])

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors under their file names (:data:`TENSOR_NAMES`)."""
        values = (self.parallel_weight, self.parallel_bias, self.w1, self.w2, self.conf_weight,
                  self.conf_bias, self.temperature)
        out = dict(zip(TENSOR_NAMES, values))
        if self.temperature_greedy is not None:
            out["sts.temperature_greedy"] = self.temperature_greedy
        return out

    def position_states(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[R, H]`` backbone states -> ``[R, γ, H]`` per-position states ``h_k``."""
        h = hidden.float()
        mixed = torch.einsum("rh,gkh->rgk", h, self.parallel_weight) + self.parallel_bias
        return h.unsqueeze(1) + F.silu(mixed)

    def markov(self, previous: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[R]`` int64 previous tokens -> ``(e [R, r], bias [R, V])``."""
        e = self.w1[previous]
        return e, e @ self.w2

    def confidence_logit(self, state: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """``[R, H]`` ``h_k`` and ``[R, r]`` ``e_k`` -> ``[R]`` raw (uncalibrated) logits."""
        return torch.cat((state, e), dim=-1) @ self.conf_weight + self.conf_bias

    def confidence(self, state: torch.Tensor, e: torch.Tensor, k: int,
                   greedy: torch.Tensor | None = None) -> torch.Tensor:
        """Calibrated ``c_k`` ``[R]`` of position ``k`` (0-based): ``σ(logit / T_k)``, with
        ``T^greedy_k`` for the rows where ``greedy`` (``[R]`` bool, same device) is set
        when the heads have greedy temperatures."""
        t = self.temperature[k]
        if greedy is not None and self.temperature_greedy is not None:
            t = torch.where(greedy, self.temperature_greedy[k], t)
        return torch.sigmoid(self.confidence_logit(state, e) / t)

    def to(self, device: torch.device) -> DSparkHeads:
        """A copy on ``device`` (float32)."""
        moved = {k: v.to(device=device, dtype=torch.float32) for k, v in self.tensors().items()}
        return _from_tensors(moved, self.backbone_layers)


def _from_tensors(t: dict[str, torch.Tensor], layers: int) -> DSparkHeads:
    return DSparkHeads(t["parallel.weight"], t["parallel.bias"], t["markov.w1"], t["markov.w2"],
                       t["confidence.weight"], t["confidence.bias"], t["sts.temperature"], layers,
                       t.get("sts.temperature_greedy"))


def save_heads(heads: DSparkHeads, path: str | os.PathLike[str],
               extra: dict[str, str] | None = None) -> None:
    """Write ``heads`` to a safetensors file (float32, contiguous), with the format tag,
    ``backbone_layers`` and ``extra`` as string metadata. Overwrites ``path``."""
    from safetensors.torch import save_file

    meta = {"format": HEADS_FORMAT, "backbone_layers": str(heads.backbone_layers), **(extra or {})}
    tensors = {k: v.detach().float().contiguous().cpu() for k, v in heads.tensors().items()}
    save_file(tensors, str(path), metadata=meta)


def load_heads(path: str | os.PathLike[str], *, vocab_size: int, hidden_size: int,
               num_layers: int) -> DSparkHeads:
    """Read and validate a heads file for a target of ``vocab_size`` / ``hidden_size`` /
    ``num_layers``; called once by the drafter builder. Tensors land on the CPU as float32.

    Raises:
        CheckpointError: the file is missing or unreadable, lacks the format tag or a tensor,
            has an unexpected tensor, a tensor of the wrong shape (the message names it and
            both shapes), non-finite values, a temperature ``<= 0``, or a ``backbone_layers``
            outside ``[1, num_layers]``.
    """
    from safetensors import safe_open

    file = Path(path)
    if not file.is_file():
        raise CheckpointError(f"speculative.dspark_heads: no such file {str(file)!r}")
    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except Exception as exc:  # safetensors raises SafetensorError, OSError, ...
        raise CheckpointError(f"cannot read DSpark heads {str(file)!r}: {exc}") from None
    if meta.get("format") != HEADS_FORMAT:
        raise CheckpointError(
            f"DSpark heads {str(file)!r}: metadata format must be {HEADS_FORMAT!r}, "
            f"got {meta.get('format')!r}"
        )
    layers = _layers(meta.get("backbone_layers"), num_layers, file)
    _check_names(tensors, file)
    gamma = tensors["parallel.weight"].shape[0] if tensors["parallel.weight"].dim() == 3 else -1
    rank = tensors["markov.w1"].shape[-1] if tensors["markov.w1"].dim() == 2 else -1
    want = {
        "parallel.weight": (gamma, hidden_size, hidden_size), "parallel.bias": (gamma, hidden_size),
        "markov.w1": (vocab_size, rank), "markov.w2": (rank, vocab_size),
        "confidence.weight": (hidden_size + rank,), "confidence.bias": (1,),
        "sts.temperature": (gamma,),
        **{name: (gamma,) for name in OPTIONAL_NAMES if name in tensors},
    }
    for name, shape in want.items():
        got = tuple(tensors[name].shape)
        if got != shape or min(shape) < 1:
            raise CheckpointError(
                f"DSpark heads {str(file)!r}: tensor {name!r} has shape {list(got)}, expected "
                f"{list(shape)} (γ={gamma}, H={hidden_size}, V={vocab_size}, r={rank})"
            )
        if not bool(torch.isfinite(tensors[name]).all()):
            raise CheckpointError(f"DSpark heads {str(file)!r}: tensor {name!r} is not finite")
    for name in ("sts.temperature", *OPTIONAL_NAMES):
        if name in tensors and not bool((tensors[name] > 0).all()):
            raise CheckpointError(
                f"DSpark heads {str(file)!r}: tensor {name!r} must be > 0, got "
                f"{tensors[name].tolist()}"
            )
    return _from_tensors({k: v.float() for k, v in tensors.items()}, layers)


def heads_positions(path: str | os.PathLike[str]) -> int:
    """``γ`` of a heads file (its ``sts.temperature`` length), read from the file's header
    without loading a tensor; called before any model loads.

    Raises:
        CheckpointError: the file is missing, unreadable or lacks ``sts.temperature``.
    """
    from safetensors import safe_open

    file = Path(path)
    if not file.is_file():
        raise CheckpointError(f"speculative.dspark_heads: no such file {str(file)!r}")
    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            shape = f.get_slice("sts.temperature").get_shape()
    except Exception as exc:  # safetensors raises SafetensorError, OSError, ...
        raise CheckpointError(f"cannot read DSpark heads {str(file)!r}: {exc}") from None
    if len(shape) != 1:
        raise CheckpointError(f"DSpark heads {str(file)!r}: tensor 'sts.temperature' has shape "
                              f"{list(shape)}, expected [γ]")
    return int(shape[0])


def _check_names(tensors: dict[str, torch.Tensor], file: Path) -> None:
    missing = [n for n in TENSOR_NAMES if n not in tensors]
    if missing:
        raise CheckpointError(f"DSpark heads {str(file)!r}: missing tensor {missing[0]!r}")
    extra = sorted(set(tensors) - set(TENSOR_NAMES) - set(OPTIONAL_NAMES))
    if extra:
        raise CheckpointError(f"DSpark heads {str(file)!r}: unexpected tensor {extra[0]!r}")


def _layers(value: str | None, num_layers: int, file: Path) -> int:
    try:
        layers = int(value or "")
    except ValueError:
        layers = 0
    if not 1 <= layers <= num_layers:
        raise CheckpointError(
            f"DSpark heads {str(file)!r}: metadata backbone_layers must be an int in "
            f"[1, {num_layers}] (the target's layers), got {value!r}"
        )
    return layers


def check_num_draft(heads: DSparkHeads, num_draft: int) -> None:
    """Raise ConfigError when ``num_draft`` exceeds the heads' ``γ``."""
    if num_draft > heads.num_positions:
        raise ConfigError(
            f"speculative.num_draft must be <= {heads.num_positions} (the DSpark heads' "
            f"positions), got {num_draft}"
        )
