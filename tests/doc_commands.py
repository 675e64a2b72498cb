"""The `syncsgd ...` command lines of the shell blocks of README.md and docs/*.md."""

from __future__ import annotations

import glob
import os
import re
import shlex
from dataclasses import dataclass

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)
SHELL_BLOCK = re.compile(r"^```(bash|sh|shell|console)\n(.*?)^```", re.DOTALL | re.MULTILINE)
ASSIGNMENT = re.compile(r"^([A-Za-z_]\w*)=(.*)$")
LAUNCHERS = ("mpiexec", "mpirun", "srun", "sudo")


@dataclass(frozen=True)
class Documented:
    """One documented command: where it is, its text as written, and the status it announces."""

    document: str  # e.g. README.md, docs/train.md
    text: str  # the command, its `$ ` prompt, comment and line continuations removed
    status: int  # "exit status N" in its comment, else 0

    @property
    def argv(self) -> list[str]:
        return shlex.split(self.text)

    @property
    def launcher(self) -> list[str]:
        """What comes before `syncsgd` (mpiexec -n 2, sudo, srun -n 64), or nothing."""
        argv = self.argv
        return argv[: argv.index("syncsgd")]

    @property
    def arguments(self) -> list[str]:
        """The arguments of syncsgd, after its name."""
        argv = self.argv
        return argv[argv.index("syncsgd") + 1 :]


def documents() -> list[str]:
    """README.md and every page of docs/, relative to the repository's root."""
    pages = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
    return ["README.md", *pages]


def commands(document: str) -> list[Documented]:
    """Every `syncsgd` command line of `document`'s bash/sh/console blocks, in order; a shell
    variable assigned earlier in its block (M="...") is substituted."""
    with open(os.path.join(ROOT, document), encoding="utf-8") as handle:
        text = handle.read()
    found = []
    for _, block in SHELL_BLOCK.findall(text):
        variables: dict[str, str] = {}
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip()
            line = line[2:] if line.startswith("$ ") else line
            command, _, comment = line.partition(" #")
            command = "" if command.startswith("#") else command.strip()
            assigned = ASSIGNMENT.match(command)
            if assigned:
                variables[assigned.group(1)] = shlex.split(assigned.group(2))[0]
                continue
            for name, value in variables.items():
                command = command.replace(f'"${name}"', shlex.quote(value))
            status = re.search(r"exit status (\d+)", comment)
            for part in command.split("&&"):
                part = " ".join(part.split())
                words = shlex.split(part) if part else []
                if "syncsgd" in words and (words[0] == "syncsgd" or words[0] in LAUNCHERS):
                    found.append(Documented(document, part, int(status.group(1)) if status else 0))
    return found


def every_command() -> list[Documented]:
    """The commands of every document, README.md first."""
    return [command for document in documents() for command in commands(document)]


if __name__ == "__main__":
    for command in every_command():
        print(f"{command.document}\t{command.status}\t{command.text}")
