"""The training script of the embedded ``"tiny-words"`` model is deterministic (slow tier).

A short run (``scripts/train_embedded.py --short``: 20 steps of 4 x 64 bytes, ~10 s on one
thread) must give the fp16 tensors whose checksum is stored here, twice in a row: the same
seeds, corpus snapshot, single thread and torch version reproduce the weights bit for bit,
so the full run regenerates the shipped file.
"""

from __future__ import annotations

import pytest
import torch

from test_embedded_words import training_script

pytestmark = pytest.mark.slow

#: fp16 tensor checksum of the short run (torch 2.13 CPU, 1 thread).
SHORT_RUN_SHA256 = "e73412b951b26991b96a64f29a9b1e260d0df8fecf43c1321de447491a7d9d50"
SHORT_RUN_LOSSES = [(10, 4.3807), (20, 3.5335)]  # mean loss over steps 1-10, 11-20


def test_short_training_run_reproduces_its_checksum() -> None:
    script = training_script()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        sums = []
        for _ in range(2):
            model, curve = script.train(**script.SHORT, log_every=10, log=lambda line: None)
            sums.append(script.fp16_bytes_sha256(script.hf_weights(model)))
    finally:
        torch.set_num_threads(threads)
    assert [(s, round(loss, 4)) for s, loss in curve] == SHORT_RUN_LOSSES
    assert sums == [SHORT_RUN_SHA256] * 2

