"""LayerTruncatedLM (self-speculation's draft): the target's first k layers and its LM
head, sharing the target's parameters."""

from __future__ import annotations

import attrs
import pytest
import torch
from paged_driver import PagedDriver, one_thread  # noqa: F401 (fixture)

from deepinfer_kit.engine.runner.assemble import build_tiny_model, moe_layer_factory
from deepinfer_kit.errors import ConfigError
from deepinfer_kit.models.loader import build_model
from deepinfer_kit.models.tiny import tiny_hf_weights
from deepinfer_kit.models.truncated import LayerTruncatedLM

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [200, 3, 44, 17], [1, 2, 1, 2, 1, 2, 1, 2, 1, 2]]


def _logits(model: object) -> list[torch.Tensor]:
    driver = PagedDriver(model, block_size=4)  # type: ignore[arg-type]
    seqs = [driver.new_seq(p, 0) for p in PROMPTS]
    return list(driver.forward([(s, len(p)) for s, p in zip(seqs, PROMPTS)], all_logits=True))


def test_one_layer_view_equals_a_one_layer_model_of_the_same_weights() -> None:
    """Oracle: a model built with num_layers=1 from the first layer's tensors (and the
    embeddings, norm, head) gives the same logits as the view of the 2-layer model."""
    full = build_tiny_model(seed=3)
    view = LayerTruncatedLM(full.model, 1)
    assert view.config.num_layers == 1 and view.config.sparse_layers == (0,)
    weights = {k: v for k, v in tiny_hf_weights(full.config, seed=3).items()
               if not k.startswith("model.layers.1.")}
    small = build_model(attrs.evolve(full.config, num_layers=1, sparse_layers=(0,)), weights,
                        sparse_mlp_factory=moe_layer_factory("ref"))
    for a, b in zip(_logits(view), _logits(small)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(_logits(view)[0], _logits(full.model)[0], atol=1e-3)


def test_full_depth_view_equals_the_model_and_shares_its_weights() -> None:
    full = build_tiny_model(seed=4)
    view = LayerTruncatedLM(full.model, full.config.num_layers)
    for a, b in zip(_logits(view), _logits(full.model)):
        assert torch.equal(a, b)
    with torch.no_grad():  # a weight update of the model is seen by the view: no copy
        full.model.norm.weight.mul_(2.0)
    assert view.model is full.model
    assert not torch.equal(_logits(view)[0], a)


@pytest.mark.parametrize("k", [0, 3, True, 1.0])
def test_bad_layer_counts_name_the_field(k: object) -> None:
    full = build_tiny_model(seed=0)
    with pytest.raises(ConfigError, match=r"speculative.draft_layers must be an int in \[1, 2\]"):
        LayerTruncatedLM(full.model, k)  # type: ignore[arg-type]
