"""Test-wide setup: Triton kernels run under the interpreter except in a GPU run of the
``cuda`` tier.

The default tier builds its tensors on the CPU (it is the tier CI runs), so its Triton
kernels must run under the interpreter on every machine, a GPU one included: a compiled
kernel cannot read CPU tensors. ``pytest -m cuda`` on a GPU machine leaves the interpreter
off, so its tests run the compiled kernels on CUDA tensors against their torch references.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from ci_skips import refused_skip, strict_skips  # noqa: E402
from tiers import selects_cuda_tier  # noqa: E402

# Tests run tiny ops, where one intra-op thread is fastest; under pytest-xdist every worker
# takes its own core instead of oversubscribing them.
torch.set_num_threads(1)


def pytest_configure(config: pytest.Config) -> None:
    # Before any test module imports a kernel module: @triton.jit reads it at decoration.
    if not (torch.cuda.is_available() and selects_cuda_tier(config.option.markexpr or "")):
        os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def _refused(report: pytest.TestReport | pytest.CollectReport) -> str | None:
    """Under ``CI=true``, the failure message of a skip CI does not accept (else ``None``)."""
    if not (report.skipped and strict_skips()):
        return None
    longrepr = report.longrepr
    return refused_skip(str(longrepr[2] if isinstance(longrepr, tuple) else longrepr))


class _RefusedSkip(pytest.Item):
    """Stands for a module CI may not skip: it fails with the skip's reason, and the rest
    of the session runs (a collection error would stop it)."""

    def __init__(self, *, message: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.message = message

    def runtest(self) -> None:
        pytest.fail(self.message, pytrace=False)

    def reportinfo(self) -> tuple[Path, int, str]:
        return self.path, 0, self.name


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    message = _refused(report)
    if message is not None:
        report.outcome, report.longrepr = "failed", message


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    message = _refused(report)
    if message is not None:
        report.outcome, report.longrepr = "passed", None
        report.result = [_RefusedSkip.from_parent(collector, name="not_skipped_in_ci", message=message)]
