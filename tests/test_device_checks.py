"""The device-check scripts fit their budget and share what they can: step limits sum to at
most 60% of a 5-minute run, every step runs ``$PYTHON`` (default python3), one Triton cache
serves every step, and the scripts parse."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
BUDGET_S, HEADROOM = 300, 0.4


@pytest.mark.parametrize("name", ["device_check_correctness.sh", "device_check_speed.sh"])
def test_step_limits_leave_forty_percent_of_five_minutes(name: str) -> None:
    text = (SCRIPTS / name).read_text()
    steps = re.findall(r"^step (\w+) (\d+) (\S+)", text, flags=re.M)
    assert len(steps) >= 2
    assert sum(int(limit) for _, limit, _ in steps) <= BUDGET_S * (1 - HEADROOM), steps
    assert all(cmd == '"$PYTHON"' for _, _, cmd in steps), steps
    assert "How the limits were sized" in text
    assert not re.search(r"(^|[\s;(])python\s", re.sub(r"#.*", "", text)), "a bare `python` call"


def test_the_library_shares_one_triton_cache_and_picks_the_interpreter() -> None:
    lib = (SCRIPTS / "device_check_lib.sh").read_text()
    assert 'export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-' in lib
    assert "PYTHON=${PYTHON:-python3}" in lib and "unset TRITON_INTERPRET" in lib


@pytest.mark.parametrize("name", ["device_check_correctness.sh", "device_check_speed.sh",
                                  "device_check_lib.sh", "device_checks.sh", "setup.sh",
                                  "test_other_peers.sh"])
def test_scripts_parse(name: str) -> None:
    subprocess.run(["bash", "-n", str(SCRIPTS / name)], check=True)
