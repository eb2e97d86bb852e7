"""DSpark heads file: loading validates every tensor (errors name it); SpecConfig refuses
misplaced or missing heads; Sequential Temperature Scaling recovers known temperatures."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deepinfer_kit.errors import CheckpointError, ConfigError
from deepinfer_kit.spec.drafters.dspark_heads import DSparkHeads, check_num_draft, load_heads, save_heads
from deepinfer_kit.spec.records import SpecConfig
from deepinfer_kit.spec.drafters.sts import expected_calibration_error, fit_sts, survival

V, H, R, G = 11, 6, 3, 4


def _heads(layers: int = 1) -> DSparkHeads:
    g = torch.Generator().manual_seed(0)
    return DSparkHeads(torch.randn(G, H, H, generator=g), torch.randn(G, H, generator=g),
                       torch.randn(V, R, generator=g), torch.randn(R, V, generator=g),
                       torch.randn(H + R, generator=g), torch.randn(1, generator=g),
                       torch.full((G,), 1.5), layers)


def _load(path: Path) -> DSparkHeads:
    return load_heads(path, vocab_size=V, hidden_size=H, num_layers=2)


def test_a_saved_file_loads_back_identical(tmp_path: Path) -> None:
    heads = _heads()
    save_heads(heads, tmp_path / "h.safetensors")
    back = _load(tmp_path / "h.safetensors")
    assert back.backbone_layers == 1 and back.num_positions == G
    for name, t in heads.tensors().items():
        assert torch.equal(back.tensors()[name], t), name


def _mutated(tmp_path: Path, name: str, value: torch.Tensor | None) -> Path:
    from safetensors.torch import save_file

    tensors = {k: v.contiguous() for k, v in _heads().tensors().items()}
    if value is None:
        del tensors[name]
    else:
        tensors[name] = value
    path = tmp_path / "bad.safetensors"
    save_file(tensors, str(path), metadata={"format": "deepinfer-kit-dspark-heads/1",
                                            "backbone_layers": "1"})
    return path


@pytest.mark.parametrize("name, value, message", [
    ("markov.w2", None, "missing tensor 'markov.w2'"),
    ("markov.w2", torch.zeros(R, V + 1), "tensor 'markov.w2' has shape [3, 12], expected [3, 11]"),
    ("parallel.bias", torch.zeros(G, H + 1), "tensor 'parallel.bias' has shape"),
    ("confidence.weight", torch.zeros(H), "tensor 'confidence.weight' has shape [6], expected [9]"),
    ("sts.temperature", torch.zeros(G), "'sts.temperature' must be > 0"),
    ("sts.temperature", torch.zeros(G + 1), "tensor 'sts.temperature' has shape [5]"),
    ("markov.w1", torch.full((V, R), float("nan")), "tensor 'markov.w1' is not finite"),
    ("extra.tensor", torch.zeros(1), "unexpected tensor 'extra.tensor'"),
])
def test_a_bad_tensor_is_named(tmp_path: Path, name: str, value: torch.Tensor | None,
                               message: str) -> None:
    with pytest.raises(CheckpointError, match=message.replace("[", r"\[").replace("]", r"\]")):
        _load(_mutated(tmp_path, name, value))


def test_bad_files_and_metadata(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no such file"):
        _load(tmp_path / "absent.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="cannot read DSpark heads"):
        _load(tmp_path / "junk.safetensors")
    save_heads(_heads(layers=3), tmp_path / "deep.safetensors")
    with pytest.raises(CheckpointError, match=r"backbone_layers must be an int in \[1, 2\].*'3'"):
        _load(tmp_path / "deep.safetensors")
    with pytest.raises(CheckpointError, match=r"tensor .markov.w1. has shape \[11, 3\], expected \[12, 3\]"):
        load_heads(tmp_path / "deep.safetensors", vocab_size=V + 1, hidden_size=H, num_layers=4)
    with pytest.raises(ConfigError, match=r"num_draft must be <= 4 .*got 5"):
        check_num_draft(_heads(), 5)


def test_spec_config_requires_heads_only_for_dspark() -> None:
    with pytest.raises(ConfigError, match="dspark_heads must name a heads file.*None"):
        SpecConfig(drafter="dspark")
    with pytest.raises(ConfigError, match="dspark_heads is read only by drafter='dspark'"):
        SpecConfig(drafter="ngram", dspark_heads="x.safetensors")
    assert SpecConfig.coerce({"drafter": "dspark", "dspark_heads": "tiny-words"}) is not None


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sts_recovers_the_temperatures_of_miscalibrated_confidences(seed: int) -> None:
    """Synthetic drafts whose true conditional acceptance is σ(logit / T_k): the raw
    survival is miscalibrated; the fit finds each T_k within 10% and brings the ECE down."""
    g = torch.Generator().manual_seed(seed)
    true_t = torch.tensor([0.5, 2.0, 1.0, 3.0])
    n = 40_000
    logits = torch.randn(n, 4, generator=g) * 2 + 1
    cond = torch.sigmoid(logits / true_t)
    events = torch.cumprod((torch.rand(n, 4, generator=g) < cond).float(), dim=1)
    assert torch.allclose(fit_sts(logits, events, objective="nll"), true_t, rtol=0.1)
    fitted = fit_sts(logits, events)  # the lowest calibration error, as the paper fits
    assert torch.allclose(fitted, true_t, rtol=0.35), fitted
    for k in range(4):
        raw = expected_calibration_error(survival(logits, torch.ones(4))[:, k], events[:, k])
        cal = expected_calibration_error(survival(logits, fitted)[:, k], events[:, k])
        assert cal < 0.02, (k, cal)
        if k != 2:  # T = 1 there: already calibrated given the previous positions
            assert cal < raw, (k, raw, cal)


def test_sts_rejects_bad_shapes_and_ece_is_zero_when_calibrated() -> None:
    with pytest.raises(ValueError, match="fit_sts needs equal"):
        fit_sts(torch.zeros(3, 2), torch.zeros(3, 3))
    with pytest.raises(ValueError, match="objective"):
        fit_sts(torch.zeros(3, 2), torch.zeros(3, 2), objective="brier")
    soft = torch.tensor([0.2, 0.4, 0.6, 0.8])  # expected values: each bin's mean matches
    assert expected_calibration_error(soft, soft) == 0.0
    p = torch.tensor([0.0, 1.0, 0.0, 1.0])
    assert expected_calibration_error(p, p) == 0.0
    assert expected_calibration_error(torch.full((4,), 0.5), torch.tensor([1.0, 1, 1, 1])) == 0.5


def test_greedy_temperatures_are_optional_and_used_for_greedy_rows(tmp_path: Path) -> None:
    from deepinfer_kit.spec.drafters.dspark_heads import DSparkHeads, save_heads

    g = torch.Generator().manual_seed(0)
    heads = DSparkHeads(torch.zeros(2, 3, 3), torch.zeros(2, 3), torch.randn(5, 2, generator=g),
                        torch.zeros(2, 5), torch.randn(5, generator=g), torch.zeros(1),
                        torch.tensor([1.0, 2.0]), 1, torch.tensor([0.5, 4.0]))
    save_heads(heads, tmp_path / "h.safetensors")
    loaded = load_heads(tmp_path / "h.safetensors", vocab_size=5, hidden_size=3, num_layers=2)
    assert loaded.temperature_greedy is not None
    assert torch.equal(loaded.temperature_greedy, torch.tensor([0.5, 4.0]))
    state, e = torch.randn(2, 3, generator=g), torch.randn(2, 2, generator=g)
    raw = loaded.confidence_logit(state, e)
    mixed = loaded.confidence(state, e, 1, torch.tensor([True, False]))
    assert torch.allclose(mixed, torch.sigmoid(raw / torch.tensor([4.0, 2.0])))
    assert torch.allclose(loaded.confidence(state, e, 1), torch.sigmoid(raw / 2.0))
    bad = {**heads.tensors(), "sts.temperature_greedy": torch.tensor([0.5, 0.0])}
    from safetensors.torch import save_file
    save_file(bad, str(tmp_path / "bad.safetensors"),
              metadata={"format": "deepinfer-kit-dspark-heads/1", "backbone_layers": "1"})
    with pytest.raises(CheckpointError, match="'sts.temperature_greedy' must be > 0"):
        load_heads(tmp_path / "bad.safetensors", vocab_size=5, hidden_size=3, num_layers=2)
