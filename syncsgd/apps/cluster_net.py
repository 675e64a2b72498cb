"""Emulated nodes: network namespaces joined by a bridge, each link shaped by a token bucket."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

# The benchmarking range (RFC 2544): never routed on the Internet. Every address lives on a link
# inside namespaces made here; the machine's own namespace gets none, so nothing can leave.
NETWORK = ipaddress.ip_network("198.18.0.0/15")
PREFIX = "syncsgd-"  # every namespace this module makes is named PREFIX + pid + "-" + role
NODE_DEVICE = "eth0"  # the link's name inside every node: MPI is told to use it and only it
MIN_BURST = 256 << 10  # tbf's bucket: at least a few 64 KiB GSO packets, or tbf drops them


@dataclass(frozen=True)
class Node:
    """One emulated host: its namespace and its address on the emulated network."""

    index: int
    namespace: str
    address: str


@dataclass(frozen=True)
class Cluster:
    """The emulated network: the switch's namespace (holding the bridge) and the nodes."""

    switch: str
    nodes: tuple[Node, ...]
    rate_bits: int | None


def unsupported() -> str | None:
    """Why this machine cannot emulate a cluster, or None if it can."""
    if not sys.platform.startswith("linux"):
        return "needs Linux (network namespaces and tc)"
    if os.geteuid() != 0:
        return "needs root (network namespaces and tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs the `{tool}` command (iproute2)"
    return None


def parse_rate(text: str) -> int:
    """A link rate like 1gbit, 100mbit, 2.5gbit or 1e9 as bits per second."""
    units = {"kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12, "bit": 1}
    lowered = text.strip().lower()
    scale = 1
    for unit, factor in units.items():
        if lowered.endswith(unit):
            lowered, scale = lowered[: -len(unit)], factor
            break
    try:
        bits = float(lowered) * scale
    except ValueError:
        raise ValueError(f"not a link rate: {text!r} (e.g. 1gbit, 100mbit)") from None
    if not 8000 <= bits <= 10**12:
        raise ValueError(f"link rate {text!r} out of range (8kbit to 1tbit)")
    return int(bits)


def run(*command: str) -> None:
    """Run one ip/tc command; its error output becomes the exception's message."""
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(command)}` failed: {done.stderr.strip()}")


def in_namespace(namespace: str, *command: str) -> None:
    """Run one command inside a namespace."""
    run("ip", "netns", "exec", namespace, *command)


def namespaces() -> list[str]:
    """The names of the network namespaces that exist now."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in listed.splitlines() if line.strip()]


def shape(namespace: str, device: str, rate_bits: int | None) -> None:
    """Limit what `device` sends to `rate_bits` by a token bucket (nothing if no rate)."""
    if rate_bits is None:
        return
    burst = max(MIN_BURST, rate_bits // 8 // 1000)  # a millisecond of traffic at least
    in_namespace(namespace, "tc", "qdisc", "add", "dev", device, "root", "tbf",
                 "rate", f"{rate_bits}bit", "burst", str(burst), "latency", "100ms")  # fmt: skip


def _add_node(cluster_id: str, switch: str, index: int, address: str, rate: int | None) -> Node:
    """One node: its namespace, a veth to the switch's bridge, shaped both ways."""
    namespace = f"{PREFIX}{cluster_id}-n{index}"
    run("ip", "netns", "add", namespace)
    outer = f"n{index}"  # names are per namespace: short and fixed
    run("ip", "link", "add", NODE_DEVICE, "netns", namespace, "type", "veth",
        "peer", "name", outer, "netns", switch)  # fmt: skip
    in_namespace(switch, "ip", "link", "set", outer, "master", "br0", "up")
    in_namespace(namespace, "ip", "addr", "add", f"{address}/{NETWORK.prefixlen}",
                 "dev", NODE_DEVICE)  # fmt: skip
    in_namespace(namespace, "ip", "link", "set", NODE_DEVICE, "up")
    in_namespace(namespace, "ip", "link", "set", "lo", "up")
    shape(namespace, NODE_DEVICE, rate)  # what the node sends
    shape(switch, outer, rate)  # what the node receives
    return Node(index, namespace, address)


@contextlib.contextmanager
def emulated(nodes: int, rate_bits: int | None) -> Iterator[Cluster]:
    """N nodes on one switch for the duration of the `with`; every namespace is deleted after."""
    cluster_id = str(os.getpid())
    switch = f"{PREFIX}{cluster_id}-switch"
    made: list[str] = []
    try:
        run("ip", "netns", "add", switch)
        made.append(switch)
        in_namespace(switch, "ip", "link", "add", "br0", "type", "bridge")
        in_namespace(switch, "ip", "link", "set", "br0", "up")
        hosts = NETWORK.hosts()
        members = []
        for index in range(nodes):
            made.append(f"{PREFIX}{cluster_id}-n{index}")
            members.append(_add_node(cluster_id, switch, index, str(next(hosts)), rate_bits))
        yield Cluster(switch, tuple(members), rate_bits)
    finally:
        teardown(made)


def teardown(names: list[str]) -> None:
    """End what still runs in these namespaces, then delete them (veths, bridge, qdiscs too)."""
    existing = set(namespaces())
    for name in reversed(names):
        if name not in existing:
            continue
        listed = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True)
        for pid in listed.stdout.split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)  # a rank left behind would hold the namespace
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def stale() -> list[str]:
    """Namespaces of clusters whose process is gone (killed before it could tear down)."""
    found = []
    for name in namespaces():
        owner = name[len(PREFIX):].split("-")[0] if name.startswith(PREFIX) else ""
        if owner.isdigit() and not os.path.exists(f"/proc/{owner}"):
            found.append(name)
    return found
