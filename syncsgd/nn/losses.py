"""The losses: the one registry of `--loss`, read from the loss layers' sources.

A loss is a layer file in syncsgd/nn/layers/ whose class sets `kind` (its --loss name),
`labels` (True: its targets are integer class labels and accuracy counts argmax hits; False:
float target rows) and `noun` (what one of its outputs is called: "class", "output"). The
command line reads these without importing Numba; `make_loss` imports the class.
"""

from __future__ import annotations

import ast
import functools
import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LAYERS_DIR = Path(__file__).resolve().parent / "layers"


@dataclass(frozen=True)
class LossEntry:
    """One loss: its --loss name, what its targets are, and its home."""

    kind: str
    labels: bool  # integer class labels (accuracy counts argmax hits); else float target rows
    noun: str  # one output: "class" or "output"
    summary: str
    module: str
    cls: str


@functools.cache
def registry() -> dict[str, LossEntry]:
    """Every loss by its --loss name, in the order of their files."""
    entries = {}
    for path in sorted(LAYERS_DIR.glob("*.py")):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if not isinstance(node, ast.ClassDef):
                continue
            values: dict[str, Any] = {target.id: statement.value.value for statement in node.body
                      if isinstance(statement, ast.Assign)
                      and isinstance(statement.value, ast.Constant)
                      for target in statement.targets if isinstance(target, ast.Name)}  # fmt: skip
            if {"kind", "labels", "noun"} <= values.keys():
                summary = (ast.get_docstring(node) or "").split("\n")[0]
                entries[values["kind"]] = LossEntry(values["kind"], values["labels"],
                                                    values["noun"], summary, path.stem,
                                                    node.name)  # fmt: skip
    # classification first: the default, and the order the help lists them in
    return dict(sorted(entries.items(), key=lambda item: not item[1].labels))


def names() -> tuple[str, ...]:
    """The --loss names."""
    return tuple(registry())


def loss_entry(name: str) -> LossEntry:
    """The loss `name`, or a ValueError listing the losses."""
    entry = registry().get(name) if isinstance(name, str) else None
    if entry is None:
        raise ValueError(f"unknown loss {name!r} (choose {' or '.join(names())})")
    return entry


def make_loss(name: str):  # type: ignore[no-untyped-def]
    """An instance of the loss `name` (importing its module: Numba)."""
    entry = loss_entry(name)
    return getattr(importlib.import_module(f"syncsgd.nn.layers.{entry.module}"), entry.cls)()


__all__ = ["LossEntry", "loss_entry", "make_loss", "names", "registry"]
