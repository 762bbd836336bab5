"""The optional C extension (kvlookup._native: /lookup body decode and the tuple-hash chunk chains).

Everything else is declared in pyproject.toml. ``optional=True``: without a C compiler (or on a
32-bit build) the extension is skipped and kvlookup runs its pure-Python path (kvlookup.native).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvlookup._native", ["kvlookup/_native.c"], optional=True)])
