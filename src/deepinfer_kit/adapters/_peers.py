"""Peer versions: which releases of another engine an adapter was tested with, and the
error raised when the installed one is not among them."""

from __future__ import annotations

from importlib import metadata

from deepinfer_kit.errors import DeepInferError

__all__ = ["PeerVersionError", "peer_version", "check_peer_version"]


class PeerVersionError(DeepInferError, RuntimeError):
    """The installed peer engine is missing or is a version the adapter was not tested
    with; the message names the peer, the installed version and the tested ones."""


def peer_version(distribution: str) -> str | None:
    """The installed version of ``distribution`` (e.g. ``"transformers"``), or ``None``
    when it is not installed. Reads package metadata only; imports nothing."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def check_peer_version(distribution: str, tested: tuple[str, ...], *, strict: bool = True) -> str:
    """The installed version of ``distribution``, checked against ``tested``.

    A tested entry is a version prefix: ``"5.24"`` admits ``5.24.0`` and ``5.24.3``, not
    ``5.25.0``. Called once by each adapter's constructor (never on a hot path).

    Args:
        distribution: the peer's distribution name.
        tested: version prefixes the adapter was tested with.
        strict: when False an untested version is accepted (the caller takes the risk);
            a missing peer still raises.

    Raises:
        PeerVersionError: the peer is not installed, or (``strict``) its version matches
            no tested prefix; the message names both.
    """
    installed = peer_version(distribution)
    if installed is None:
        raise PeerVersionError(
            f"{distribution} is not installed; this adapter was tested with "
            f"{distribution} {', '.join(tested)}"
        )
    if strict and not any(installed == t or installed.startswith(t + ".") for t in tested):
        raise PeerVersionError(
            f"{distribution} {installed} is installed, but this adapter was tested with "
            f"{distribution} {', '.join(tested)} only; pass strict=False to try it anyway"
        )
    return installed
