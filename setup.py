"""Package discovery: the three source folders install under one ``tandem`` namespace
(``backends`` as ``tandem.backends``, ...), every package below them found, not listed.
Everything else about the distribution is in pyproject.toml."""
from setuptools import find_packages, setup

ROOTS = {"tandem.backends": "backends", "tandem.rdma": "rdma", "tandem.client": "client"}

setup(
    package_dir=ROOTS,
    packages=[f"{name}.{sub}" if sub else name
              for name, folder in ROOTS.items() for sub in ("", *find_packages(folder))],
)
