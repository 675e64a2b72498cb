"""One MPI job across the emulated nodes: MPICH's hydra or Open MPI's mpirun, kept on the links."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys

from syncsgd.apps.cluster_net import NODE_DEVICE, Cluster

# Enters a node's namespace in place of ssh. Launchers call it as `ssh [options] HOST COMMAND...`;
# like ssh it hands the joined command to a shell, which runs in the host's namespace.
ENTER_SCRIPT = """#!/bin/sh
while [ $# -gt 0 ]; do
  case "$1" in -x|-q|-T|-n|-tt) shift ;; -*) shift 2 ;; *) break ;; esac
done
host=$1; shift
case "$host" in
{cases}
  *) echo "syncsgd cluster: no emulated node $host" >&2; exit 255 ;;
esac
# Its own hostname too (a UTS namespace): Open MPI names its shared-memory files by hostname,
# and nodes sharing one would write into each other's.
exec ip netns exec "$namespace" unshare --uts sh -c 'hostname "$0" && exec sh -c "$1"' "$node" "$*"
"""


def find_mpiexec(explicit: str | None = None) -> str:
    """The mpiexec to drive: the one given, the one next to this Python, or the first on PATH."""
    if explicit:
        found = shutil.which(explicit)
        if found is None:
            raise ValueError(f"--mpiexec {explicit}: not found")
        return found
    local = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    found = local if os.path.exists(local) else shutil.which("mpiexec")
    if found is None:
        raise ValueError("needs an mpiexec: pip install 'syncsgd[mpi]' or apt install openmpi-bin")
    return found


def flavour(mpiexec: str) -> str:
    """Which launcher `mpiexec` is: "mpich" (hydra) or "openmpi" (ORTE/PRRTE)."""
    done = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=30)
    text = (done.stdout + done.stderr).lower()
    if "hydra" in text or "mpich" in text:
        return "mpich"
    if "open mpi" in text or "openrte" in text or "open-mpi" in text:
        return "openmpi"
    raise ValueError(f"{mpiexec}: neither MPICH's hydra nor Open MPI's mpirun")


def write_enter_script(cluster: Cluster, path: str) -> str:
    """Write the ssh stand-in that maps each node's address to its namespace."""
    cases = "\n".join(
        f"  {node.address}) namespace={shlex.quote(node.namespace)} node=node{node.index} ;;"
        for node in cluster.nodes
    )
    with open(path, "w", encoding="utf-8") as script:
        script.write(ENTER_SCRIPT.format(cases=cases))
    os.chmod(path, 0o755)
    return path


def environment(kind: str) -> dict[str, str]:
    """Settings that keep MPI between nodes on the emulated links, shared memory within a node."""
    if kind == "mpich":
        # UCX would otherwise reach the other "hosts" through /dev/shm and cross-memory attach
        # (one kernel, one /dev/shm): only TCP on the node's link. Ranks on one node still use
        # MPICH's own shared memory, since hydra tells each rank which ranks share its host.
        # UCX sends messages from about 3 MiB by rendezvous, a remote write over TCP, which ran
        # at half the link rate whenever both ends of a link sent at once (the ring's Sendrecv):
        # every message eager instead (docs/cluster.md).
        return {
            "MPIR_CVAR_CH4_NETMOD": "ucx",
            "UCX_TLS": "tcp",
            "UCX_NET_DEVICES": NODE_DEVICE,
            "UCX_RNDV_THRESH": "inf",
            "FI_PROVIDER": "tcp",
        }
    return {
        "OMPI_ALLOW_RUN_AS_ROOT": "1",
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        "OMPI_MCA_pml": "ob1",  # not UCX's pml, which could take shared memory across nodes
        "OMPI_MCA_btl": "self,vader,tcp",  # vader: shared memory, only among one node's ranks
        "OMPI_MCA_btl_tcp_if_include": NODE_DEVICE,
        "OMPI_MCA_oob_tcp_if_include": NODE_DEVICE,
        "OMPI_MCA_plm_rsh_no_tree_spawn": "1",
        "OMPI_MCA_rmaps_base_oversubscribe": "1",  # K ranks per node on a machine with fewer cores
        # The nodes share the machine's cores, which each node's Open MPI cannot see: ranks that
        # poll without yielding held a core from the rank they waited for (72% of the link at P = 4,
        # 89% yielding).
        "OMPI_MCA_mpi_yield_when_idle": "1",
    }


def command(kind: str, mpiexec: str, cluster: Cluster, per_node: int, script: str,
            argv: list[str]) -> list[str]:  # fmt: skip
    """The launcher's command line that runs `argv` as N*K ranks, K per node, in node order."""
    hosts = ",".join(f"{node.address}:{per_node}" for node in cluster.nodes)
    ranks = str(per_node * len(cluster.nodes))
    if kind == "mpich":
        return [mpiexec, "-hosts", hosts, "-n", ranks, "-launcher", "ssh",
                "-launcher-exec", script, *argv]  # fmt: skip
    # --bind-to none: each node's daemon binds its ranks from core 0 on, so the ranks of every
    # node, polling, shared the same cores: an 8 ms quantum per exchange, half the link rate.
    return [mpiexec, "--host", hosts, "-np", ranks, "--map-by", "slot", "--bind-to", "none",
            "--mca", "plm_rsh_agent", script, *argv]  # fmt: skip
