"""TinyLoop's exception types."""


class ModelFormatError(ValueError):
    """A .tinyloop file or config breaks the format contract (docs/spec.md §6)."""
