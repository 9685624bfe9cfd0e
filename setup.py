"""Package list only (metadata is in pyproject.toml): ships recipes/ inside the wheel as rlrecipes/_recipes."""
from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["rlrecipes", "rlrecipes.*"]) + ["rlrecipes._recipes"],
    package_dir={"rlrecipes._recipes": "recipes"},
)
