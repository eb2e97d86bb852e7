"""``deepinfer-kit sim``: a sweep prints its table and writes CSV and JSON; bad input is
an error message, not a traceback."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from deepinfer_kit.cli import main


def test_sim_sweep_prints_a_table_and_writes_csv_and_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_csv, out_json, trace = tmp_path / "s.csv", tmp_path / "s.json", tmp_path / "t.jsonl"
    rc = main(["sim", "--num-requests", "200", "--rate", "100", "--multi-turn-fraction", "0.3",
               "--sweep", "block_size=16,32", "--csv", str(out_csv), "--json", str(out_json),
               "--save-trace", str(trace), "--no-progress"])
    assert rc == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split()[0] == "block_size" and len(lines) == 3
    rows = list(csv.DictReader(out_csv.open()))
    assert [r["block_size"] for r in rows] == ["16", "32"]
    assert all(int(r["requests"]) == 200 for r in rows)
    data = json.loads(out_json.read_text())
    assert data["field"] == "block_size" and len(data["runs"]) == 2
    assert main(["sim", "--workload", str(trace), "--no-progress"]) == 0  # the trace replays
    assert capsys.readouterr().out.splitlines()[1].split()[1] == "200"


def test_sim_prints_latencies_per_priority_level(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_csv = tmp_path / "p.csv"
    rc = main(["sim", "--num-requests", "150", "--rate", "100", "--priority-levels", "3",
               "--sweep", "scheduler_policy=fcfs,priority", "--csv", str(out_csv), "--no-progress"])
    assert rc == 0
    text = capsys.readouterr().out
    table = text.split("per priority level (ms):\n")[1].strip().splitlines()
    assert table[0].split()[:3] == ["scheduler_policy", "priority", "requests"]
    body = [line.split() for line in table[1:]]
    assert [(r[0], r[1]) for r in body] == [(p, lvl) for p in ("fcfs", "priority")
                                            for lvl in ("0", "1", "2")]
    for policy in ("fcfs", "priority"):
        assert sum(int(r[2]) for r in body if r[0] == policy) == 150
    rows = list(csv.DictReader(out_csv.open()))
    assert sum(int(rows[0][f"prio{k}_requests"]) for k in range(3)) == 150


def test_sim_rejects_bad_flags_with_a_message(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", "--sweep", "nonsense=1,2"]) == 2
    assert "EngineConfig field" in capsys.readouterr().err
    assert main(["sim", "--set", "max_num_seqs=0", "--num-requests", "5"]) == 2
    assert "max_num_seqs" in capsys.readouterr().err


def test_the_sim_command_does_not_import_torch() -> None:
    """The simulator needs no model: ``deepinfer-kit sim`` starts without torch (an
    import of it costs more than a thousand simulated requests)."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from deepinfer_kit.cli import main\n"
        "raise SystemExit(main(['sim', '--num-requests', '20', '--no-progress']))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
