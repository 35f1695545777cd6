"""`auto`: which algorithm a call runs.

Owns: select.py (the minimum over the registered costs, or the measured times in force),
online.py (trials of the close candidates, settled classes and their watches), autotune.py
(the measurement at init, its cache and the tuning file), calibrate.py and simulate.py (the
command-line tools behind `python -m collectives calibrate|simulate`).
May import: the leaves, kernels, runtime, algorithms. What it times is handed to it by the
public API (autotune.Timed), which stands above it."""
