import re

from setuptools import find_packages, setup

VERSION = re.search(r'__version__ = "([^"]+)"', open("autopar/version.py").read()).group(1)

setup(
    name="autopar",
    version=VERSION,
    description="An auto-parallelizing compiler front end for stock JAX.",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["autopar", "autopar.*"]),
    python_requires=">=3.10",
    install_requires=[
        "jax>=0.10.2",
        "jaxlib>=0.10.2",
        "numpy",
        "ray>=2.40",
        "pulp>=2.8",
        "highspy",
        "orbax-checkpoint",
    ],
    entry_points={"console_scripts": ["autopar = autopar.tools.cli:main"]},
    extras_require={
        "test": ["pytest", "hypothesis", "flax", "optax", "orbax-checkpoint", "equinox"],
        "dev": ["pytest", "hypothesis", "flax", "optax", "orbax-checkpoint", "equinox"],
    },
)
