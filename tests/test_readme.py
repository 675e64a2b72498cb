"""The Python examples of the README, docs/api.md and docs/architecture.md run as written, in a
scratch directory holding their data.csv."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.join(os.path.dirname(__file__), os.pardir)
DOCUMENTS = ("README.md", os.path.join("docs", "api.md"), os.path.join("docs", "architecture.md"))


def python_blocks(documents: tuple[str, ...] = DOCUMENTS) -> list[str]:
    blocks = []
    for document in documents:
        with open(os.path.join(ROOT, document), encoding="utf-8") as handle:
            blocks += re.findall(r"```python\n(.*?)```", handle.read(), flags=re.DOTALL)
    return blocks


def test_the_readme_and_the_api_page_have_python_examples():
    assert len(python_blocks(("README.md",))) >= 1
    assert len(python_blocks((os.path.join("docs", "api.md"),))) >= 3


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
