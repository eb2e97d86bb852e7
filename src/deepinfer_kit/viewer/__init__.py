"""viewer/: the trace schema, a recorder of real engine runs, and the step-through HTML viewer."""

from deepinfer_kit.viewer.html import read_html, render_html, write_html
from deepinfer_kit.viewer.recorder import TraceRecorder, filter_name
from deepinfer_kit.viewer.schema import SCHEMA_VERSION, TraceDoc, dumps, loads, validate

__all__ = [
    "TraceRecorder",
    "TraceDoc",
    "SCHEMA_VERSION",
    "dumps",
    "loads",
    "validate",
    "filter_name",
    "render_html",
    "write_html",
    "read_html",
]
