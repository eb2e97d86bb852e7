"""The host core (request, scheduler, cache manager) imports and runs with no torch,
triton or numpy: a child interpreter refuses those imports and drives the core."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

_SRC = Path(__file__).resolve().parents[1] / "src"

_CHILD = textwrap.dedent(
    """
    import importlib.abc
    import sys

    BLOCKED = ("torch", "triton", "numpy")

    class RefuseTensorLibraries(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"{name} is refused in this interpreter", name=name)
            return None

    sys.meta_path.insert(0, RefuseTensorLibraries())
    for name in BLOCKED:
        sys.modules.pop(name, None)

    import deepinfer_kit
    import deepinfer_kit.cache
    import deepinfer_kit.sched
    from deepinfer_kit import Request, SamplingParams
    from deepinfer_kit.cache import BlockKVCacheManager, CacheConfig

    cache = BlockKVCacheManager.create(CacheConfig(block_size=4, num_blocks=16))
    a = Request("a", list(range(10)), SamplingParams())
    assert cache.match_prefix(a) == 0
    cache.allocate(a, a.num_tokens)
    cache.cache_full_blocks(a, a.num_tokens)
    b = Request("b", list(range(8)) + [99, 98], SamplingParams())
    hit = cache.match_prefix(b)
    assert hit == 8, hit
    cache.allocate(b, b.num_tokens - hit, hit)
    assert b.block_table[:2] == a.block_table[:2]
    cache.check_integrity([a, b])
    cache.free(a)
    cache.free(b)
    cache.check_integrity(())
    stats = cache.stats
    assert stats is not None and stats.hit_blocks == 2, stats

    import deepinfer_kit.engine.config  # noqa: F401 (the simulator imports it; eplb/ stays unloaded)

    leaked = sorted(m for m in sys.modules if m.partition(".")[0] in BLOCKED)
    assert not leaked, leaked
    print("host core ok")
    """
)


def test_host_core_imports_and_runs_without_torch() -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(_SRC), *filter(None, [env.get("PYTHONPATH")])]
    )
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, (
        "the host core needs a refused library at import time:\n" + proc.stderr[-4000:]
    )
    assert "host core ok" in proc.stdout
