"""What `syncsgd lab check` hands a student's function: a communicator that counts and names.

`LabComm` wraps one rank's communicator (thread ranks' or MPI's) and offers only the
point-to-point methods a lab allows - `Get_rank`, `Get_size`, `Send`, `Recv`, `Sendrecv`,
`Isend`, `Irecv` and `Wait` on their requests - so that an answer cannot call the library's own
collective. It counts the messages and bytes each rank sends, to whom, and while a call waits it
names it (the call's number, its peer, the student's line) in the rank's watchdog record: a
collective timeout, on threads or under MPI, then says where each rank waited.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass, field
from typing import Any

from syncsgd.comm.watchdog import watching

ALLOWED = ("Get_rank", "Get_size", "Send", "Recv", "Sendrecv", "Isend", "Irecv")


@dataclass
class Counts:
    """What one rank's answer sent: messages, bytes, and bytes to each destination."""

    messages: int = 0
    sent: int = 0
    to: dict[int, int] = field(default_factory=dict)

    def add(self, dest: int, nbytes: int) -> None:
        self.messages += 1
        self.sent += nbytes
        self.to[dest] = self.to.get(dest, 0) + nbytes


def nbytes(buf: Any) -> int:
    """The bytes of a message buffer (an array, a memoryview, or mpi4py's [buf, type])."""
    if isinstance(buf, (list, tuple)):
        buf = buf[0]
    return memoryview(buf).nbytes


def student_line(path: str) -> str:
    """Where the student's code is now: `file.py:LINE` of the innermost frame in `path`."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename == path:
            return f"{os.path.basename(path)}:{frame.f_lineno}"
        frame = frame.f_back  # type: ignore[assignment]
    return "outside the answer's file"


class LabRequest:
    """A request of Isend or Irecv whose Wait names the call while it waits."""

    def __init__(self, comm: LabComm, request: Any, what: str, peer: int | None) -> None:
        self._comm, self._request, self._what, self._peer = comm, request, what, peer

    def Wait(self, status: Any = None) -> None:  # noqa: N802 - mpi4py's name
        where = self._comm.calling(f"Wait for {self._what}")
        with watching(where, self._peer):
            self._request.Wait(status)
        self._comm.waiting = None

    def Test(self) -> bool:  # noqa: N802
        return bool(self._request.Test())


class LabComm:
    """One rank's communicator as the lab offers it: point to point only, counted and named."""

    def __init__(self, comm: Any, path: str, name: str) -> None:
        self._comm, self._path, self._name = comm, path, name
        self.unwatched = comm  # the communicator within (as watchdog.Watched): its constants
        self.counts = Counts()
        self.calls = 0
        self.waiting: str | None = None  # the call this rank is in, while it is in one

    def __repr__(self) -> str:
        return f"LabComm(rank={self.Get_rank()}, size={self.Get_size()})"

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(
            f"the lab's communicator has no {name}: an answer may call only "
            f"{', '.join(ALLOWED)} (and Wait on a request) - write the collective from these"
        )

    def calling(self, what: str) -> str:
        """Count a call and name it: `name: call 3, Recv from rank 2 (ring.py:17)`."""
        self.calls += 1
        self.waiting = (f"{self._name}: call {self.calls}, {what} "
                        f"({student_line(self._path)})")  # fmt: skip
        return self.waiting

    def Get_rank(self) -> int:  # noqa: N802
        return int(self._comm.Get_rank())

    def Get_size(self) -> int:  # noqa: N802
        return int(self._comm.Get_size())

    @property
    def rank(self) -> int:
        return self.Get_rank()

    @property
    def size(self) -> int:
        return self.Get_size()

    def Send(self, buf: Any, dest: int, tag: int = 0) -> None:  # noqa: N802
        self.counts.add(dest, nbytes(buf))
        with watching(self.calling(f"Send to rank {dest}"), dest):
            self._comm.Send(buf, dest, tag)
        self.waiting = None

    def Recv(self, buf: Any, source: int = -1, tag: int = -1, status: Any = None) -> None:  # noqa: N802
        source, tag = self._any(source, tag)
        with watching(self.calling(f"Recv from {_peer(source)}"), _known(source)):
            self._comm.Recv(buf, source, tag, status)
        self.waiting = None

    def Sendrecv(self, sendbuf: Any, dest: int, sendtag: int = 0, recvbuf: Any = None,  # noqa: N802
                 source: int = -1, recvtag: int = -1, status: Any = None) -> None:  # fmt: skip
        source, recvtag = self._any(source, recvtag)
        self.counts.add(dest, nbytes(sendbuf))
        what = f"Sendrecv to rank {dest}, from {_peer(source)}"
        with watching(self.calling(what), _known(source)):
            self._comm.Sendrecv(sendbuf, dest, sendtag, recvbuf, source, recvtag, status)
        self.waiting = None

    def Isend(self, buf: Any, dest: int, tag: int = 0) -> LabRequest:  # noqa: N802
        self.counts.add(dest, nbytes(buf))
        self.calls += 1
        return LabRequest(self, self._comm.Isend(buf, dest, tag), f"Isend to rank {dest}", dest)

    def Irecv(self, buf: Any, source: int = -1, tag: int = -1) -> LabRequest:  # noqa: N802
        source, tag = self._any(source, tag)
        self.calls += 1
        request = self._comm.Irecv(buf, source, tag)
        return LabRequest(self, request, f"Irecv from {_peer(source)}", _known(source))

    def _any(self, source: int, tag: int) -> tuple[int, int]:
        """-1 (the thread communicator's ANY_SOURCE, ANY_TAG) as this communicator's own."""
        if source != -1 and tag != -1:
            return source, tag
        from syncsgd.comm.world import constants

        mpi = constants(self._comm)
        return (mpi.ANY_SOURCE if source == -1 else source), (mpi.ANY_TAG if tag == -1 else tag)


