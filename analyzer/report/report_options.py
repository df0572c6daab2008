"""What a report is asked for (:class:`ReportOptions`) and what it computed and wrote (:class:`ReportResult`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from ncanalyze.analyzer.registry import ReportSettings


@dataclass(frozen=True)
class ReportOptions(ReportSettings):
    """The choices of a report: the flags of ``ncanalyze report`` (:class:`~ncanalyze.analyzer.registry.ReportSettings`,
    where each is defined once, its default and rule with it; a bad value is refused when the options are made, in the
    command's line), and the store.

    Parameters
    ----------
    metrics
        The metric columns tested and drawn (``--metrics``; a comma-separated string or a sequence, kept as a tuple).
    target
        The column they are correlated with (``--target``); None: ``val_loss`` where every selected checkpoint has
        it, else ``eval_loss``.
    controls
        Expressions over the columns held fixed by the partial correlation (``--controls``).
    where
        A condition selecting the checkpoints (``--where``); None: all.
    n_perm
        Permutations per p-value (``--permutations``; 0: none).
    seed
        Seed of the permutations (``--seed``).
    store
        The data's source, named in report.md; None for a metrics table without a store.
    tokens
        Tokens (strings as decoded, or ids) of the per-token table (``--tokens``); empty: no table.
    checkpoints
        ``run/checkpoint`` groups of the per-token table (``--checkpoint``); empty: each selected run's latest.
    per_run
        ``"last"``: keep each run's latest checkpoint only (``--per-run last``; one row per run, so runs are the
        units and nothing need be permuted in blocks); ``"all"`` (None too): every selected checkpoint.
    html
        Also write report.html, the interactive page (:mod:`~ncanalyze.analyzer.report.html`; ``--no-html``: not).
    n_boot
        Resamples of the bootstrap over whole runs behind the 95% intervals (seeded by ``seed``; 0: none).
    formats
        The figures' formats (``--formats``): PNG always, PDF and SVG by default.
    estimates
        ``"debiased"`` (default): the figures and Figure 1's claims use a metric's budget-stable form where the table
        has it (schema.PLUGIN_OF: nc1_cdnv_debiased for nc1_cdnv); ``"plugin"``: the paper's estimator
        (``--estimates``).
    """

    store: str | Path | None = None


@dataclass
class ReportResult:
    """What a report computed and the files it wrote.

    Parameters
    ----------
    metrics
        The selected rows of every layer, identity columns first (metrics.csv).
    selected
        Their last layer: the checkpoints the statistics, Figures 1-4 and the token table use.
    target
        The target the metrics were correlated with (the default resolved).
    stats
        :func:`ncanalyze.analyzer.stats.correlations_by_tag` with Holm's adjustment per tag (stats.csv).
    tokens
        The per-token table (tokens.csv), or None without tokens.
    depth
        The per-layer table (layers.csv), or None with one layer.
    notes
        Tokens resolved other than as written, given twice or not one token (also in report.md).
    figures
        Each figure's PNG by key: its file stem, with ``__<tag>`` when the selection holds several tags (its PDF
        and SVG beside it).
    depth_notes
        The depth figure's undefined values (e.g. layer 0's infinite CDNV), said in report.md.
    min_count
        Figure 1's metrics of each run's latest checkpoint at min_count 1, 2, 5 and 20 (min_count.csv;
        :func:`~ncanalyze.analyzer.report.mincount.min_count_table`), or None without a store.
    min_count_notes
        Its notes: the cap on runs, and measure's warnings at those min_counts (NC4's kept set among them).
    by_step
        Between models, step by step (by_step.csv; :func:`ncanalyze.analyzer.stats.by_step`), or None.
    files
        Every file written by name: metrics, stats, [tokens], [min_count], the figures, [depth, layers], report, tex,
        [html].
    """

    metrics: pd.DataFrame
    selected: pd.DataFrame
    target: str
    stats: pd.DataFrame
    tokens: pd.DataFrame | None = None
    depth: pd.DataFrame | None = None
    notes: list[str] = field(default_factory=list)
    figures: dict[str, Path] = field(default_factory=dict)
    depth_notes: list[str] = field(default_factory=list)
    min_count: pd.DataFrame | None = None
    min_count_notes: list[str] = field(default_factory=list)
    files: dict[str, Path] = field(default_factory=dict)
    by_step: pd.DataFrame | None = None
    budget: pd.DataFrame | None = None  # the token budget of each run's latest checkpoint (budget.csv; precision.py)
    budget_notes: list[str] = field(default_factory=list)
