"""LLM: the batch API — ``LLM("tiny").generate(prompts, params)`` — over an Engine."""

from __future__ import annotations

import reprlib
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypedDict, Union

import attrs

from deepinfer_kit.engine.build import build_engine
from deepinfer_kit.engine.chat import ChatRenderer, Conversation
from deepinfer_kit.engine.config import EngineConfig
from deepinfer_kit.engine.engine import Engine
from deepinfer_kit.errors import ConfigError
from deepinfer_kit.models.chat_template import ChatTemplate
from deepinfer_kit.models.tokenizer import Tokenizer
from deepinfer_kit.outputs import RequestOutput
from deepinfer_kit.models.generation_defaults import default_device, generation_defaults
from deepinfer_kit.sample.params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from deepinfer_kit.components import Components
    from deepinfer_kit.engine.trace import StepTrace

__all__ = ["LLM", "PromptInput", "SinglePrompt", "TextPrompt", "TokensPrompt", "check_text", "one_prompt",
           "tensor_parallel_options"]


class TextPrompt(TypedDict):
    """vLLM's text prompt record: ``{"prompt": "Hello"}``."""

    prompt: str


class TokensPrompt(TypedDict):
    """vLLM's token prompt record: ``{"prompt_token_ids": [1, 2, 3]}``."""

    prompt_token_ids: Sequence[int]


SinglePrompt = Union[str, Sequence[int], TextPrompt, TokensPrompt]
PromptInput = Union[SinglePrompt, Sequence[SinglePrompt]]
"""One prompt (text, token ids, or a vLLM prompt dict) or a list of them."""

_PROGRESS_MIN = 8  # show a progress bar from this many prompts on
_BYTES = (bytes, bytearray, memoryview)  # sequences of ints that are not token ids
_PROMPT_KEYS = ("prompt", "prompt_token_ids")
_EXPECTED = "text, a list of token ids, {'prompt': text} or {'prompt_token_ids': ids}"


def _show(value: object) -> str:
    """The type and a shortened repr of a rejected value (a prompt may be huge)."""
    return f"{type(value).__name__}: {reprlib.repr(value)}"


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _token_ids(value: object, where: str, expected: str) -> list[int] | None:
    """``value`` as token ids when it is a non-text sequence (else ``None``); ConfigError
    naming ``where`` and the type of the first element that is not an int."""
    if isinstance(value, (str, *_BYTES)) or not isinstance(value, Sequence):
        return None
    for j, tok in enumerate(value):
        if not _is_int(tok):
            raise ConfigError(
                f"{where} must be {expected}; its element [{j}] is a {_show(tok)}"
            )
    return list(value)


def check_text(text: str, where: str) -> str:
    """``text`` when it can be written as UTF-8 (no lone surrogate), else a ConfigError
    naming ``where`` and the position (a tokenizer would fail on it with a UnicodeError)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ConfigError(
            f"{where} holds a lone surrogate {text[exc.start]!r} at position {exc.start}: "
            f"not valid Unicode text"
        ) from None
    return text


def one_prompt(value: object, where: str) -> str | list[int]:
    """One prompt of any accepted form (text, token ids, ``{"prompt": ...}`` or
    ``{"prompt_token_ids": ...}``) as text or token ids.

    Raises:
        ConfigError: naming ``where`` and the type or key at fault.
    """
    if isinstance(value, str):
        return check_text(value, where)
    if isinstance(value, Mapping):
        present = [k for k in _PROMPT_KEYS if k in value]
        unknown = sorted(str(k) for k in value if k not in _PROMPT_KEYS)
        if unknown:
            raise ConfigError(
                f"{where} has unknown keys {unknown}; a prompt dict holds one of {list(_PROMPT_KEYS)}"
            )
        if len(present) != 1:
            which = "both" if present else "neither"
            raise ConfigError(
                f"{where} must hold exactly one of {list(_PROMPT_KEYS)}, got {which}: "
                f"{reprlib.repr(dict(value))}"
            )
        inner = value[present[0]]
        if present[0] == "prompt":
            if not isinstance(inner, str):
                raise ConfigError(
                    f"{where}['prompt'] must be text, got {_show(inner)}"
                )
            return check_text(inner, f"{where}['prompt']")
        ids = _token_ids(inner, f"{where}['prompt_token_ids']", "a list of ints")
        if ids is None:
            raise ConfigError(
                f"{where}['prompt_token_ids'] must be a list of ints, got {_show(inner)}"
            )
        return ids
    ids = _token_ids(value, where, _EXPECTED)
    if ids is None:
        raise ConfigError(f"{where} must be {_EXPECTED}, got {_show(value)}")
    return ids


def _normalize(prompts: object) -> list[str | list[int]]:
    """The prompts of a ``generate`` call as a list of texts and token-id lists.

    Raises:
        ConfigError: naming ``prompts`` (or ``prompts[i]``) and the type at fault.
    """
    if isinstance(prompts, (str, Mapping)):
        return [one_prompt(prompts, "prompts")]
    if isinstance(prompts, _BYTES) or not isinstance(prompts, Sequence):
        raise ConfigError(
            f"prompts must be {_EXPECTED}, or a list of them; got {_show(prompts)}"
        )
    items = list(prompts)
    if items and all(_is_int(p) for p in items):
        return [items]
    return [one_prompt(p, f"prompts[{i}]") for i, p in enumerate(items)]


def _vllm_options(config: dict[str, Any]) -> None:
    """vLLM's ``LLM`` options that are spelled differently here, translated in place.

    Raises:
        ConfigError: ``enforce_eager`` not a bool; ``tensor_parallel_size`` not an int >= 1.
    """
    if "enforce_eager" in config:  # vLLM's name: never capture CUDA graphs
        eager = config.pop("enforce_eager")
        if not isinstance(eager, bool):
            raise ConfigError(f"enforce_eager must be a bool, got {eager!r}")
        config["cuda_graphs"] = not eager
    if "tensor_parallel_size" in config:  # vLLM's name
        size = config.pop("tensor_parallel_size")
        config.update(tensor_parallel_options(size, config.get("worker", "inline")))


def tensor_parallel_options(size: object, worker: object = "inline") -> dict[str, Any]:
    """The :class:`EngineConfig` fields vLLM's ``tensor_parallel_size`` means here:
    ``{"tensor_parallel": size}``, and ``worker="process"`` when ``size > 1`` and the
    caller's ``worker`` is the in-process default (one worker process per rank, spawned
    here, as vLLM's ``LLM(model, tensor_parallel_size=T)`` starts its own).

    Raises:
        ConfigError: not an int >= 1.
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ConfigError(f"tensor_parallel_size must be an int >= 1, got {size!r}")
    if size > 1 and worker == "inline":
        return {"tensor_parallel": size, "worker": "process"}
    return {"tensor_parallel": size}


