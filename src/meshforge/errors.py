"""User-facing errors: the CLI prints them as one paragraph and exits with code 2."""


class MeshforgeError(Exception):
    """Bad input a user can fix (config, data, checkpoint, command line)."""


class ConfigError(MeshforgeError):
    """A config key has a wrong name, type or value."""


class DataError(MeshforgeError):
    """The data path is missing, empty, malformed or too small."""
