"""Render the mechanism pages' pictures from real runs: one viewer panel per PNG in docs/img/.

    PYTHONPATH=src .venv/bin/python scripts/render_doc_pictures.py [--out docs/img]

Three seeded runs of the embedded tiny model (a mixed run with a shared prompt prefix, a
fork, logprobs, a small pool and n-gram drafts; the same requests with overlap; a live-EPLB
run) are recorded with TraceRecorder and written as viewer pages. Headless Chromium
(selenium, /usr/bin/chromium, chromedriver) opens each page at a chosen step, picked from
the trace by what the picture must show, and screenshots one panel (the element alone, so
each PNG is cropped to its panel). Prints each file, its step and size.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from deepinfer_kit import SamplingParams, build_engine
from deepinfer_kit.viewer import TraceDoc, TraceRecorder, write_html
from deepinfer_kit.viewer.schema import StepDoc

PREFIX = list(range(1, 14))  # 13 tokens: three full blocks of 4 shared by several prompts


def record(**config: object) -> TraceDoc:
    """A seeded run on the tiny model; ``config`` adds engine options (overlap, eplb, ...)."""
    engine = build_engine(model="tiny", num_blocks=16, block_size=4, max_model_len=64,
                          max_num_batched_tokens=16, max_num_seqs=6, **config)
    recorder = TraceRecorder.attach(engine, model="tiny")
    greedy = SamplingParams(temperature=0.0, max_tokens=12, logprobs=3)
    arrivals = {
        0: [("a", PREFIX + [20, 21], greedy),
            ("b", PREFIX + [30], SamplingParams(temperature=0.9, top_k=8, seed=7, n=2, max_tokens=10, logprobs=3)),
            ("c", [40, 41, 42, 43, 44, 45], SamplingParams(top_p=0.9, seed=3, max_tokens=14))],
        7: [("d", PREFIX + [50], greedy)],
        14: [("e", PREFIX + [60, 61], SamplingParams(min_p=0.05, seed=4, max_tokens=10, logprobs=3))],
    }
    step = 0
    while engine.has_unfinished_requests() or step <= max(arrivals):
        for rid, prompt, params in arrivals.get(step, []):
            engine.add_request(rid, prompt, params)
        engine.step()
        step += 1
    engine.flush()
    engine.check_idle()
    return recorder.document()


def first(doc: TraceDoc, what: str, want: Callable[[StepDoc], bool]) -> int:
    """The index of the first step for which ``want`` holds (else SystemExit naming it)."""
    for i, step in enumerate(doc["steps"]):
        if want(step):
            return i
    raise SystemExit(f"no step shows {what}; change the scenario")


# (png name, run, panel id, what the step must show, the test)
SHOTS: list[tuple[str, str, str, str, Callable[[StepDoc], bool]]] = [
    ("budget_bar.png", "mixed", "panel-queues", "prefill and decode chunks filling the budget",
     lambda s: len({c["kind"] for c in s["chunks"]}) == 2 and s["batched_tokens"] == s["budget"]),
    ("block_tables.png", "mixed", "panel-blocks", "shared blocks and a copy-on-write copy",
     lambda s: bool(s["blocks"]["shared"]) and bool(s["blocks"]["copies"])),
    ("prefix_hits.png", "mixed", "panel-blocks", "a prefix hit on a late arrival",
     lambda s: any(len(b) >= 3 for b in s["blocks"]["prefix_hits"].values()) and s["step"] > 0),
    ("sampling.png", "mixed", "panel-sampling", "candidates of a fork and of a greedy draw",
     lambda s: len([x for x in s["sampling"] if x["candidates"]]) >= 3),
    ("speculative.png", "mixed", "panel-spec", "accepted and rejected drafts",
     lambda s: any(0 < c["accepted"] < c["verified"] for c in s["chunks"])),
    ("overlap.png", "overlap", "panel-tokens", "tokens committed a step late",
     lambda s: s["step"] >= 8 and len(s["chunks"]) >= 3),
    ("expert_load.png", "eplb", "panel-experts", "the first step after a rebalance",
     lambda s: s.get("eplb", {}).get("rebalance") is not None),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/img", help="folder for the PNGs")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By

    runs = {
        "mixed": record(speculative={"drafter": "ngram", "num_draft": 3}),
        "overlap": record(overlap=True),
        "eplb": record(eplb={"window": 4, "interval": 6, "num_redundant": 4, "num_gpus": 4}),
    }
    pages = Path(tempfile.mkdtemp())
    for name, doc in runs.items():
        write_html(doc, pages / f"{name}.html")
    options = Options()
    options.binary_location = shutil.which("chromium") or "/usr/bin/chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1000,1600",
                "--force-device-scale-factor=1", "--hide-scrollbars"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver") or "/usr/bin/chromedriver"),
                              options=options)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        for png, run, panel, what, want in SHOTS:
            doc = runs[run]
            index = first(doc, what, want)
            # Opened at the step itself: nothing is mid-transition from an earlier state.
            driver.get("about:blank")  # a new hash alone would not reload the page
            driver.get((pages / f"{run}.html").resolve().as_uri() + f"#step={index}")
            assert driver.execute_script("return window.deepinferViewer.current()") == index
            time.sleep(0.6)  # let the entry animations (0.4 s) finish
            section = driver.find_element(By.ID, panel)
            # Own height, not the grid row's (a short panel beside a tall one).
            driver.execute_script("arguments[0].style.alignSelf = 'start'; arguments[0].scrollIntoView();", section)
            (out / png).write_bytes(section.screenshot_as_png)
            print(f"{out / png}: {run} run, step {doc['steps'][index]['step']} ({what}), "
                  f"{(out / png).stat().st_size // 1024} KB")
    finally:
        driver.quit()


if __name__ == "__main__":
    main()
