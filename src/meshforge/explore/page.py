"""The explorer's one page, kept as files beside this module (static/: index.html, explorer.css,
explorer.js; vanilla JavaScript, no CDN, no build step) so that they are edited, linted and
diffed as what they are, and shipped as package data.

The server sends one self-contained document, as it always has: the stylesheet and the script
are put inline into index.html where it links them, once, when the server starts. They are read
from the installed package only, never from a path a user or a request names.

The page holds no model of memory or time: every figure it shows comes from ``/api/estimate``
(the planner), and the best layouts from ``/api/best``.
"""

from __future__ import annotations

import functools
from importlib import resources

# where index.html links its parts -> (the file, the inline element that replaces the link)
PARTS = {
    '<link rel="stylesheet" href="explorer.css">': ("explorer.css", "style"),
    '<script src="explorer.js"></script>': ("explorer.js", "script"),
}


@functools.cache
def page() -> bytes:
    """index.html with its stylesheet and script inline (UTF-8), built once per process. A part
    whose link is not in index.html exactly once, or that would end its own element early (a
    ``</style`` or ``</script`` inside it), is refused: the page would come out broken."""
    static = resources.files("meshforge.explore") / "static"
    html = (static / "index.html").read_text(encoding="utf-8")
    for link, (name, tag) in PARTS.items():
        body = (static / name).read_text(encoding="utf-8")
        if html.count(link) != 1:
            raise RuntimeError(f"explore/static/index.html must link {name} exactly once as {link}")
        if f"</{tag}" in body.lower():
            raise RuntimeError(f"explore/static/{name} contains </{tag}, which would end it early once inline")
        html = html.replace(link, f"<{tag}>\n{body}</{tag}>")
    return html.encode("utf-8")
