"""What this machine leaves this process: memory, threads, from /proc and its cgroup (Linux)."""

from __future__ import annotations

import os


def numbers(path: str) -> list[int] | None:
    """The integers in a small /proc or /sys file ('max' counts as none), or None if unreadable."""
    try:
        with open(path, encoding="ascii") as file:
            text = file.read()
    except OSError:
        return None
    return [int(word) for word in text.replace("/", " ").split() if word.isdigit()]


def meminfo(field: str) -> int | None:
    """A /proc/meminfo field in bytes, or None."""
    try:
        with open("/proc/meminfo", encoding="ascii") as file:
            for line in file:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def cgroup(name: str) -> tuple[int, int] | None:
    """(limit, current) of a cgroup v2 controller file pair for this process, if limited."""
    base = _cgroup_path()
    if base is None:
        return None
    limit, current = numbers(f"{base}/{name}.max"), numbers(f"{base}/{name}.current")
    if not limit or not current:  # no file, or "max": not limited
        return None
    return limit[0], current[0]


def _cgroup_path() -> str | None:
    """This process's cgroup v2 directory, or None."""
    try:
        with open("/proc/self/cgroup", encoding="ascii") as file:
            unified = [line.split(":", 2)[2].strip() for line in file if line.startswith("0::")]
    except OSError:
        return None
    return "/sys/fs/cgroup" + unified[0] if unified else None


def memory_rooms() -> list[tuple[int, str]]:
    """The memory this process may still allocate, by each limit that applies, and its name."""
    available = meminfo("MemAvailable")
    if available is None:
        available = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    rooms = [(available, "available memory")]
    memory = cgroup("memory")
    if memory is not None:
        rooms.append((memory[0] - memory[1], "the cgroup's memory.max"))
    return rooms


def available_memory() -> int:
    """Bytes this process may still allocate: the tightest of `memory_rooms`."""
    return min(room for room, _ in memory_rooms())


def check_memory(needed: int, what: str) -> None:
    """ValueError, before allocating, if `needed` bytes exceed what the machine has free."""
    free = available_memory()
    if needed > free:
        raise ValueError(f"{what}: about {human_bytes(needed)} of memory needed, "
                         f"{human_bytes(free)} available")  # fmt: skip


def human_bytes(count: float) -> str:
    """'3.2 GiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if count < 1024:
            return f"{count:.3g} {unit}"
        count /= 1024
    return f"{count:.3g} PiB"
