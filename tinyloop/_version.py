"""The one place the package version is defined."""
__version__ = "0.7.0"
