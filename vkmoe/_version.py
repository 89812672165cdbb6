"""The package version, in one place: pyproject.toml reads it (dynamic version), vkmoe.__version__ re-exports it."""
__version__ = "0.1.0"
