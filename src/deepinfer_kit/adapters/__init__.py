"""adapters/: the kit's components running inside other engines (optional; imports no peer).

Each subpackage imports its peer only when used:

- :mod:`deepinfer_kit.adapters.transformers`: the kit's scheduler and block manager inside
  transformers' continuous batching (``model.generate_batch``).
- :mod:`deepinfer_kit.adapters.vllm`: the kit's KV cache manager and sampler behind the
  interfaces of vLLM v1's ``KVCacheManager`` and ``Sampler``.

See docs/other_engines.md for the tested peer versions and what each adapter leaves out.
"""

from deepinfer_kit.adapters._peers import (
    PeerVersionError,
    check_peer_version,
    peer_version,
)

__all__ = ["PeerVersionError", "check_peer_version", "peer_version"]
