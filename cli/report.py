"""``ncanalyze report``: measure what is new, then tables, figures and statistics over the store."""
from __future__ import annotations

import logging
from dataclasses import replace

import click
import cloup
from click.core import ParameterSource
from ncanalyze.analyzer.registry import REPORT_SECTIONS, MeasureSettings, ReportSettings
from ncanalyze.cli.common import resolve_store
from ncanalyze.cli.options import option, setting_groups, setting_option, settings_of, store_positional
from ncanalyze.core.names import shown
from ncanalyze.core.setting import field_of

log = logging.getLogger(__name__)


OWN = {  # the command's own options, not settings of the report: where it writes, where the store is, how it measures
    "Output": [click.option("--out", type=click.Path(file_okay=False), default="ncanalyze-report", show_default=True,
                            help="Folder for report.md, report.html, metrics.csv, stats.csv, min_count.csv (from a "
                            "store: Figure 1's metrics of each run's latest checkpoint at min_count 2, 5 and 20), "
                            "tables.tex and the figures (PNG, PDF and SVG).")],
    "Measuring": [option("store", "report"), option("scheduler", "report"),  # it measures what is new first
                  setting_option(field_of(MeasureSettings, "min_count"), "report")],
}


@cloup.command(short_help="Tables, figures and statistics of the metrics against the validation loss.",
               align_option_groups=False)
@store_positional
@setting_groups(REPORT_SECTIONS, "report", ReportSettings, more=OWN)
@click.pass_context
def report(ctx, store_positional, store, out, scheduler, min_count, **values):
    """Tables, figures and statistics of NC metrics against the target (default: val_loss, the loss ncanalyze
    measured on the validation tokens, where every selected checkpoint has it; else eval_loss, the Trainer's) over
    a STORE (or --store; default $NCANALYZE_STORE, else ./ncanalyze.zarr; a metrics.csv from an earlier report
    also works).

    \b
    For every metric: Pearson r and R² (raw, and with log10 of the metric where positive), Spearman's rho, the
    partial r controlling for model size and training progress, and permutation p-values (Freedman-Lane for the
    partial r; runs with several checkpoints permuted whole). Tags are never pooled: each tag is reported apart.

    \b
    report.html is one file that opens offline from disk (plotly.js inlined): Figure 1's panels (hover a point
    for its run, checkpoint, step, tag, size, metric, target and kept classes), a picker for the metric (NC and
    geometry) and, where there are several, the layer and the tag; the picked metric against the target and
    against the step (a line per run: click a run in the legend to show it alone), the depth figure with
    layers, the sortable statistics table, the per-token tables with --tokens, and report.md's caveats (the
    permutation unit and count, thin classes, tags kept apart).
    """
    from ncanalyze.analyzer.report import ReportOptions, write_report
    from ncanalyze.analyzer.stats import METRICS, MIN_N, NoteKind, has_note
    from ncanalyze.store.measure import load_table
    from ncanalyze.store.store import Store

    options = settings_of(ReportOptions, values)  # a bad value: its one line, before any work
    MeasureSettings(min_count=min_count)
    df, store_path, failed = load_table(resolve_store(store_positional, store), min_count, scheduler)
    if not options.metrics or ctx.get_parameter_source("metrics") is ParameterSource.DEFAULT:  # those it has
        options = replace(options, metrics=[m for m in METRICS if m in df.columns] or METRICS)
    options = replace(options, store=store_path)
    result = write_report(df, out, options, read_group=store_path and Store.at(store_path).read, skipped=failed)
    n = len(result.selected)  # checkpoints, not their layers
    if n < MIN_N:
        log.warning("warning: only %d checkpoint(s) selected; correlations need at least %d", n, MIN_N)
    for line in sorted(set(result.stats.note[has_note(result.stats, NoteKind.TOO_FEW)].dropna()) - {""}):
        log.warning("note: %s", shown(line))
    click.echo(f"{n} checkpoints, {len(options.metrics)} metrics -> {shown(result.files['report'])}")
    for f in result.files.values():
        click.echo(f"  {shown(f)}")
