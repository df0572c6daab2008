"""Tables and figures of a study from its metrics table (one row per checkpoint): CSV, Markdown, LaTeX, and PNG,
PDF and SVG figures.

- :mod:`.report_options`: what a report is asked for (``ReportOptions``) and what it gives back (``ReportResult``);
- :mod:`.write`: ``write_report``, the whole report;
- :mod:`.tables`: the selection, the statistics' display and tables.tex; :mod:`.document`: report.md, one
  section per tag;
- :mod:`.support`: what the numbers rest on (kept classes, singletons, token counts; which way is more collapse);
- :mod:`.figures`: Figures 1-4; :mod:`.depth`: NC across depth and sites; :mod:`.ticks`: their axes' limits, ticks
  and labels;
- :mod:`.html`: report.html, the report as one self-contained page;
- :mod:`.precision`: how sure the numbers are (the final checkpoints' jackknife errors, the token budget);
- :mod:`.tokens`: the per-token table; :mod:`.mincount`: Figure 1's metrics of each run's latest checkpoint at min_count
  2, 5 and 20;
- :mod:`.escape`: user text made inert in the documents a report writes.
"""
from __future__ import annotations

from ncanalyze.analyzer.report.figures import (DYNAMICS, FIGURES, FORMATS, LABELS, dynamics_figure, label,
                                               save_figure, scatter_figure)
from ncanalyze.analyzer.report.report_options import ReportOptions, ReportResult
from ncanalyze.analyzer.report.tables import default_target, select, summary
from ncanalyze.analyzer.report.tokens import AVERAGE_TOKEN, GroupReader, TokenNote, resolve_token, token_table
from ncanalyze.analyzer.report.write import ID_COLUMNS, write_report

__all__ = ["AVERAGE_TOKEN", "DYNAMICS", "FIGURES", "FORMATS", "ID_COLUMNS", "LABELS", "GroupReader", "ReportOptions",
           "ReportResult", "TokenNote", "default_target", "dynamics_figure", "label", "resolve_token", "save_figure",
           "scatter_figure", "select", "summary", "token_table", "write_report"]
