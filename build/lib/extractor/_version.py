"""The package's version, on the ground floor: every layer may record it."""

__version__ = "0.1.0"
