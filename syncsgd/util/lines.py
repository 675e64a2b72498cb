"""Lines on stderr that several processes may print at once (every rank of an MPI job)."""

from __future__ import annotations

import sys


def print_line(text: str) -> None:
    """`text` and its newline on stderr in one write, so that ranks' lines never interleave."""
    # print() writes the text and the newline separately, and stderr writes through: two
    # system calls, between which another rank's line can land on the same pipe.
    sys.stderr.write(text + "\n")
    sys.stderr.flush()
