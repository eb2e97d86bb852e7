"""write_html: one self-contained HTML file (inline CSS, JS and trace JSON; no network)
that steps through a recorded run; read_html gets the trace back out of such a file."""

from __future__ import annotations

import os
import re
from importlib import resources

from deepinfer_kit.errors import ConfigError
from deepinfer_kit.viewer.recorder import TraceRecorder
from deepinfer_kit.viewer.schema import TraceDoc, dumps, loads

__all__ = ["render_html", "write_html", "read_html"]

_DATA = re.compile(r'<script type="application/json" id="trace-data">(.*?)</script>', re.S)
# JSON text stays JSON with these escaped, and can then never close the <script> element.
_ESCAPES = {"<": "\\u003c", ">": "\\u003e", "&": "\\u0026"}


def _static(name: str) -> str:
    return resources.files("deepinfer_kit.viewer").joinpath("static").joinpath(name).read_text("utf-8")


def render_html(source: TraceRecorder | TraceDoc | str) -> str:
    """The viewer page for ``source`` (a recorder, a trace document, or its JSON text).

    The page embeds the validated JSON in a ``<script type="application/json">`` element
    and inlines the viewer's CSS and JavaScript, so it opens from ``file://`` with no
    network. Pure; O(size of the trace).

    Raises:
        ConfigError: the trace does not follow the schema (names the field).
    """
    if isinstance(source, TraceRecorder):
        text = source.to_json()
    elif isinstance(source, str):
        text = dumps(loads(source))
    else:
        text = dumps(source)
    data = re.sub(r"[<>&]", lambda m: _ESCAPES[m.group(0)], text)
    page = _static("viewer.html")
    for mark, body in (("/*__CSS__*/", _static("viewer.css")), ("/*__JS__*/", _static("viewer.js")),
                       ("/*__DATA__*/", data)):
        page = page.replace(mark, body, 1)
    return page


def write_html(source: TraceRecorder | TraceDoc | str, path: str | os.PathLike[str]) -> None:
    """Write :func:`render_html`'s page for ``source`` to ``path`` (UTF-8), replacing any
    file there. Raises ConfigError for a trace off the schema, OSError when unwritable."""
    page = render_html(source)
    with open(path, "w", encoding="utf-8") as f:
        f.write(page)


def read_html(path: str | os.PathLike[str]) -> TraceDoc:
    """The trace document embedded in a page :func:`write_html` wrote (validated).

    Raises:
        ConfigError: the file holds no embedded trace, or one off the schema.
    """
    with open(path, encoding="utf-8") as f:
        match = _DATA.search(f.read())
    if match is None:
        raise ConfigError(f"{os.fspath(path)!r} holds no embedded deepinfer_kit trace")
    return loads(match.group(1))
