"""The HTML viewer in a real browser: headless Chromium loads the file from file://, steps
through a 30+-step run (prefix hits, preemption, forks, speculative drafts) and every panel's rendered state,
read back from the DOM's data-* attributes, equals the trace JSON at that step.

Needs Chromium, chromedriver and selenium (``apt-get install chromium chromium-driver``;
``pip install selenium``); skipped with the reason when one is missing.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from viewer_run import EPLB, record_eplb_run, record_run  # noqa: E402

from deepinfer_kit.viewer import TraceDoc, write_html  # noqa: E402

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install selenium)")

CHROMIUM = os.environ.get("DEEPINFER_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = os.environ.get("DEEPINFER_CHROMEDRIVER") or shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None or DRIVER is None,
    reason="needs Chromium and chromedriver on PATH (Debian: apt-get install chromium chromium-driver)",
)

# Reads every panel back from the DOM, in the shape expected() builds from the JSON.
READ_DOM = """
const all = (sel, root) => Array.from((root || document).querySelectorAll(sel));
const d = (e, k) => e.getAttribute('data-' + k);
const n = (e, k) => Number(d(e, k));
const tables = {}, tokens = {};
all('#tables > .trow').forEach(r => { tables[d(r, 'request')] = all('.blk', r).map(b =>
  [n(b, 'logical'), n(b, 'physical'), n(b, 'ref'), n(b, 'shared'), n(b, 'hit'), n(b, 'copy')]); });
all('#seqs > .seq').forEach(r => { tokens[d(r, 'request')] = all('.tok', r).map(t =>
  [n(t, 'index'), n(t, 'token'), n(t, 'sampled-in'), n(t, 'committed-in')]); });
