"""Mismatch messages name the field that tells the ranks why they differ (no MPI job: the
message is made from the signatures the ranks exchange, runtime/agreement.describe_mismatch)."""

from __future__ import annotations

import pytest

from collectives.api import calls, on_device
from collectives.ops import ReduceOp
from collectives.runtime.agreement import describe_mismatch


@pytest.mark.parametrize("algorithm", ["auto", "ring"])
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("device_rank", [0, 1])
def test_host_data_against_device_data_names_memory(algorithm, inplace, device_rank):
    """A rank passing host data to an allreduce the others run on device data (or the other
    way round, whichever rank is first) is told `memory`, whatever else they agree on."""
    host = calls.allreduce_fields(ReduceOp.Sum, "float32", (1024,), algorithm, inplace)
    device = on_device.allreduce_fields(ReduceOp.Sum, "float32", (1024,), algorithm, inplace)
    signatures = [("allreduce", host), ("allreduce", host), ("allreduce", host)]
    signatures[device_rank] = ("allreduce", device)
    text = describe_mismatch(signatures)
    assert text.startswith("allreduce memory mismatch: "), text
    assert f"rank {device_rank} has 'device'" in text, text


def test_the_first_field_that_differs_is_named():
    """Ranks that differ in dtype and shape are told the first of them, with each value's
    ranks."""
    a = calls.allreduce_fields(ReduceOp.Sum, "float32", (4,), "ring", False)
    b = calls.allreduce_fields(ReduceOp.Sum, "float64", (5,), "ring", False)
    text = describe_mismatch([("allreduce", a), ("allreduce", b), ("allreduce", b)])
    assert text == "allreduce dtype mismatch: rank 0 has 'float32', ranks 1-2 have 'float64'"
