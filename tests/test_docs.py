"""docs/reference.md is what `python -m syncsgd.apps.reference` generates from the declarations."""

from __future__ import annotations

import re
import subprocess
import sys

from syncsgd.apps import reference


def test_the_reference_is_generated_from_the_declarations():
    committed = reference.REFERENCE.read_text(encoding="utf-8")
    assert committed == reference.render(), (
        f"docs/reference.md is out of date: regenerate it with `{reference.COMMAND}`"
    )


def test_the_reference_names_every_command_and_layer():
    text = reference.render()
    for line in ("syncsgd train", "syncsgd verify", "syncsgd study batch-size",
                 "syncsgd bench step", "syncsgd cluster"):  # fmt: skip
        assert f"## `{line}`" in text
    for flag in ("--ranks", "--model", "--exact", "--pitfall", "--overlap", "--json"):
        assert f"| `{flag}` |" in text
    for layer in ("`dense(width)`", "`conv(out_channels, kernel, stride=1, pad=0)`",
                  "`block(d, heads)`"):
        assert layer in text
    assert "| `params_sha256` |" in text and "| `steady_seconds` |" in text


def test_the_reference_module_prints_and_writes(tmp_path, monkeypatch):
    done = subprocess.run([sys.executable, "-m", "syncsgd.apps.reference"], capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout == reference.render()
    monkeypatch.setattr(reference, "REFERENCE", tmp_path / "reference.md")
    assert reference.main(["--write"]) == 0
    assert (tmp_path / "reference.md").read_text(encoding="utf-8") == done.stdout


def test_the_site_lists_every_page_of_docs():
    """mkdocs.yml's nav names every page of docs/ (mkdocs build --strict refuses an omitted one;
    this says so without mkdocs installed)."""
    root = reference.REFERENCE.parents[1]
    listed = set(re.findall(r"^\s*- (?:[^:\n]+: )?([\w-]+\.md)$", (root / "mkdocs.yml").read_text(
        encoding="utf-8"), flags=re.MULTILINE))  # fmt: skip
    pages = {path.name for path in (root / "docs").glob("*.md")}
    assert listed == pages, f"add to mkdocs.yml's nav: {pages - listed}; gone: {listed - pages}"
