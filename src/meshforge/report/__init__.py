"""The HTML run report (``meshforge report``)."""

from meshforge.report.run_report import build_html, load_run, write_report

__all__ = ["build_html", "load_run", "write_report"]
