"""`syncsgd verify`: 80 columns, the P = 1 rows of two pitfalls explained, --pitfall all."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest
from conftest import run_in_process

from syncsgd.apps.verify import same_sign_ulps, ulp_distance
from syncsgd.training.variants import VARIANTS

pytestmark = pytest.mark.timeout(300)

SMALL = ["--samples", "150", "--features", "5", "--hidden", "7", "--batch-size", "30",
         "--steps", "8", "--seed", "1"]  # fmt: skip


def verify(*args: str) -> subprocess.CompletedProcess:
    """`syncsgd verify args` by its main in this process (tests/test_reproducibility.py runs the
    command in a fresh one)."""
    return run_in_process(["verify", *args])


def test_ulps_are_counted_of_the_larger_value_at_least_one():
    one, two = np.array([1.0, 2.0]), np.array([np.nextafter(1.0, 2.0), np.nextafter(2.0, 3.0)])
    assert ulp_distance(one, two) == 1
    tiny = np.array([1e-20], np.float32)  # near zero: ULPs of 1, not of 1e-20 (about 1e12 of them)
    assert ulp_distance(tiny, 2 * tiny) == 1
    relative = 5.8e-14  # reads as the relative column: max |Δθ| / eps
    ulps = ulp_distance(np.array([0.5, 1e-3]), np.array([0.5, 1e-3 + relative]))
    assert ulps == int(np.ceil(relative / np.spacing(1.0)))


def test_a_sign_flip_is_counted_not_measured_in_ulps():
    a = np.array([1.0, 1e-300, 0.0, 2.0])
    b = np.array([np.nextafter(1.0, 2.0), -1e-300, -0.0, 2.0])
    assert same_sign_ulps(a, b) == (1, 1)  # no 9e18 ULPs from the flip of a tiny element


@pytest.mark.parametrize("pitfall", ["fp32-allreduce", "local-clip"])
def test_the_p1_rows_of_two_pitfalls_are_explained_in_80_columns(pitfall):
    done = verify("--ranks", "1,3", "--exact", "--pitfall", pitfall, "--clip-norm", "0.05",
                  *SMALL)  # fmt: skip
    assert done.returncode == 1, done.stderr
    lines = done.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80
    header = next(i for i, line in enumerate(lines) if "SHA-256" in line)
    assert "bitwise" in lines[header] and lines[header + 1].startswith("  1 ")
    assert lines[header + 1].rstrip().endswith("MISMATCH")
    explained = " ".join(line[2:] for line in lines if line.startswith("# P = 1 differs"))
    assert explained, done.stdout
    if pitfall == "local-clip":  # one rank's clipping only rounds differently
        assert "only in exact mode" in explained
        float_mode = verify("--ranks", "1", "--pitfall", pitfall, "--clip-norm", "0.05", *SMALL)
        assert float_mode.returncode == 0, float_mode.stdout
    else:
        assert "rounded to float32" in explained


def test_no_ulp_cell_holds_a_19_digit_number():
    # The default model: every |θ| <= 1, so the relative distance is max |Δθ| itself.
    done = verify("--ranks", "1,3", "--pitfall", "local-clip", "--clip-norm", "0.05",
                  "--steps", "10")  # fmt: skip
    rows = [line.split() for line in done.stdout.splitlines() if line.startswith(("  1", "  3"))]
    assert len(rows) == 2
    for cells in rows:
        assert len(cells[3]) <= 8 and cells[4].isdigit(), cells  # max ULPs, sign flips
        assert cells[2] == "="
    assert "'='" in done.stdout  # relative equals max |Δθ| when max |θ| <= 1, and it says so


def test_pitfall_all_is_one_row_per_pitfall_with_a_why(tmp_path):
    report = tmp_path / "pitfalls.json"
    done = verify("--pitfall", "all", "--steps", "20", "--json", str(report))
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80
    rows = {line.split()[0]: line.split() for line in lines
            if line.split() and line.split()[0] in VARIANTS}  # fmt: skip
    assert list(rows) == list(VARIANTS)
    header = next(line for line in lines if line.startswith("pitfall "))
    aligned = [line for line in lines if line.split() and line.split()[0] in VARIANTS]
    assert {len(line) for line in aligned} == {len(header)}, aligned  # the longest name too
    for name, kind in VARIANTS.items():
        assert int(rows[name][1]) == kind.shows_at and rows[name][-1] == "yes"
    text = " ".join(line[2:] for line in lines if line.startswith("# "))
    for name, kind in VARIANTS.items():
        assert f"{name}: {kind.why}" in text
    document = json.loads(report.read_text())
    assert [p["pitfall"] for p in document["pitfalls"]] == list(VARIANTS)
    assert all(p["loss"] > 0 and p["serial_loss"] > 0 for p in document["pitfalls"])
