"""Builds the optional C extension; all metadata lives in pyproject.toml."""

from setuptools import setup

setup(cffi_modules=["native/build.py:ffibuilder"])
