"""Where an elastic job may run, as `host -> slots`: horovodrun's `-H host0:2,host1:2`, a
hostfile, a host-discovery script (elastic/discovery.py) or a Slurm allocation, read by
the launcher (collectives/launcher.py)."""

from __future__ import annotations

import re
import socket

from collectives.elastic.discovery import parse


def from_list(text: str) -> dict[str, int]:
    """`-H`'s value: comma-separated `host[:slots]`."""
    return parse(text.replace(",", "\n"), "-H")


def from_hostfile(path: str) -> dict[str, int]:
    """A hostfile: `host slots=N` lines (Open MPI's form) or `host[:slots]` lines."""
    with open(path) as f:
        text = f.read()
    text = re.sub(r"^(\s*\S+)\s+slots\s*=\s*(\d+).*$", r"\1:\2", text, flags=re.M)
    return parse(text, path)


def expand_nodelist(nodelist: str) -> list[str]:
    """Slurm's compressed host list (`node[01-03,07],login1`) as host names."""
    hosts = []
    for item in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", nodelist):
        m = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", item)
        if not m:
            hosts.append(item)
            continue
        prefix, ranges, suffix = m.groups()
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            for n in range(int(lo), int(hi or lo) + 1):
                hosts.append(f"{prefix}{n:0{len(lo)}d}{suffix}")
    return hosts


def from_slurm(environ: dict[str, str]) -> dict[str, int] | None:
    """The allocation's hosts and tasks per host (SLURM_JOB_NODELIST,
    SLURM_TASKS_PER_NODE as `2(x3),1`); None outside Slurm."""
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not nodelist:
        return None
    hosts = expand_nodelist(nodelist)
    counts: list[int] = []
    for part in environ.get("SLURM_TASKS_PER_NODE", "").split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if m:
            counts += [int(m.group(1))] * int(m.group(2) or 1)
    if len(counts) != len(hosts):
        counts = [1] * len(hosts)
    return dict(zip(hosts, counts))


def mpirun_hosts(hosts: dict[str, int], np_: int) -> str:
    """`--host`'s value for np_ ranks on hosts, in their order: each host's slots until
    np_ are placed (hosts not needed are left out)."""
    parts, left = [], np_
    for host, slots in hosts.items():
        if left <= 0:
            break
        take = min(slots, left)
        parts.append(f"{host}:{take}")
        left -= take
    return ",".join(parts)


def canonical(host: str) -> str:
    """host as a rank there names it (socket.gethostname()): this machine's aliases are
    its hostname."""
    return socket.gethostname() if host in ("localhost", "127.0.0.1") else host
