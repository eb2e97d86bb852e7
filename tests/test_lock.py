"""The lock (requirements/lock.txt) and the peers' pins agree with the project's
requirements and with the adapters' tested-version tables, and setup and CI install
through them."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

from deepinfer_kit.adapters.transformers.scheduler import TESTED_TRANSFORMERS
from deepinfer_kit.adapters.vllm.versions import TESTED_VLLM

ROOT = Path(__file__).resolve().parents[1]
REQ = ROOT / "requirements"


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep, f"{path.name}: {line!r} is not name==version"
            pins[_canonical(name)] = version.strip()
    return pins


def _tested(version: str, prefixes: tuple[str, ...]) -> bool:
    return any(version == p or version.startswith(p + ".") for p in prefixes)


def test_the_lock_pins_every_requirement_within_its_range() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [*project["dependencies"], *project["optional-dependencies"]["dev"],
            *project["optional-dependencies"]["adapters"]]
    lock = _pins(REQ / "lock.txt")
    for text in reqs:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"sys_platform": "linux"}):
            continue
        name = _canonical(req.name)
        assert name in lock, f"{req.name} is required but not in the lock"
        assert req.specifier.contains(Version(lock[name]), prereleases=True), (
            f"the lock pins {req.name}=={lock[name]}, outside the project's range {req.specifier}")


def test_the_pinned_transformers_releases_are_the_tested_ones_and_cover_them() -> None:
    locked = _pins(REQ / "lock.txt")["transformers"]
    other = _pins(REQ / "transformers-other.txt")["transformers"]
    assert _tested(locked, TESTED_TRANSFORMERS), f"lock: transformers {locked} not in {TESTED_TRANSFORMERS}"
    assert _tested(other, TESTED_TRANSFORMERS), f"other: transformers {other} not in {TESTED_TRANSFORMERS}"
    covered = [p for p in TESTED_TRANSFORMERS if _tested(locked, (p,)) or _tested(other, (p,))]
    assert covered == list(TESTED_TRANSFORMERS), "a tested transformers release is installed by nothing"


def test_the_pinned_vllm_is_the_tested_one() -> None:
    vllm = _pins(REQ / "vllm-host.txt")["vllm"]
    assert _tested(vllm, TESTED_VLLM), f"vllm-host pins vllm {vllm}, not one of {TESTED_VLLM}"


def test_setup_and_ci_install_through_the_lock() -> None:
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert "-c requirements/lock.txt" in setup and "requirements/vllm-host.txt" in setup
    ci = (ROOT / ".ci" / "run").read_text()
    assert "scripts/setup.sh" in ci and "scripts/lock.py installed" in ci
    assert "scripts/setup.sh" in (ROOT / "README.md").read_text()
