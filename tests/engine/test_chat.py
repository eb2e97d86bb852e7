"""LLM.chat: the checkpoint's chat template rendered as transformers renders it."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from deepinfer_kit import LLM, SamplingParams
from deepinfer_kit.errors import ConfigError
from deepinfer_kit.models.chat_template import ChatTemplate

sys.path.insert(0, str(Path(__file__).resolve().parent))

from text_reference import CORPUS  # noqa: E402

transformers = pytest.importorskip("transformers")

# A ChatML template in the style of Qwen's: a system prompt with tool schemas (tojson),
# raise_exception on a bad role, namespace state, loop controls, the generation prompt.
CHATML = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- 'Tools you may call:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(turns=0) %}
{%- for message in messages %}
{%- if message.role == 'system' %}{% continue %}{% endif %}
{%- if message.role not in ['user', 'assistant'] %}
{{- raise_exception('unknown role ' + message.role) }}
{%- endif %}
{%- set ns.turns = ns.turns + 1 %}
{{- '<|im_start|>' + message.role + '\\n' + message.content | trim + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and not enable_thinking %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}
"""

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hello there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "naïve café?"},
     {"role": "assistant", "content": "  déjà vu  "}, {"role": "user", "content": "東京の天気"}],
    [{"role": "user", "content": [{"type": "text", "text": "two"}, {"type": "text", "text": "parts"}]}],
]
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "Wetter für Orte",
                                           "parameters": {"type": "object", "properties": {}}}}]


def _tokenizer_json(folder: Path) -> int:
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers

    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(CORPUS * 10, trainer)
    backend.save(str(folder / "tokenizer.json"))
    return int(backend.get_vocab_size(with_added_tokens=True))


@pytest.fixture(scope="module")
def chat_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3 checkpoint with a BPE tokenizer.json and a ChatML template."""
    import torch

    folder = tmp_path_factory.mktemp("chat_ckpt")
    vocab = _tokenizer_json(folder)
    config = transformers.Qwen3Config(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=256,
        eos_token_id=2, bos_token_id=None, pad_token_id=None,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "bos_token": None, "chat_template": CHATML,
    }))
    return folder


@pytest.fixture(scope="module")
def llm(chat_ckpt: Path) -> LLM:
    return LLM(str(chat_ckpt), num_blocks=32, block_size=16, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def hf_tok(chat_ckpt: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(str(chat_ckpt))


@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("flags", [dict(add_generation_prompt=True), dict(add_generation_prompt=False),
                                   dict(add_generation_prompt=True, tools=TOOLS),
                                   dict(add_generation_prompt=True, chat_template_kwargs={"enable_thinking": False})])
def test_chat_prompt_equals_transformers(llm: LLM, hf_tok: Any, conv: int, flags: dict[str, Any]) -> None:
    messages = CONVERSATIONS[conv]
    kwargs = dict(flags)
    extra = kwargs.pop("chat_template_kwargs", {})
    # Text parts reach the template joined by newlines (vLLM's "string" content format).
    hf_messages = [{**m, "content": m["content"] if isinstance(m["content"], str)
                    else "\n".join(p["text"] for p in m["content"])} for m in messages]
    expected_text = hf_tok.apply_chat_template(hf_messages, tokenize=False, **kwargs, **extra)
    expected_ids = hf_tok(expected_text, add_special_tokens=False)["input_ids"]
    text, ids = llm.chat_renderer.render(messages, "messages", **flags)
    assert text == expected_text
    assert ids == expected_ids


def test_chat_generates_from_the_rendered_prompt(llm: LLM, hf_tok: Any) -> None:
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    outs = llm.chat([CONVERSATIONS[0], CONVERSATIONS[1]], params)
    for out, conv in zip(outs, CONVERSATIONS[:2]):
        text = hf_tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        assert out.prompt == text
        assert out.prompt_token_ids == hf_tok(text, add_special_tokens=False)["input_ids"]
        same = llm.generate({"prompt_token_ids": out.prompt_token_ids}, params)[0]
        assert out.outputs[0].token_ids == same.outputs[0].token_ids
    single = llm.chat(CONVERSATIONS[0], params)
    assert single[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
    assert llm.get_tokenizer() is llm.engine.tokenizer
    llm.engine.check_idle()


def test_chat_template_file_wins_and_template_errors_are_config_errors(
    chat_ckpt: Path, tmp_path: Path, hf_tok: Any
) -> None:
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}")
    (tmp_path / "tokenizer_config.json").write_text((chat_ckpt / "tokenizer_config.json").read_text())
    template = ChatTemplate.from_folder(tmp_path)
    assert template is not None
    assert template.render(CONVERSATIONS[0]) == "[user]Hello there"
    bad = [{"role": "tool", "content": "x"}]
    with pytest.raises(ConfigError, match="unknown role tool"):
        ChatTemplate(CHATML).render(bad)
    with pytest.raises(ConfigError, match="does not compile"):
        ChatTemplate("{% for %}")
    with pytest.raises(ConfigError, match=r"messages\[0\]\['content'\]\[0\]"):
        LLM("tiny", num_blocks=64, max_model_len=1024).chat([{"role": "user", "content": [{"type": "image"}]}],
                                       chat_template=CHATML)


def test_tiny_model_needs_a_template_and_accepts_one() -> None:
    llm = LLM("tiny", num_blocks=64, max_model_len=1024)
    with pytest.raises(ConfigError, match="chat_template must be given"):
        llm.chat(CONVERSATIONS[0])
    out = llm.chat(CONVERSATIONS[0], SamplingParams(max_tokens=3, temperature=0), chat_template=CHATML)
    assert out[0].prompt == "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n"
    assert out[0].prompt_token_ids == list(out[0].prompt.encode())
