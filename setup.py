"""Package discovery only (everything else is in pyproject.toml).

qwen_absorb and every subpackage are found by name, so a new subpackage ships without an edit here; the
examples directory ships as ``qwen_absorb_examples`` so that the console script ``qwen-absorb-compare``
(examples/compare_outputs.py) works from a wheel install without a clone.
"""

from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["qwen_absorb", "qwen_absorb.*"]) + ["qwen_absorb_examples"],
    package_dir={"qwen_absorb_examples": "examples"},
)