def _params_list(sampling_params: object, count: int, default: SamplingParams) -> list[SamplingParams]:
    """One :class:`SamplingParams` per prompt; ConfigError naming the index and type at fault."""
    if sampling_params is None:
        return [default] * count
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * count
    if isinstance(sampling_params, (str, *_BYTES)) or not isinstance(sampling_params, Sequence):
        raise ConfigError(
            f"sampling_params must be SamplingParams or a list of them, got "
            f"{_show(sampling_params)}"
        )
    params = list(sampling_params)
    if len(params) != count:
        raise ConfigError(
            f"sampling_params must be one or one per prompt ({count}), got {len(params)}"
        )
    for i, sp in enumerate(params):
        if not isinstance(sp, SamplingParams):
            raise ConfigError(
                f"sampling_params[{i}] must be SamplingParams, got {_show(sp)}"
            )
    return params


class LLM:
    """Generate completions for a batch of prompts.

    Args:
        model: a Hugging Face checkpoint folder, or an embedded model: ``"tiny"`` (random
            weights) or ``"tiny-words"`` (trained on the project's docs).
        engine: an already built :class:`Engine` to use instead of building one.
        components: components of yours in place of the built-ins
            (:class:`~deepinfer_kit.components.Components`, as ``build_engine``).
        trace: called with each step's :class:`~deepinfer_kit.engine.trace.StepTrace`.
        generation_config: where the default sampling parameters come from (vLLM's
            option): ``"auto"`` the checkpoint's ``generation_config.json`` (temperature,
            top_p, top_k, min_p, repetition_penalty, max_new_tokens), ``"vllm"`` none,
            or another folder holding the file. See :meth:`get_default_sampling_params`.
        **config: other :class:`EngineConfig` fields (``device``, ``dtype``, ``num_blocks``,
            ``gpu_memory_utilization``, ``tokenizer``…); ``enforce_eager=True`` is vLLM's
            name for ``cuda_graphs=False``; ``tensor_parallel_size`` must be 1. Unlike a
            bare :class:`EngineConfig`, ``device`` defaults to ``"cuda"`` when a GPU is
            present and ``model`` is a checkpoint folder; ``dtype`` defaults to ``"auto"``
            as in :class:`EngineConfig` (:func:`~deepinfer_kit._dtypes.auto_dtype`).

    Raises:
        ConfigError: an option that is not an :class:`EngineConfig` field (named, with the
            valid ones), options given together with ``engine``, or a bad option value.
    """

    def __init__(self, model: str = "tiny", *, engine: Engine | None = None,
                 components: Components | None = None, trace: Callable[[StepTrace], None] | None = None,
                 generation_config: str = "auto", **config: Any) -> None:
        _vllm_options(config)
        if engine is None:
            config.setdefault("device", default_device(model))
        self._sampling_defaults = generation_defaults(
            model if engine is None else None, generation_config)
        SamplingParams(**self._sampling_defaults)  # a bad file fails here, not per request
        valid = [f.name for f in attrs.fields(EngineConfig) if f.name != "model"]
        unknown = sorted(k for k in config if k not in valid)
        if unknown:
            raise ConfigError(
                f"unknown LLM option(s) {unknown}; valid EngineConfig fields: {valid}"
            )
        if engine is not None and (config or components is not None or trace is not None):
            given = sorted(config) + [k for k, v in (("components", components), ("trace", trace)) if v is not None]
            raise ConfigError(
                f"options {given} are unused when an engine is given; set them where it is built"
            )
        self.engine = engine if engine is not None else build_engine(
            EngineConfig(model=model, **config), components=components, trace=trace)
        folder = config.get("tokenizer") or (None if engine is not None or model == "tiny" else model)
        self.chat_renderer = ChatRenderer(
            self.engine.tokenizer, ChatTemplate.from_folder(folder) if folder else None
        )

    def get_default_sampling_params(self) -> SamplingParams:
        """The parameters :meth:`generate` and :meth:`chat` use when given none: the
        checkpoint's ``generation_config.json`` sampling fields over ``SamplingParams()``
        (vLLM's ``LLM.get_default_sampling_params``); a new object each call."""
        return SamplingParams(**self._sampling_defaults)

    @property
    def sampling_defaults(self) -> dict[str, Any]:
        """The ``generation_config.json`` fields in force (SamplingParams field -> value;
        empty with ``generation_config="vllm"``); a copy."""
        return dict(self._sampling_defaults)

    def close(self) -> None:
        """Stop the engine (its worker process with ``worker="process"``); see
        :meth:`Engine.close`. Idempotent."""
        self.engine.close()

    def get_tokenizer(self) -> Tokenizer | None:
        """The engine's tokenizer (``None`` when it takes token ids only)."""
        return self.engine.tokenizer

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate the next assistant message of one conversation or of a list of them.

        Each conversation (``[{"role": "user", "content": "Hi"}, ...]``) is rendered with
        the checkpoint's chat template (``chat_template`` overrides it), tokenised without
        adding special tokens again, and generated as by :meth:`generate`; each output's
        ``prompt`` is the rendered text.

        Raises:
            ConfigError: no template, a template that raised, malformed messages (named
                by index), or as :meth:`generate`.
        """
        batch = bool(messages) and not isinstance(messages[0], Mapping)
        conversations = list(messages) if batch else [messages]
        rendered = [
            self.chat_renderer.render(
                conv, f"messages[{i}]" if batch else "messages", chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, tools=tools,
                chat_template_kwargs=chat_template_kwargs,
            )
            for i, conv in enumerate(conversations)
        ]
        outs = self.generate([ids for _, ids in rendered], sampling_params, use_tqdm=use_tqdm)
        for out, (text, _) in zip(outs, rendered):
            out.prompt = text
        return outs

    def generate(
        self,
        prompts: PromptInput,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order.

        Args:
            prompts: a text, a list of token ids, ``{"prompt": text}``,
                ``{"prompt_token_ids": ids}``, or a list of any of these.
            sampling_params: one for all prompts, or one per prompt (default:
                :meth:`get_default_sampling_params`).
            use_tqdm: show a progress bar (default: for 8 prompts or more).

        Raises:
            ConfigError: a bad prompt (type, emptiness, ids, length) or parameter, naming
                its index; the whole batch is checked first, so then no prompt is queued.
            Exception: anything else ``add_request`` raises, after the requests this call
                already queued were aborted and drained.
        """
        items = _normalize(prompts)
        params = [  # like vLLM: generate reports each request once, finished
            sp if sp.output_kind is RequestOutputKind.FINAL_ONLY
            else attrs.evolve(sp, output_kind=RequestOutputKind.FINAL_ONLY)
            for sp in _params_list(sampling_params, len(items), self.get_default_sampling_params())
        ]
        for p, sp in zip(items, params):
            self.engine.check_request(p, sp)  # validate all before queuing any
        ids: list[str] = []
        try:
            for p, sp in zip(items, params):
                ids.append(self.engine.add_request(None, p, sp))
        except BaseException:
            self._abort_and_drain(ids)
            raise
        show = use_tqdm if use_tqdm is not None else len(ids) >= _PROGRESS_MIN
        results: dict[str, RequestOutput] = {}
        bar = _progress(len(ids)) if show else None
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    results[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
            for out in self.engine.flush():
                results[out.request_id] = out
        finally:
            if bar is not None:
                bar.close()
        return [results[i] for i in ids]

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block, e.g. between benchmark runs over one prompt
        set; False (nothing changed) while requests run. See :meth:`Engine.reset_prefix_cache`."""
        return self.engine.reset_prefix_cache()

    def _abort_and_drain(self, ids: list[str]) -> None:
        """Abort the requests ``ids`` and step until the engine reported them finished, so
        nothing of a failed call stays queued or holds blocks (nor a round in flight)."""
        pending = {rid for rid in ids if self.engine.abort(rid)}
        while pending and self.engine.has_unfinished_requests():
            pending -= {out.request_id for out in self.engine.step()}
        self.engine.flush()


def _progress(total: int) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="generate", unit="req", dynamic_ncols=True)
