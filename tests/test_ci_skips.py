"""Under CI=true a skip of something CI installs fails, naming it; a GPU skip stays a skip;
outside CI both are skips. Runs the real conftest on a small test file in a subprocess."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

CASES = '''
import pytest

def test_gpu():
    pytest.skip("needs a CUDA GPU")

def test_peer():
    pytest.importorskip("no_such_peer_engine", reason="the peer engine is not importable here")

def test_runs():
    pass
'''

MODULE_SKIP = '''
import pytest
pytest.importorskip("no_such_peer_engine", reason="module-level: the peer is missing")

def test_never_collected():
    pass
'''


def _run(tmp_path: Path, ci: str | None) -> str:
    for name in ("conftest.py", "ci_skips.py", "tiers.py"):
        shutil.copy(HERE / name, tmp_path / name)
    (tmp_path / "test_cases.py").write_text(CASES)
    (tmp_path / "test_module_skip.py").write_text(MODULE_SKIP)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci is not None:
        env["CI"] = ci
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider", "-p", "no:xdist",
         "-o", "addopts=", "--rootdir", str(tmp_path), str(tmp_path)],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120,
    )
    return done.stdout


def test_outside_ci_both_skips_stay_skips(tmp_path: Path) -> None:
    out = _run(tmp_path, None)
    assert "1 passed, 3 skipped" in out, out


@pytest.mark.parametrize("ci", ["true", "1"])
def test_under_ci_a_missing_peer_fails_naming_it_and_the_gpu_skip_stays(tmp_path: Path, ci: str) -> None:
    out = _run(tmp_path, ci)
    assert "2 failed, 1 passed, 1 skipped" in out, out
    assert "FAILED test_cases.py::test_peer" in out and "the peer engine is not importable here" in out
    assert "FAILED test_module_skip.py::not_skipped_in_ci" in out and "module-level: the peer is missing" in out
    assert "SKIPPED" in out and "needs a CUDA GPU" in out
