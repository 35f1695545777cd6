"""The runtime: what every call runs on, below any algorithm.

Owns: the engine (engine.py: ordering, the claim, async handles; its state in C++), the
communicator object (topology.py: Topology, one per communicator, owning its nodes, MPI
duplicates, agreement channel and shared window, described calls, fast entries, stats and
`auto`'s settled choices), point-to-point messages (p2p.py), buffers of NumPy / torch /
CuPy (buffers.py), shared windows (window.py), device workspaces shared through CUDA IPC
(ipc.py), the agreement (agreement.py), the stall
watchdog (watchdog.py) and meeting beside the engine (meet.py).
May import: the leaves (config, dtypes, ops, mpi_defaults) and kernels."""
