"""Chat templates: read a checkpoint's template and special tokens, and render messages with
jinja2 in the environment Hugging Face templates are written for."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from deepinfer_kit.errors import CheckpointError, ConfigError

__all__ = ["ChatTemplate", "load_chat_template", "special_token_strings"]

_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


def _tokenizer_config(folder: Path) -> dict[str, Any]:
    """``tokenizer_config.json`` of ``folder`` as a dict ({} when absent or unreadable)."""
    try:
        data = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def special_token_strings(folder: str | os.PathLike[str]) -> dict[str, str]:
    """``bos_token`` / ``eos_token`` / ``unk_token`` / ``pad_token`` strings of a folder's
    ``tokenizer_config.json`` (plain or ``{"content": ...}`` form); missing ones are left out."""
    data = _tokenizer_config(Path(folder))
    found: dict[str, str] = {}
    for key in _SPECIAL_KEYS:
        value = data.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            found[key] = value
    return found


def load_chat_template(folder: str | os.PathLike[str]) -> str | None:
    """The chat template of a checkpoint folder, or ``None`` when it has none.

    ``chat_template.jinja`` wins over ``tokenizer_config.json``'s ``chat_template`` (as in
    transformers); a list of named templates there yields the one named ``"default"``.

    Raises:
        CheckpointError: the template file cannot be read.
    """
    path = Path(folder) / "chat_template.jinja"
    if path.is_file():
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"cannot read chat template {str(path)!r}: {exc}") from None
    value = _tokenizer_config(Path(folder)).get("chat_template")
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    return value if isinstance(value, str) else None


def _raise_exception(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Templates expect json.dumps' output unescaped (jinja's own tojson HTML-escapes).
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _generation_extension() -> type[Any]:
    """A jinja2 extension accepting ``{% generation %}…{% endgeneration %}`` (the marker
    some templates put around assistant text) and rendering its body unchanged."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class GenerationMarker(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    return GenerationMarker


class ChatTemplate:
    """A compiled chat template and the special-token strings it may refer to.

    Rendered in a sandboxed jinja2 environment with ``trim_blocks`` and ``lstrip_blocks``,
    loop controls, the ``tojson`` filter (``json.dumps``), and the globals
    ``raise_exception`` and ``strftime_now`` — what Hugging Face templates use.

    Args:
        source: the template text.
        special_tokens: ``bos_token``, ``eos_token`` … strings passed as template variables.

    Raises:
        ConfigError: the template does not compile (the jinja2 message).
    """

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None) -> None:
        from jinja2 import TemplateError
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True,
            extensions=[loopcontrols, _generation_extension()],
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except TemplateError as exc:
            raise ConfigError(f"chat_template does not compile: {exc}") from None
        self.special_tokens = dict(special_tokens or {})

    @classmethod
    def from_folder(cls, folder: str | os.PathLike[str]) -> ChatTemplate | None:
        """The template of a checkpoint folder with its special tokens, or ``None``.

        Raises:
            CheckpointError, ConfigError: as :func:`load_chat_template` and the constructor.
        """
        source = load_chat_template(folder)
        return None if source is None else cls(source, special_token_strings(folder))

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text of a conversation.

        Args:
            messages: ``[{"role": ..., "content": ...}, ...]``.
            add_generation_prompt: append the header that opens the assistant's turn.
            continue_final_message: leave the last message open (its text ends the prompt,
                whatever the template appends after it is cut).
            tools: tool schemas, passed as ``tools``.
            extra: further template variables (vLLM's ``chat_template_kwargs``).

        Raises:
            ConfigError: bad messages, both generation flags set, or the template raised
                (``raise_exception`` or a jinja2 error), with its message.
        """
        if add_generation_prompt and continue_final_message:
            raise ConfigError(
                "add_generation_prompt and continue_final_message cannot both be True"
            )
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping) or "role" not in m:
                raise ConfigError(f"messages[{i}] must be a dict with a 'role', got {m!r}")
        from jinja2 import TemplateError

        variables: dict[str, Any] = {**self.special_tokens, **dict(extra or {})}
        try:
            text = self._template.render(
                messages=[dict(m) for m in messages], tools=None if tools is None else list(tools),
                add_generation_prompt=add_generation_prompt, **variables,
            )
        except TemplateError as exc:
            raise ConfigError(f"the chat template refused the messages: {exc}") from None
        if continue_final_message and messages:
            last = messages[-1].get("content")
            if isinstance(last, str) and last.strip() and last.strip() in text:
                text = text[: text.rindex(last.strip()) + len(last.strip())]
        return text
