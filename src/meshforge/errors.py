"""User-facing errors: the CLI prints them as one paragraph and exits with code 2."""

import difflib


class MeshforgeError(Exception):
    """Bad input a user can fix (config, data, checkpoint, command line).

    ``every_rank``: every rank of the run raises this same error together (a health stop, a
    checkpoint save whose failure DCP gathered to all ranks); only local rank 0 prints it."""

    every_rank = False


class ConfigError(MeshforgeError):
    """A config key has a wrong name, type or value."""


class DataError(MeshforgeError):
    """The data path is missing, empty, malformed or too small."""


def suggest(word: str, options, cutoff: float = 0.5) -> str:
    """The "did you mean" half of an error message: the closest option, else all of them."""
    options = [str(o) for o in options]
    close = difflib.get_close_matches(str(word), options, n=1, cutoff=cutoff)
    if close:
        return f"did you mean '{close[0]}'?"
    return "valid: " + ", ".join(sorted(options))
