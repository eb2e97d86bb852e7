"""The README's Python snippets run as written and print what the README says they print.

A ``print(...)  # -> VALUE ...`` line must print VALUE (the first word after the arrow); a
snippet without such a line needs an expectation here, so no snippet goes unchecked.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
SNIPPETS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
ARROW = re.compile(r"^\s*print\(.*\)\s*#\s*->\s*(\S+)", flags=re.M)


def _engine_snippet_output(model: str) -> str:
    """What the engine snippet must print: per prompt, the byte decoding of the embedded
    ``model``'s 16 greedy tokens (taken from the Engine API directly) and ``length``."""
    from deepinfer_kit import SamplingParams, build_engine
    from deepinfer_kit.models.tokenizer import ByteTokenizer

    engine = build_engine(model=model)
    ids = [engine.add_request(None, p, SamplingParams(max_tokens=16, temperature=0))
           for p in ("Hello", "Paged attention")]
    outs = {o.request_id: o.outputs[0] for o in engine.run()}
    assert all(outs[i].finish_reason == "length" and len(outs[i].token_ids) == 16 for i in ids)
    return "".join(f"{ByteTokenizer().decode(outs[i].token_ids)} length\n" for i in ids)


def _expected(snippet: str) -> str:
    arrows = ARROW.findall(snippet)
    if arrows:
        return "".join(f"{value}\n" for value in arrows)
    embedded = re.search(r'LLM\("(tiny|tiny-words)"\)', snippet)
    if embedded and '["Hello", "Paged attention"]' in snippet:
        return _engine_snippet_output(embedded.group(1))
    raise AssertionError(f"README snippet has no '# -> value' comment and no expectation here:\n{snippet}")


def test_readme_has_snippets() -> None:
    assert len(SNIPPETS) >= 2


@pytest.mark.parametrize("index", range(len(SNIPPETS)))
def test_snippet_prints_what_the_readme_says(index: int, capsys: pytest.CaptureFixture[str]) -> None:
    exec(compile(SNIPPETS[index], f"README.md snippet {index}", "exec"), {"__name__": "__readme__"})
    printed = capsys.readouterr().out
    assert printed == _expected(SNIPPETS[index])


def test_main_command_output_is_shown_as_it_is(capsys: pytest.CaptureFixture[str]) -> None:
    """The ```text block after the setup command is what ``deepinfer-kit generate`` prints
    (the embedded trained model, greedy), its timing numbers aside."""
    from deepinfer_kit.cli import main

    shown = re.search(r"deepinfer-kit generate\n```\n.*?```text\n(.*?)```", README.read_text(), flags=re.S)
    assert shown is not None, "README shows no output of its main command"
    assert main(["generate"]) == 0
    timing = re.compile(r"time=\S+ tokens/s=\S+")
    printed = timing.sub("time=… tokens/s=…", capsys.readouterr().out)
    assert printed == timing.sub("time=… tokens/s=…", shown.group(1))
