"""The names of the embedded models, and the folders of those shipped as checkpoints.

``"tiny"`` is built in memory from seeded random weights (:mod:`deepinfer_kit.models.tiny`);
``"tiny-words"`` is a checkpoint folder inside the package (``config.json`` + fp16
``model.safetensors``, trained on the project's docs by ``scripts/train_embedded.py``) and
loads through the same path as any Hugging Face folder. An embedded name wins over a local
folder of the same name.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from deepinfer_kit.errors import ConfigError

__all__ = [
    "TINY",
    "TINY_WORDS",
    "EMBEDDED_MODELS",
    "TINY_WORDS_SHA256",
    "is_embedded",
    "embedded_checkpoint",
    "embedded_dspark_heads",
    "file_sha256",
]

TINY = "tiny"
TINY_WORDS = "tiny-words"
EMBEDDED_MODELS = (TINY, TINY_WORDS)

#: SHA-256 of the shipped ``tiny-words/model.safetensors`` (also stated in docs/models.md).
TINY_WORDS_SHA256 = "8fcc1e3c0f68dfcd4c6dcdbccd9aa5d87fe32f2b36a200be281f20ce4fffae22"

_FOLDERS = {TINY_WORDS: Path(__file__).resolve().parent / "embedded" / TINY_WORDS}


def is_embedded(model: str) -> bool:
    """Whether ``model`` (an ``EngineConfig.model`` value) names an embedded model."""
    return model in EMBEDDED_MODELS


def embedded_checkpoint(name: str) -> Path:
    """The packaged checkpoint folder of the embedded model ``name``.

    Called by the engine builder when ``EngineConfig.model`` is an embedded checkpoint name;
    reads nothing but the folder's existence.

    Raises:
        ConfigError: ``name`` is not an embedded checkpoint (``"tiny"`` has no folder: it is
            built in memory), or its folder is missing from the installed package.
    """
    folder = _FOLDERS.get(name)
    if folder is None:
        raise ConfigError(
            f"model must name an embedded checkpoint ({sorted(_FOLDERS)}), got {name!r}"
        )
    if not (folder / "model.safetensors").is_file():
        raise ConfigError(
            f"model {name!r}: its weights are missing from the installed package "
            f"(expected {str(folder / 'model.safetensors')!r}; reinstall deepinfer_kit)"
        )
    return folder


def embedded_dspark_heads(name: str) -> Path:
    """The DSpark heads file shipped for the embedded model ``name``
    (``SpecConfig(dspark_heads=name)``, trained by ``scripts/train_dspark.py``); kept out of
    the checkpoint folder, whose every ``*.safetensors`` file the model loader reads.

    Raises:
        ConfigError: no heads are shipped for ``name``.
    """
    path = Path(__file__).resolve().parent / "embedded" / "dspark" / f"{name}.safetensors"
    if not path.is_file():
        raise ConfigError(
            f"speculative.dspark_heads: no DSpark heads are shipped for {name!r} "
            f"(expected {str(path)!r}); name a heads file"
        )
    return path


def file_sha256(path: str | Path) -> str:
    """Hex SHA-256 of a file's bytes (read in 1 MiB chunks)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
