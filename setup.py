"""The optional C call path (``autoopt/_jit/_native.c``); everything else is in pyproject.toml.

Built on CPython 3.11 only (it reads the caller's frame through 3.11's internal layout). Where
it is not built, or does not compile, autoopt runs its pure-Python call path.
"""

import sys

from setuptools import Extension, setup

ext_modules = []
if sys.implementation.name == "cpython" and sys.version_info[:2] == (3, 11):
    ext_modules.append(Extension("autoopt._jit._native", ["autoopt/_jit/_native.c"], optional=True))

setup(ext_modules=ext_modules)
