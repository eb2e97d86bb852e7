"""Peer version checks: a clear error naming the installed and the tested versions."""

from __future__ import annotations

import pytest

from deepinfer_kit.adapters import PeerVersionError, _peers, check_peer_version
from deepinfer_kit.adapters.vllm import KitKVCacheManager


def test_prefix_match_admits_patch_releases_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_peers.metadata, "version", lambda name: "0.33.2")
    assert check_peer_version("vllm", ("0.33",)) == "0.33.2"
    monkeypatch.setattr(_peers.metadata, "version", lambda name: "0.330.0")
    with pytest.raises(PeerVersionError, match=r"vllm 0\.330\.0 is installed.*tested with vllm 0\.33"):
        check_peer_version("vllm", ("0.33",))
    assert check_peer_version("vllm", ("0.33",), strict=False) == "0.330.0"


def test_missing_peer_names_the_tested_version(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> str:
        raise _peers.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(_peers.metadata, "version", missing)
    with pytest.raises(PeerVersionError, match=r"vllm is not installed.*tested with vllm 0\.33"):
        KitKVCacheManager.from_vllm_config(object(), 1024)
