"""Every command in docs/tutorial.md and docs/instructor.md runs, in order, and exits as it says
(the first of each subcommand in a fresh Python, the others by syncsgd's main in this process)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest
from conftest import run_in_process

DOCS = os.path.join(os.path.dirname(__file__), "..", "docs")
TUTORIAL = os.path.join(DOCS, "tutorial.md")
INSTRUCTOR = os.path.join(DOCS, "instructor.md")


def tutorial_commands(path: str = TUTORIAL) -> list[tuple[str, int]]:
    """The `$ syncsgd ...` lines of the console blocks, with the exit status they announce."""
    commands = []
    for line in open(path, encoding="utf-8"):
        if line.startswith("$ "):
            command, _, comment = line[2:].partition("#")
            status = re.search(r"exit status (\d+)", comment)
            commands.append((command.strip(), int(status.group(1)) if status else 0))
    return commands


def test_the_tutorial_has_commands():
    commands = tutorial_commands()
    assert len(commands) >= 10 and all(c.startswith("syncsgd ") for c, _ in commands)
    guide = tutorial_commands(INSTRUCTOR)
    assert len(guide) >= 5 and all(c.startswith("syncsgd ") for c, _ in guide)


def test_every_exercise_has_a_model_answer():
    asked = re.findall(r"^\*\*Exercise (\w+)\.\*\*", open(TUTORIAL, encoding="utf-8").read(),
                       re.MULTILINE)  # fmt: skip
    answered = re.findall(r"^\*\*Exercise (\w+)\*\* \(", open(INSTRUCTOR, encoding="utf-8").read(),
                          re.MULTILINE)  # fmt: skip
    assert len(asked) >= 8 and sorted(asked) == sorted(answered)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """One directory for the whole tutorial: later commands read what earlier ones wrote."""
    return tmp_path_factory.mktemp("tutorial")


# What each command printed, by (workdir, command): a command the two documents (or the figures'
# test) share runs once, and its files stay in the shared workdir for whoever reads them.
_finished: dict[tuple[str, str], subprocess.CompletedProcess] = {}


def subcommand(command: str) -> tuple[str, ...]:
    """The subcommand a command runs: train, ring-demo, ...; bench step, study batch-size, ..."""
    arguments = shlex.split(command)[1:]
    return tuple(arguments[:2] if arguments[0] in ("bench", "study", "lab") else arguments[:1])


def in_fresh_processes() -> set[str]:
    """The first command of each subcommand in each document: these run in a fresh Python, the
    others by syncsgd's main in the test's own process (the same parser, checks and run)."""
    fresh = set()
    for path in (TUTORIAL, INSTRUCTOR):
        first: dict[tuple[str, ...], str] = {}
        for command, _ in tutorial_commands(path):
            first.setdefault(subcommand(command), command)
        fresh |= set(first.values())
    return fresh


FRESH = in_fresh_processes()


def run_command(workdir, command: str, status: int) -> subprocess.CompletedProcess:
    """Run a documented command in `workdir` (once) and check its exit status."""
    key = (str(workdir), command)
    if key not in _finished and command not in FRESH:
        _finished[key] = run_in_process(shlex.split(command)[1:], workdir)
    if key not in _finished:
        argv = [sys.executable, "-m", "syncsgd.cli", *shlex.split(command)[1:]]
        _finished[key] = subprocess.run(argv, cwd=workdir, capture_output=True, text=True,
                                        timeout=300, env={**os.environ, "MPLBACKEND": "Agg"})
    done = _finished[key]
    assert done.returncode == status, f"{command}\n{done.stdout}\n{done.stderr}"
    assert "Traceback" not in done.stderr
    return done


@pytest.mark.parametrize(("command", "status"), tutorial_commands(), ids=lambda v: str(v)[:60])
def test_tutorial_command(workdir, command, status):
    run_command(workdir, command, status)


@pytest.mark.parametrize(("command", "status"), tutorial_commands(INSTRUCTOR),
                         ids=lambda v: str(v)[:60])  # fmt: skip
def test_instructor_command(workdir, command, status):
    run_command(workdir, command, status)


def test_the_instructors_figures_are_what_the_guide_says(workdir):
    """The slides the guide prepares: one frame per round, the page, the model figure."""
    run_command(workdir, "syncsgd ring-demo --ranks 4 --length 8 --frames ring4 --html ring4.html",
                0)  # fmt: skip
    frames = sorted(p.name for p in (workdir / "ring4").iterdir())
    assert frames == [f"step-{k:03d}.png" for k in range(7)]
    assert "2(P−1)/P·n = 96 bytes" in (workdir / "ring4.html").read_text(encoding="utf-8")
    done = run_command(workdir, "syncsgd model --ranks 1024 --sizes 1M --alpha 4e-6", 0)
    assert "ring overtakes recursive-doubling above 5.04 MiB" in done.stdout
    done = run_command(workdir, "syncsgd model --ranks 1024 --sizes 1M", 0)
    assert "ring overtakes recursive-doubling above 2.52 MiB" in done.stdout
    done = run_command(workdir, "syncsgd ring-demo --ranks 3 --length 2 --algorithm tree", 0)
    assert "4 rounds" in done.stdout and "4α" in done.stdout
    # exercise 1's losses and accuracies are deterministic: the guide quotes them
    for hidden, quoted in (("", "final loss 0.278171, accuracy 0.9043"),
                           ("128,128", "final loss 0.219218, accuracy 0.9175")):  # fmt: skip
        done = run_command(workdir, f"syncsgd train --ranks 1 --steps 100 --hidden '{hidden}'", 0)
        assert quoted in done.stdout
