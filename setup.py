import re

from setuptools import find_packages, setup

VERSION = re.search(r'__version__ = "([^"]+)"', open("autopar/version.py").read()).group(1)
RAY = ">=2.40,<3"

setup(
    name="autopar",
    version=VERSION,
    description="An auto-parallelizing compiler front end for stock JAX.",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["autopar", "autopar.*"]),
    # jax 0.10.2 needs 3.11, jax >= 0.11 3.12; `make test` runs 3.11 (the
    # oldest job) and 3.12 (the newest): 3.13 is not run, so not claimed.
    python_requires=">=3.11,<3.13",
    # Upper bounds: the newest releases `make test` has passed on (2026-11-25:
    # jax 0.12.0.1, PuLP 4.2, Ray 2.60); lower bounds: its quick job's
    # (jax 0.10.2, PuLP 3.3, Ray 2.40: .ci/oldest.txt). autopar/jax_compat.py
    # names what differs.
    install_requires=[
        "jax>=0.10.2,<0.13",
        "jaxlib>=0.10.2,<0.13",
        "numpy<3",
        f"ray{RAY}",
        "pulp>=3.3,<5",
        "highspy",
        "orbax-checkpoint",
        "tensorstore",      # (a Ray pipeline's checkpoints; orbax writes with it too)
    ],
    entry_points={"console_scripts": ["autopar = autopar.tools.cli:main"]},
    extras_require={
        # Ray's dashboard, which `ray job submit` talks to (docs/ray.md);
        # `make demo` and `make test` install it.
        "ray": [f"ray[default]{RAY}"],
        "test": ["pytest", "pytest-xdist", "hypothesis", "flax", "optax", "orbax-checkpoint",
                 "equinox", "import-linter", "ruff"],
        "dev": ["pytest", "hypothesis", "flax", "optax", "orbax-checkpoint", "equinox"],
    },
)
