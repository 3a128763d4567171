"""The strategy explorer: a local web page and JSON API over the planner (``meshforge explore``)."""

from .server import make_server, serve

__all__ = ["make_server", "serve"]
