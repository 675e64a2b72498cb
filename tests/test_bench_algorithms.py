"""`syncsgd bench allreduce --algorithms ... --timeline`: every algorithm timed in one run."""

from __future__ import annotations

import json
import subprocess
import sys

from syncsgd.collectives import ALGORITHMS


def bench(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "syncsgd.cli", "bench", "allreduce", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


def test_every_algorithm_is_timed_against_the_library_with_a_timeline(tmp_path):
    names = [name for name in ALGORITHMS if name != "mpi"]
    report, timeline = tmp_path / "sweep.json", tmp_path / "timeline.json"
    done = bench("--ranks", "3", "--max-bytes", "256", "--batches", "1", "--warmup", "1",
                 "--algorithms", ",".join(names), "--json", str(report),
                 "--timeline", str(timeline))  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = json.loads(report.read_text())["rows"]
    sizes = sorted({row["size_bytes"] for row in rows})
    assert sizes == [8, 16, 32, 64, 128, 256]
    for size in sizes:
        assert sorted(r["algorithm"] for r in rows if r["size_bytes"] == size) == sorted(
            [*names, "numpy-sum"]  # the library's stand-in on thread ranks
        )
    events = json.loads(timeline.read_text())["traceEvents"]
    calls = [e for e in events if e.get("cat") == "call"]
    assert {e["tid"] for e in calls} == {0, 1, 2}
    assert len(calls) == 3 * len(sizes) * (len(names) + 1)
    ring_steps = [e for e in events if e.get("cat") == "allreduce" and e["tid"] == 0
                  and e["name"].startswith(("reduce-scatter", "allgather"))]  # fmt: skip
    assert len(ring_steps) >= len(sizes) * 2 * (3 - 1)  # the ring's 2(P-1) steps, at least


def test_an_unknown_algorithm_is_one_line():
    done = bench("--algorithms", "ring,bogus")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
    assert "bogus" in done.stderr
