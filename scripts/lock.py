"""The test environment's lock: write it from what ``.[dev,adapters]`` resolves today, or
check that it still is what that resolves to.

    .venv/bin/python scripts/lock.py refresh   # rewrite requirements/lock.txt
    .venv/bin/python scripts/lock.py check     # exit 1 when the lock and today's resolution differ
    .venv/bin/python scripts/lock.py installed # exit 1 when this venv holds other versions

Both ask pip for a fresh resolution (``pip install --dry-run --ignore-installed --report``:
nothing is installed) of the project's ``dev`` and ``adapters`` extras plus the pins made on
purpose (:data:`ON_PURPOSE`), on this Python and platform (the lock is written on CPython
3.11, Linux x86_64, as CI runs). ``requirements/peers.txt`` (vLLM's host classes and the
other tested transformers, installed beside the venv by ``scripts/setup.sh``) is pinned by
hand: the adapters' tested-version tables name those releases, and a test checks that they
agree with both files.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements" / "lock.txt"
EXTRAS = "dev,adapters"

#: Pins that differ from a plain resolution on purpose, and why.
ON_PURPOSE: dict[str, tuple[str, str]] = {
    "torch": ("2.13.0", "the CPU build on this machine's disk; a plain resolution takes a "
                        "multi-GB CUDA build (the README installs it first, then the lock)"),
}

HEADER = """\
# The test environment, pinned: what `pip install -e ".[{extras}]"` resolved on {python}
# (Linux x86_64), with the CPU build of torch installed first. Install through it:
#   .venv/bin/pip install torch==2.13.0 && .venv/bin/pip install -c requirements/lock.txt -e ".[dev]"
# Refresh (one line): .venv/bin/python scripts/lock.py refresh
# Check it is still today's resolution: .venv/bin/python scripts/lock.py check
# Pinned on purpose (differs from a plain resolution):
{purpose}
"""


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def resolve() -> dict[str, str]:
    """Package name (canonical) -> version that pip resolves today for the extras."""
    pins = [f"{name}=={version}" for name, (version, _) in ON_PURPOSE.items()]
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--dry-run", "--ignore-installed",
             "--report", str(report), "-e", f"{ROOT}[{EXTRAS}]", *pins],
            check=True,
        )
        data = json.loads(report.read_text())
    out = {}
    for item in data["install"]:
        name = _canonical(item["metadata"]["name"])
        if name != "deepinfer-kit":
            out[name] = item["metadata"]["version"].split("+")[0]
    return out


def read_lock(path: Path = LOCK) -> dict[str, str]:
    """Package name (canonical) -> pinned version, from a ``name==version`` file."""
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[_canonical(name)] = version.strip()
    return pins


def refresh() -> int:
    pins = resolve()
    purpose = "\n".join(f"#   {name}=={v}: {why}" for name, (v, why) in ON_PURPOSE.items())
    python = f"CPython {sys.version_info.major}.{sys.version_info.minor}"
    lines = [HEADER.format(extras=EXTRAS, python=python, purpose=purpose)]
    lines += [f"{name}=={pins[name]}" for name in sorted(pins)]
    LOCK.write_text("\n".join(lines) + "\n")
    print(f"wrote {LOCK.relative_to(ROOT)}: {len(pins)} packages")
    return 0


def check() -> int:
    today, locked = resolve(), read_lock()
    differ = sorted(
        f"{name}: lock {locked.get(name, '-')}, today {today.get(name, '-')}"
        for name in set(today) | set(locked)
        if locked.get(name) != today.get(name)
    )
    for name, (version, why) in ON_PURPOSE.items():
        print(f"pinned on purpose: {name}=={version} ({why})")
    if differ:
        print("the lock is not what .[{}] resolves today:\n  ".format(EXTRAS) + "\n  ".join(differ))
        return 1
    print(f"the lock is today's resolution: {len(locked)} packages agree")
    return 0


def installed() -> int:
    """Compare the running interpreter's packages with the lock (CI runs it after setup)."""
    from importlib import metadata

    have: dict[str, str] = {}
    for dist in metadata.distributions():  # sys.path order: the first one found is imported
        have.setdefault(_canonical(dist.metadata["Name"]), dist.version.split("+")[0])
    locked = read_lock()
    differ = sorted(f"{name}: lock {v}, installed {have.get(name, '-')}"
                    for name, v in locked.items() if have.get(name) != v)
    if differ:
        print("this environment is not the lock:\n  " + "\n  ".join(differ))
        return 1
    print(f"this environment holds the lock's {len(locked)} versions")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("refresh", "check", "installed"))
    command = parser.parse_args().command
    return {"refresh": refresh, "check": check, "installed": installed}[command]()


if __name__ == "__main__":
    sys.exit(main())