const q = name => all('.queue[data-queue="' + name + '"] > .chip').map(c => c.dataset.id);
const bar = document.getElementById('budget'), ev = document.getElementById('block-events');
return {
  index: n(document.getElementById('step-label'), 'index'),
  panels: all('main > section').map(s => n(s, 'step')),
  queues: {waiting: q('waiting'), running: q('running'), finished: q('finished')},
  preempted: all('.chip.preempted').map(c => c.dataset.id).sort(),
  budget: [n(bar, 'budget'), n(bar, 'used'), all('.seg', bar).map(s => [d(s, 'request'), n(s, 'q'), d(s, 'kind')])],
  tables: tables,
  pool: all('#pool > .cell').map(c => [n(c, 'block'), n(c, 'ref'), d(c, 'state'), n(c, 'evicted')]),
  events: [n(ev, 'free'), n(ev, 'evicted'), n(ev, 'copies')],
  sampling: all('#draws > .draw').map(s => [d(s, 'request'), n(s, 'token'), d(s, 'filter'), n(s, 'committed'),
    all('.cand', s).map(c => [n(c, 'token'), n(c, 'rank'), n(c, 'prob')])]),
  spec: all('#specs > .spec').map(s => [d(s, 'request'), n(s, 'drafted'), n(s, 'verified'), n(s, 'accepted')]),
  tokens: tokens,
  experts: all('#layers > .layer').map(l => all('.ebar', l).map(b => n(b, 'count'))),
};
"""


def expected(doc: TraceDoc, i: int) -> dict[str, Any]:
    """What every panel must show at step index ``i``, computed from the JSON alone."""
    s = doc["steps"][i]
    b = s["blocks"]
    copies = {dst for _src, dst in b["copies"]}
    tokens: dict[str, list[list[int]]] = {}
    for step in doc["steps"][: i + 1]:
        for t in step["tokens"]:
            tokens.setdefault(t["request"], []).append(
                [t["index"], t["token"], t["sampled_in"], t["committed_in"]])
    cached = set(b["cached"])
    return {
        "index": i,
        "panels": [s["step"]] * 6,
        "queues": dict(s["queues"]),
        "preempted": sorted(set(s["preempted"]) & {x for q in s["queues"].values() for x in q}),
        "budget": [s["budget"], s["batched_tokens"], [[c["request"], c["q"], c["kind"]] for c in s["chunks"]]],
        "tables": {
            rid: [[j, p, b["ref_counts"][p], int(p in b["shared"]),
                   int(j < len(b["prefix_hits"].get(rid, []))), int(p in copies)] for j, p in enumerate(table)]
            for rid, table in b["tables"].items()
        },
        "pool": [[blk, ref, "shared" if ref > 1 else "used" if ref == 1 else "cached" if blk in cached else "free",
                  int(blk in b["evicted"])] for blk, ref in enumerate(b["ref_counts"])],
        "events": [b["num_free"], b["num_evicted"], len(b["copies"])],
        "sampling": [[x["request"], x["token"], x["filter"], int(x["committed"]),
                      [[c["token"], c["rank"], math.exp(c["logprob"]) if c["logprob"] is not None else 0.0]
                       for c in x["candidates"]]] for x in s["sampling"]],
        "spec": [[c["request"], len(c["drafted"]), c["verified"], c["accepted"]]
                 for c in s["chunks"] if c["verified"] or c["drafted"]],
        "tokens": tokens,
        "experts": s["experts"] or [],
    }


def _same(got: Any, want: Any) -> bool:
    if isinstance(want, float):
        return isinstance(got, (int, float)) and abs(got - want) <= 6e-5
    if isinstance(want, dict):
        return isinstance(got, dict) and got.keys() == want.keys() and all(_same(got[k], want[k]) for k in want)
    if isinstance(want, list):
        return isinstance(got, list) and len(got) == len(want) and all(map(_same, got, want))
    return bool(got == want)


def check(browser: Any, doc: TraceDoc, i: int) -> None:
    got = browser.execute_script(READ_DOM)
    want = expected(doc, i)
    for panel in want:
        assert _same(got[panel], want[panel]), f"step index {i}, {panel}: {got[panel]!r} != {want[panel]!r}"


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = CHROMIUM  # type: ignore[assignment]
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,1500",
                # a test browser needs no updates, sync or first-run work at start
                "--disable-background-networking", "--disable-component-update", "--no-first-run",
                "--no-default-browser-check", "--disable-extensions", "--disable-sync"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def test_viewer_steps_through_a_real_run(browser: Any, tmp_path: Path) -> None:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    run = record_run(min_steps=30, speculative={"drafter": "ngram", "num_draft": 3})
    doc = run.doc
    steps = doc["steps"]
    assert any(s["preempted"] for s in steps) and any(s["blocks"]["prefix_hits"] for s in steps)
    assert any(c["accepted"] for s in steps for c in s["chunks"])
    assert any(r["parent"] for r in doc["requests"].values())
    path = tmp_path / "run.html"
    write_html(run.recorder, path)
    browser.get(path.resolve().as_uri())
    assert browser.execute_script("return location.protocol") == "file:"
    check(browser, doc, 0)
    nxt = browser.find_element(By.ID, "btn-next")
    body = browser.find_element(By.TAG_NAME, "body")
    for i in range(1, len(steps)):
        if i % 2:
            nxt.click()
        else:
            body.send_keys(Keys.ARROW_RIGHT)
        check(browser, doc, i)
    body.send_keys(Keys.ARROW_LEFT)
    check(browser, doc, len(steps) - 2)
    browser.find_element(By.ID, "btn-first").click()
    check(browser, doc, 0)

    slider = browser.find_element(By.ID, "scrub")
    right = slider.size["width"] // 2 - 2
    ActionChains(browser).move_to_element_with_offset(slider, right, 0).click().perform()
    assert int(slider.get_attribute("value")) == len(steps) - 1  # the track's right end
    check(browser, doc, len(steps) - 1)
    ActionChains(browser).move_to_element(slider).click().perform()  # the middle of the track
    index = int(slider.get_attribute("value"))
    assert 0 < index < len(steps) - 1
    check(browser, doc, index)

    play = browser.find_element(By.ID, "btn-play")
    current = "return window.deepinferViewer.current()"
    play.click()
    deadline = time.monotonic() + 15
    while browser.execute_script(current) < index + 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    play.click()
    assert play.get_attribute("data-playing") == "0"
    now = browser.execute_script(current)
    assert now >= index + 2
    time.sleep(0.8)  # paused: no frame in longer than one period (0.7 s)
    assert browser.execute_script(current) == now
    check(browser, doc, now)
    assert not [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]


READ_EPLB = """
const all = (sel, root) => Array.from((root || document).querySelectorAll(sel));
const n = (e, k) => Number(e.getAttribute('data-' + k));
const note = document.getElementById('rebalance');
return {
  shown: !document.getElementById('eplb').hidden,
  rebalance: [n(note, 'rebalanced'), n(note, 'moved'), note.getAttribute('data-before'), note.getAttribute('data-after')],
  layers: all('#eplb-layers > .elayer').map(l => all('.gpu', l).map(g => [n(g, 'gpu'), n(g, 'load'), n(g, 'before'),
    all('.slot', g).map(x => [n(x, 'slot'), n(x, 'expert'), n(x, 'count'), n(x, 'changed')])])),
  balance: all('#eplb-layers > .elayer .bal').map(b => [b.getAttribute('data-before'), b.getAttribute('data-after')]),
};
"""


def expected_eplb(doc: TraceDoc, i: int) -> dict[str, Any]:
    """The EPLB part of the expert panel at step index ``i``, from the JSON alone."""
    x = doc["steps"][i]["eplb"]
    per = doc["meta"]["eplb"]["num_slots"] // doc["meta"]["eplb"]["num_gpus"]
    r = x["rebalance"]
    changed = r["changed"] if r else [[] for _ in x["phy2log"]]
    return {
        "shown": True,
        "rebalance": [1, r["moved_slots"], f"{r['balancedness_before']:.4f}", f"{r['balancedness_after']:.4f}"]
        if r else [0, 0, "", ""],
        "layers": [[[g, load, x["gpu_loads_before"][li][g],
                     [[k, x["phy2log"][li][k], x["slots"][li][k], int(k in changed[li])]
                      for k in range(g * per, (g + 1) * per)]]
                    for g, load in enumerate(loads)] for li, loads in enumerate(x["gpu_loads"])],
        "balance": [[_balancedness(before), _balancedness(after)]
                    for before, after in zip(x["gpu_loads_before"], x["gpu_loads"])],
    }


def _balancedness(loads: list[int]) -> str:
    return f"{sum(loads) / len(loads) / max(loads) if max(loads) > 0 else 1.0:.3f}"


def test_viewer_shows_eplb_placement_and_rebalance(browser: Any, tmp_path: Path) -> None:
    """A live-EPLB run with the balanced replica selector: per-GPU loads before and after
    selection, each layer's balancedness and slot -> expert placement match the trace at
    every step, before, at and after each rebalance, and the changed slots are marked."""
    from selenium.webdriver.common.by import By

    run = record_eplb_run({**EPLB, "dispatch": "balanced"})
    doc = run.doc
    history = run.engine.balancer.history  # type: ignore[union-attr]
    at = [i for i, s in enumerate(doc["steps"]) if s["eplb"]["rebalance"]]
    assert len(at) == len(history) >= 1 and history[0].moved_slots > 0
    first = doc["steps"][at[0]]["eplb"]
    assert first["phy2log"] != doc["steps"][at[0] - 1]["eplb"]["phy2log"]
    assert first["phy2log"] == history[0].phy2log.tolist()
    path = tmp_path / "eplb.html"
    write_html(run.recorder, path)
    browser.get(path.resolve().as_uri())
    nxt = browser.find_element(By.ID, "btn-next")
    for i in range(len(doc["steps"])):
        if i:
            nxt.click()
        got, want = browser.execute_script(READ_EPLB), expected_eplb(doc, i)
        assert got == want, f"step index {i}: {got!r} != {want!r}"
        assert (browser.find_elements(By.CSS_SELECTOR, '.slot[data-changed="1"]') != []) == (i in at and any(
            doc["steps"][i]["eplb"]["rebalance"]["changed"]))  # type: ignore[index]
    assert not [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]


def test_blocks_that_left_every_window_are_marked(browser: Any, tmp_path: Path) -> None:
    """A model with sliding-window layers: each table's blocks carry whether a sliding
    group still holds them, as the trace's ``windows`` says, step by step."""
    import transformers as T

    from deepinfer_kit import SamplingParams, build_engine
    from deepinfer_kit.viewer import TraceRecorder

    folder = tmp_path / "sliding"
    config = T.Qwen2Config(vocab_size=160, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                           num_key_value_heads=1, intermediate_size=48, use_sliding_window=True, sliding_window=5,
                           max_window_layers=0, layer_types=["sliding_attention", "full_attention"])
    config.architectures = ["Qwen2ForCausalLM"]
    T.Qwen2ForCausalLM(config).save_pretrained(folder)
    engine = build_engine(model=str(folder), block_size=4, num_blocks=48, max_model_len=64)
    recorder = TraceRecorder.attach(engine)
    for n in (21, 9):
        engine.add_request(None, list(range(1, n + 1)), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    engine.run()
    doc = recorder.document()
    path = tmp_path / "sliding.html"
    write_html(recorder, path)
    browser.get(path.resolve().as_uri())
    marks = "return Array.from(document.querySelectorAll('#tables > .trow')).map(r => [r.dataset.request, " \
            "Array.from(r.querySelectorAll('.blk')).map(b => b.getAttribute('data-window'))])"
    nxt = browser.find_element("id", "btn-next")
    for i, step in enumerate(doc["steps"]):
        if i:
            nxt.click()
        b = step["blocks"]
        want = [[rid, ["1" if p in {x for g in b["windows"][rid] for x in g} else "0" for p in table]]
                for rid, table in b["tables"].items()]
        assert browser.execute_script(marks) == want, f"step index {i}"
    assert any(p not in {x for g in s["blocks"]["windows"][rid] for x in g}
               for s in doc["steps"] for rid, t in s["blocks"]["tables"].items() for p in t), "no block left a window"
