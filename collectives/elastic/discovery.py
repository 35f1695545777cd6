"""Host discovery in Horovod's form: a source that lists the hosts a job may run on, one
`host:slots` line per host (`host` alone: one slot), read again every POLL_S seconds by the
launcher (collectives/launcher.py), which grows the job into slots listed and moves it off hosts
that leave the listing.

The source is a path: an executable is run and its standard output read (Horovod's
`--host-discovery-script`), any other file is read as it is. Blank lines and lines from
`#` on are skipped. Reading runs on a thread, so a slow script never holds up the
launcher; a read that fails (the script's status, a line that is not `host[:slots]`,
SCRIPT_TIMEOUT_S passed) keeps the last good listing (none yet: no job starts), and the
first failure after a good read warns once, saying so. Cost: a script run or a file read
per POLL_S, in the launcher."""

from __future__ import annotations

import os
import subprocess
import threading
import time
import warnings

#: Seconds between two reads of the source (Horovod's driver polls its script every second).
POLL_S = 1.0
#: Seconds a discovery script may run before its read counts as failed.
SCRIPT_TIMEOUT_S = 10.0


def parse(text: str, source: str) -> dict[str, int]:
    """host -> slots from a listing (slots of a host listed twice add up)."""
    hosts: dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        host, _, slots = line.partition(":")
        if not host or (slots and not slots.isdigit()):
            raise ValueError(f"{source}, line {number}: expected host[:slots], got {line!r}")
        hosts[host] = hosts.get(host, 0) + (int(slots) if slots else 1)
    return hosts


def read(source: str) -> dict[str, int]:
    """host -> slots as the source lists them now (runs it if it is executable)."""
    if os.access(source, os.X_OK) and not os.path.isdir(source):
        done = subprocess.run([os.path.abspath(source)], capture_output=True, text=True,
                              timeout=SCRIPT_TIMEOUT_S, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{source} exited with status {done.returncode}: "
                               f"{done.stderr.strip()[-200:]}")
        return parse(done.stdout, source)
    with open(source) as f:
        return parse(f.read(), source)


class Discovery:
    """The latest listing of one source, read at once and then every POLL_S seconds on a
    thread started by the first slots() call."""

    def __init__(self, source: str):
        self.source = source
        self._hosts: dict[str, int] | None = None  # the last good listing; None: none yet
        self._failing = False  # a read failed since the last good one (warned of)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def hosts(self) -> dict[str, int] | None:
        """host -> slots as last read (None until a read has succeeded)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._poll, name="collectives-discovery",
                                            daemon=True)
            self._thread.start()
        with self._lock:
            return None if self._hosts is None else dict(self._hosts)

    def _poll(self) -> None:
        while True:
            self._read_once()
            time.sleep(POLL_S)

    def _read_once(self) -> None:
        try:
            hosts = read(self.source)
        except (OSError, ValueError, RuntimeError, subprocess.TimeoutExpired) as exc:
            if not self._failing:
                self._failing = True
                with self._lock:
                    last = self._hosts
                then = "no listing yet: no job starts until a read succeeds" if last is None \
                    else (f"the launcher keeps its last listing "
                          f"({','.join(f'{h}:{n}' for h, n in last.items())}) until a read "
                          f"succeeds, warning no more until then")
                warnings.warn(f"collectives.elastic: host discovery from {self.source} "
                              f"failed ({type(exc).__name__}: {exc}); {then}", stacklevel=2)
            return
        with self._lock:
            self._hosts = hosts
        self._failing = False