def _peer(source: int) -> str:
    return f"rank {source}" if source >= 0 else "any rank"


def _known(source: int) -> int | None:
    return source if source >= 0 else None


@dataclass(frozen=True)
class Answer:
    """A student's function, loaded from its file."""

    path: str  # absolute: the code objects' co_filename
    name: str
    function: Any


def load_answer(spec: str, default: str) -> Answer:
    """SOURCE[:FUNCTION] -> the function (FUNCTION: `default` if not given); one-line errors."""
    path, _, name = spec.partition(":")
    if ":" in name:
        raise ValueError(f"{spec}: give SOURCE or SOURCE:FUNCTION")
    name = name or default
    from syncsgd.util.files import check_regular_file

    check_regular_file(path, "the answer's file")
    if not path.endswith(".py"):
        raise ValueError(f"{path}: the answer must be a Python file (.py)")
    full = os.path.abspath(path)
    module = _module(full, path)
    function = getattr(module, name, None)
    if not callable(function):
        found = sorted(key for key, value in vars(module).items()
                       if callable(value) and getattr(value, "__module__", "") == module.__name__)
        offer = f" (its functions: {', '.join(found)})" if found else " (it defines no function)"
        raise ValueError(f"{path} has no function {name}{offer}; name it as SOURCE:FUNCTION")
    return Answer(full, name, function)


def _module(full: str, shown: str) -> Any:
    """Run the answer's file as a module of its own; an error in it is one line naming it."""
    module_name = "syncsgd_lab_answer_" + str(abs(hash(full)))
    spec = importlib.util.spec_from_file_location(module_name, full)
    if spec is None or spec.loader is None:
        raise ValueError(f"{shown}: cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except SyntaxError as exc:
        raise ValueError(f"{shown}:{exc.lineno}: syntax error: {exc.msg}") from None
    except Exception as exc:  # noqa: BLE001 - the student's file: one line, where
        raise ValueError(f"{shown}: importing it raised {raised(exc, full)}") from None
    return module


def raised(exc: BaseException, path: str) -> str:
    """`IndexError: ... (ring.py:17)`: an exception and the answer's line it came from."""
    line = None
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == path:
            line = f"{os.path.basename(path)}:{tb.tb_lineno}"
        tb = tb.tb_next
    where = f" ({line})" if line else ""
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}{where}"
