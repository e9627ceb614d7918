"""TinyLoop's exception types."""


class ModelFormatError(ValueError):
    """A .tinyloop file or config breaks the format contract (docs/spec.md §6)."""


class PrefixFormatError(ValueError):
    """A prefix blob is corrupted, or was saved from another model or KV mode (docs/spec.md
    §7); the message names the field."""
