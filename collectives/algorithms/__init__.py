"""One module per algorithm; each provides allreduce, allgather, reducescatter and
broadcast as plain functions over a communicator and flat host arrays."""
