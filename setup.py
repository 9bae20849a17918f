"""Packages are found, never listed: clover_lab's own, the kernel core's (the folder ``kernels/``,
imported as ``clover_kernels``: a bare ``kernels`` would collide with Hugging Face's ``kernels``
distribution) and the embedded default model (``assets/``, shipped as ``clover_lab.assets``).
Everything else about the package is in pyproject.toml."""
from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["clover_lab", "clover_lab.*"]),
              "clover_kernels", *(f"clover_kernels.{p}" for p in find_packages("kernels")),
              "clover_lab.assets"],
    package_dir={"clover_kernels": "kernels", "clover_lab.assets": "assets"},
)
