"""Every command in docs/tutorial.md runs, in order, and exits as the tutorial says."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest

TUTORIAL = os.path.join(os.path.dirname(__file__), "..", "docs", "tutorial.md")


def tutorial_commands() -> list[tuple[str, int]]:
    """The `$ syncsgd ...` lines of the console blocks, with the exit status they announce."""
    commands = []
    for line in open(TUTORIAL, encoding="utf-8"):
        if line.startswith("$ "):
            command, _, comment = line[2:].partition("#")
            status = re.search(r"exit status (\d+)", comment)
            commands.append((command.strip(), int(status.group(1)) if status else 0))
    return commands


def test_the_tutorial_has_commands():
    commands = tutorial_commands()
    assert len(commands) >= 10 and all(c.startswith("syncsgd ") for c, _ in commands)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """One directory for the whole tutorial: later commands read what earlier ones wrote."""
    return tmp_path_factory.mktemp("tutorial")


@pytest.mark.parametrize(("command", "status"), tutorial_commands(), ids=lambda v: str(v)[:60])
def test_tutorial_command(workdir, command, status):
    argv = [sys.executable, "-m", "syncsgd.cli", *shlex.split(command)[1:]]
    done = subprocess.run(argv, cwd=workdir, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "MPLBACKEND": "Agg"})  # fmt: skip
    assert done.returncode == status, f"{command}\n{done.stdout}\n{done.stderr}"
    assert "Traceback" not in done.stderr
