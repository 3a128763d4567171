"""The explorer's page lives in files (src/meshforge/explore/static/) shipped as package data,
and the server still sends one self-contained document built from them once, at start-up:
nothing is read from disk on a request, and no request names a file."""

from __future__ import annotations

import re
import sys
from fnmatch import fnmatch
from pathlib import Path

import pytest

from meshforge.explore import page as page_module
from meshforge.explore import server
from meshforge.explore.page import PARTS, page

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the 3.10 floor
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
STATIC = ROOT / "src" / "meshforge" / "explore" / "static"


def test_the_page_is_the_static_files_with_their_parts_inline():
    html = page().decode()
    index = (STATIC / "index.html").read_text(encoding="utf-8")
    css = (STATIC / "explorer.css").read_text(encoding="utf-8")
    js = (STATIC / "explorer.js").read_text(encoding="utf-8")
    assert f"<style>\n{css}</style>" in html and f"<script>\n{js}</script>" in html
    assert "explorer.css" not in html and "explorer.js" not in html  # nothing left to fetch
    assert html.startswith(index[: index.index("<link")])  # the document around them is index.html
    assert "/api/estimate" in js and "--params" in css  # the parts are the real ones


def test_every_static_file_is_shipped_as_package_data():
    """An installed (non-editable) meshforge has the page only if pyproject.toml ships it."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    globs = data.get("meshforge.explore", [])
    files = sorted(p.relative_to(STATIC.parent).as_posix() for p in STATIC.rglob("*") if p.is_file())
    assert {"static/index.html", "static/explorer.css", "static/explorer.js"} <= set(files)
    assert [f for f in files if not any(fnmatch(f, g) for g in globs)] == []


def test_the_page_is_read_once_at_start_up(monkeypatch):
    """A request reads nothing from disk: after start-up the package's files could vanish."""
    page.cache_clear()
    srv = server.make_server("127.0.0.1", 0, quiet=True)
    srv.server_close()
    sent = server.route("/").body

    def no_disk(*_args):
        raise AssertionError("the page was read again on a request")

    monkeypatch.setattr(page_module.resources, "files", no_disk)
    assert server.route("/").body == sent == server.route("/index.html").body
    assert b"<script>\n" in sent


@pytest.mark.parametrize(
    "target",
    ["/explorer.js", "/explorer.css", "/static/index.html", "/static/explorer.js", "/../page.py", "/%2e%2e/server.py"],
)
def test_no_request_names_a_file(target):
    """Only / and /index.html are the page; the files behind it are not routes of their own."""
    assert server.route(target).status == 404


def _fake_static(tmp_path: Path, monkeypatch, html: str, css: str = "b{}\n", js: str = "let a;\n") -> None:
    static = tmp_path / "static"
    static.mkdir()
    (static / "index.html").write_text(html)
    (static / "explorer.css").write_text(css)
    (static / "explorer.js").write_text(js)
    monkeypatch.setattr(page_module.resources, "files", lambda _pkg: tmp_path)


LINKS = "<head>" + "".join(PARTS) + "</head>"


def test_a_part_that_would_end_its_element_early_is_refused(tmp_path, monkeypatch):
    _fake_static(tmp_path, monkeypatch, LINKS, js='let s = "</SCRIPT><img src=x>";\n')
    with pytest.raises(RuntimeError, match=re.escape("explorer.js contains </script")):
        page.__wrapped__()


@pytest.mark.parametrize("html", ["<head></head>", LINKS + LINKS])
def test_a_link_missing_or_given_twice_is_refused(tmp_path, monkeypatch, html):
    _fake_static(tmp_path, monkeypatch, html)
    with pytest.raises(RuntimeError, match="exactly once"):
        page.__wrapped__()


def test_the_fake_static_dir_builds(tmp_path, monkeypatch):
    """The refusals above are refusals of their input, not of any input."""
    _fake_static(tmp_path, monkeypatch, LINKS)
    assert page.__wrapped__() == b"<head><style>\nb{}\n</style><script>\nlet a;\n</script></head>"
