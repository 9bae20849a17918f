"""Packages are found, never listed: clover_lab's own, the kernel core's (``clover_kernels/``: a folder
named ``kernels`` at the repository root would shadow Hugging Face's ``kernels`` distribution, which
transformers imports, whenever the checkout is on ``sys.path``, as under ``python -m pytest``) and the
embedded default model (``assets/``, shipped as ``clover_lab.assets``).
Everything else about the package is in pyproject.toml."""
from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["clover_lab", "clover_lab.*"]),
              *find_packages(include=["clover_kernels", "clover_kernels.*"]),
              "clover_lab.assets"],
    package_dir={"clover_lab.assets": "assets"},
)
