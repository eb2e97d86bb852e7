"""Conversations to prompts: the chat template a model (or a call) names, rendered and
tokenised the way ``LLM.chat`` and the server's chat endpoint both need."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from deepinfer_kit.errors import ConfigError
from deepinfer_kit.models.chat_template import ChatTemplate
from deepinfer_kit.models.tokenizer import HFTokenizer, Tokenizer

__all__ = ["ChatRenderer", "Conversation", "flatten_content"]

Conversation = Sequence[Mapping[str, Any]]


def flatten_content(message: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``message`` with an OpenAI list-of-parts ``content`` joined into one string (text
    parts joined by newlines, as vLLM's "string" content format).

    Raises:
        ConfigError: a part that is not text (images and audio are not supported).
    """
    content = message.get("content")
    if not isinstance(content, list):
        return dict(message)
    texts: list[str] = []
    for j, part in enumerate(content):
        if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(
            part.get("text"), str
        ):
            raise ConfigError(
                f"{where}['content'][{j}] must be a text part {{'type': 'text', 'text': ...}}, got "
                f"{part!r}"
            )
        texts.append(part["text"])
    return {**message, "content": "\n".join(texts)}


class ChatRenderer:
    """Renders conversations with the model's chat template (or one given per call) and
    tokenises them without adding special tokens again.

    Args:
        tokenizer: the engine's tokenizer (``None``: the engine takes token ids only).
        default: the checkpoint's template (``None`` when it has none).
    """

    def __init__(self, tokenizer: Tokenizer | None, default: ChatTemplate | None) -> None:
        self._tokenizer = tokenizer
        self._default = default

    def template(self, chat_template: str | None) -> ChatTemplate:
        """``chat_template`` compiled (with the default's special tokens), else the default.

        Raises:
            ConfigError: no template given and the checkpoint has none; a template that
                does not compile.
        """
        if chat_template is not None:
            specials = self._default.special_tokens if self._default is not None else {}
            return ChatTemplate(chat_template, specials)
        if self._default is None:
            raise ConfigError(
                "chat_template must be given: the model has no chat template (no "
                "chat_template.jinja, no chat_template in tokenizer_config.json)"
            )
        return self._default

    def render(
        self,
        conversation: object,
        where: str,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> tuple[str, list[int]]:
        """The prompt text and its token ids for one conversation.

        Raises:
            ConfigError: not a list of message dicts (naming ``where``), a lone surrogate in
                the rendered text, no tokenizer, or
                as :meth:`template` and :meth:`ChatTemplate.render`.
        """
        if isinstance(conversation, (str, bytes)) or not isinstance(conversation, Sequence):
            raise ConfigError(f"{where} must be a list of message dicts, got {conversation!r}")
        messages = []
        for i, m in enumerate(conversation):
            if not isinstance(m, Mapping):
                raise ConfigError(f"{where}[{i}] must be a message dict, got {m!r}")
            messages.append(flatten_content(m, f"{where}[{i}]"))
        text = self.template(chat_template).render(
            messages, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, tools=tools,
            extra=chat_template_kwargs,
        )
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ConfigError(
                f"{where} holds a lone surrogate {text[exc.start]!r}: not valid Unicode text"
            ) from None
        if self._tokenizer is None:
            raise ConfigError("chat needs a tokenizer; this engine takes token ids only")
        if isinstance(self._tokenizer, HFTokenizer):
            ids = self._tokenizer.encode(text, add_special_tokens=False)
        else:
            ids = self._tokenizer.encode(text)
        if not ids:
            raise ConfigError(f"{where} rendered to an empty prompt")
        return text, ids
