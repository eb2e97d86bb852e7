"""The trace schema: round trips (JSON and HTML) and the errors for documents off it."""

from __future__ import annotations

import copy
import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from viewer_run import record_eplb_run, record_run  # noqa: E402

from deepinfer_kit.errors import ConfigError  # noqa: E402
from deepinfer_kit.viewer import (  # noqa: E402
    SCHEMA_VERSION,
    TraceDoc,
    dumps,
    loads,
    read_html,
    render_html,
    validate,
    write_html,
)


@pytest.fixture(scope="module")
def doc() -> TraceDoc:
    return record_run(min_steps=30).doc


def test_json_round_trip(doc: TraceDoc) -> None:
    assert doc["version"] == SCHEMA_VERSION == 1
    text = dumps(doc)
    back = loads(text)
    assert back == doc
    assert dumps(back) == text
    assert loads(dumps(doc, indent=2)) == doc


def test_html_round_trip_is_self_contained(doc: TraceDoc, tmp_path: Path) -> None:
    hostile = copy.deepcopy(doc)
    hostile["meta"]["model"] = "</script><script>alert(1)</script> & <!--"
    path = tmp_path / "run.html"
    write_html(hostile, path)
    assert read_html(path) == hostile
    page = path.read_text("utf-8")
    assert page.count("</script>") == 2  # the data element and the inline script
    assert not re.search(r"<(script|link|img)[^>]+(src|href)=", page)
    assert "http://" not in page and "https://" not in page
    assert render_html(dumps(doc)) == render_html(doc)


def _broken(doc: TraceDoc, path: str, value: Any) -> dict[str, Any]:
    bad: dict[str, Any] = json.loads(json.dumps(doc))
    *head, last = path.split(".")
    node: Any = bad
    for key in head:
        node = node[int(key)] if isinstance(node, list) else node[key]
    if value is KeyError:
        del node[last]
    else:
        node[int(last) if isinstance(node, list) else last] = value
    return bad


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        ("version", 2, "version must be 1"),
        ("schema", "other", "schema must be"),
        ("meta.block_size", True, r"meta.block_size must be int"),
        ("steps.3.budget", 1, r"steps\[3\]: sum of q"),
        ("steps.3.queues", KeyError, r"steps\[3\].queues is missing"),
        ("steps.3.blocks.ref_counts", {}, r"ref_counts must be list"),
        ("steps.3.sampling.0.filter", "nucleus", r"filter must join"),
        ("steps.3.tokens.0.committed_in", -5, r"committed_in must be >= sampled_in"),
        ("steps.3.experts", "none", r"experts must be list"),
    ],
)
def test_validate_names_the_field(doc: TraceDoc, path: str, value: Any, message: str) -> None:
    bad = _broken(doc, path, value)
    with pytest.raises(ConfigError, match=message):
        validate(bad)
    with pytest.raises(ConfigError, match=message):
        loads(json.dumps(bad))


def test_loads_rejects_non_json(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not JSON"):
        loads("{nope")
    page = tmp_path / "x.html"
    page.write_text("<html></html>")
    with pytest.raises(ConfigError, match="no embedded"):
        read_html(page)


def test_eplb_fields_are_optional_and_checked() -> None:
    """A run without EPLB has no ``eplb`` keys and stays valid; with EPLB every step has
    one, GPU loads must sum their slots, and a step missing it is refused."""
    eplb = record_eplb_run().doc
    assert loads(dumps(eplb)) == eplb and all("eplb" in s for s in eplb["steps"])
    bad: Any = copy.deepcopy(eplb)
    bad["steps"][2]["eplb"]["gpu_loads"][0][1] += 1
    with pytest.raises(ConfigError, match=r"steps\[2\]\.eplb\.gpu_loads must sum the slots"):
        validate(bad)
    bad = copy.deepcopy(eplb)
    del bad["steps"][3]["eplb"]
    with pytest.raises(ConfigError, match=r"steps\[3\]\.eplb must be present exactly when meta\.eplb is"):
        validate(bad)
    bad = copy.deepcopy(eplb)
    bad["steps"][0]["eplb"]["phy2log"][1].pop()
    with pytest.raises(ConfigError, match=r"steps\[0\]\.eplb\.phy2log\[1\] must have num_slots=12"):
        validate(bad)
    for change in ((0, 1, 1), (0, 0, -1)):  # a load that breaks the sum; then one that moves a copy
        bad = copy.deepcopy(eplb)
        layer, gpu, delta = change
        bad["steps"][4]["eplb"]["gpu_loads_before"][layer][gpu] += delta
        if delta < 0:
            bad["steps"][4]["eplb"]["gpu_loads_before"][layer][1] -= delta
            validate(bad)  # a different split of the same copies is a valid document
            continue
        with pytest.raises(ConfigError, match=r"steps\[4\]\.eplb\.gpu_loads_before must hold num_gpus=4"):
            validate(bad)
    bad = copy.deepcopy(eplb)
    bad["steps"][4]["eplb"]["gpu_loads_before"][1].pop()
    with pytest.raises(ConfigError, match=r"steps\[4\]\.eplb\.gpu_loads_before must hold num_gpus=4"):
        validate(bad)
    bad = copy.deepcopy(eplb)
    del bad["steps"][4]["eplb"]["gpu_loads_before"], bad["meta"]["eplb"]["dispatch"]
    validate(bad)  # both optional: documents written before them stay valid
    bad = copy.deepcopy(eplb)
    del bad["meta"]["eplb"]["num_gpus"]
    with pytest.raises(ConfigError, match=r"meta\.eplb\.num_gpus is missing"):
        validate(bad)
