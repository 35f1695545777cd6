"""The flight recorder on request (runtime/flight.py keeps and writes the record)."""

from __future__ import annotations

from collectives.runtime import flight, topology


def dump_flight_recorder(reason: str = "on request") -> str:
    """Write this rank's flight record now: its last calls (COLLECTIVES_FLIGHT_RECORDER of
    them), what it is doing and the seconds the other ranks waited for each rank, as
    rank<R>.json in the job's dump folder (COLLECTIVES_DUMP_DIR, else collectives-<job> in
    the system's temporary folder); returns the file's path. Not collective: any rank may
    call it at any time (a rank that receives SIGUSR1 does the same). `python -m
    collectives.debug FOLDER` reads the ranks' files together. Raises OSError where the file
    cannot be written."""
    if not isinstance(reason, str):
        raise TypeError(f"reason: expected a str, got {type(reason).__name__}")
    topology.get()  # the recorder starts at init
    return flight.write(reason)
