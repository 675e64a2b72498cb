"""The README's Python examples run as written, in a scratch directory holding their data.csv."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest

README = os.path.join(os.path.dirname(__file__), os.pardir, "README.md")


def python_blocks() -> list[str]:
    with open(README, encoding="utf-8") as handle:
        return re.findall(r"```python\n(.*?)```", handle.read(), flags=re.DOTALL)


def test_the_readme_has_python_examples():
    assert len(python_blocks()) >= 2


@pytest.mark.timeout(300)
@pytest.mark.parametrize("number", range(len(python_blocks())))
def test_readme_python_example_runs(number, tmp_path):
    rng = np.random.default_rng(0)
    X = rng.normal(size=(256, 3))
    rows = np.column_stack([X, X @ np.array([1.0, -2.0, 0.5])])  # the last column is the target
    np.savetxt(tmp_path / "data.csv", rows, delimiter=",", header="a,b,c,y", comments="")
    done = subprocess.run(
        [sys.executable, "-c", python_blocks()[number]], cwd=tmp_path, capture_output=True,
        text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip(), "an example prints what it shows"
