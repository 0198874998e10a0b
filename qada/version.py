"""The package version (read by pyproject and ``qada.__version__``)."""

__version__ = "0.1.0"
