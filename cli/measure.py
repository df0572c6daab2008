"""``ncanalyze measure``: the neural-collapse metrics of every checkpoint in the store not yet measured."""
from __future__ import annotations

import click
import cloup
from ncanalyze.analyzer.metric_records import RECORDS
from ncanalyze.analyzer.registry import MEASURE_SECTIONS, MeasureSettings
from ncanalyze.analyzer.schema import SCALARS
from ncanalyze.cli.common import open_store
from ncanalyze.cli.options import option, setting_groups, settings_of, store_positional
from ncanalyze.core.names import shown

SHOWN = tuple(r.name for r in RECORDS if r.shown)  # the columns printed: the records marked shown


RUN_CONTROL = [  # where it works and whether it starts again: the command's own, not settings of the measuring
    option("store", "measure"),
    option("scheduler", "measure"),
    click.option("--force", is_flag=True, help="Measure again checkpoints already measured."),
]


@cloup.command(short_help="NC metrics of every checkpoint not yet measured, into the store.",
               align_option_groups=False, help=f"""\
Compute the neural-collapse metrics of every checkpoint in STORE not yet measured.

    \b
    STORE (or --store) defaults to $NCANALYZE_STORE, else ./ncanalyze.zarr. The {len(SCALARS)} scalar metrics go into
    each checkpoint group's attributes (`metrics`), the per-class views into variables class_norm,
    class_cdnv, class_interference, class_duality and class_nc4; a checkpoint is measured again
    when its statistics or --min-count change. --device auto runs the pairwise sums and the d x d work in torch
    float64 on CUDA where torch sees a GPU (equal to the CPU's numba path to 1e-12), else on the CPU.
    It prints {", ".join(SHOWN)} per checkpoint
    (the metric records marked shown; every metric's card: the documentation's Metrics page).
    """)
@store_positional
@setting_groups(MEASURE_SECTIONS, "measure", MeasureSettings, more={"Run control": RUN_CONTROL})
def measure(store_positional, store, scheduler, force, **values):
    """Compute the neural-collapse metrics of every checkpoint in STORE not yet measured (the help: its count of
    metrics is SCALARS')."""
    import pandas as pd
    from ncanalyze.store.measure import measure_store

    settings = settings_of(MeasureSettings, values)  # a bad value: its one line, before the store is opened
    min_count = settings.min_count
    store = open_store(store_positional, store)
    result = measure_store(store, min_count=min_count, scheduler=scheduler, tile=settings.tile, force=force,
                           device=settings.device, se=settings.se,
                           threads_setting=settings.threads)
    every, failed = [*result.measured, *result.skipped, *result.failed], result.failed
    left_out = f", {len(result.checkpoints(failed))} left out (see above)" if failed else ""
    if not result.measured:
        click.echo(f"all {_count(result, result.skipped)} in {shown(store)} already measured (min_count={min_count})"
                   f"{left_out}; --force measures them again")
        return
    sublayers = not result.new.site.fillna("resid:").str.startswith("resid:").all()  # --sites attn:B, mlp:B
    layer = ["layer", *(["site"] * sublayers)] if result.has_layers else []
    labels = ["labels"] if (result.new["labels"] != "next").any() else []  # shown where some are not the next token
    table = result.new[["run", "checkpoint", *layer, *labels, "global_step", *SHOWN]].assign(  # names as text, never
        run=result.new.run.map(shown), checkpoint=result.new.checkpoint.map(shown),  # escapes
        **{c: result.new[c].map(shown) for c in labels})
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        click.echo(table.to_string(index=False, float_format="{:.4g}".format))
    click.echo(f"measured {_count(result, result.measured, every)} in {shown(store)} (min_count={min_count}){left_out}"
               f"; all {len(SCALARS)} metrics: ncanalyze report, or the group attributes `metrics`")


def _count(result, groups: list[str], of: list[str] | None = None) -> str:
    """'3 of 4 checkpoints' (``of``: the groups counted against), and in a store with layers also its layer groups,
    '(12 of 16 layer groups, ...)': a checkpoint is counted once, however many layers it has."""
    def n(gs: list[str], f) -> str:
        return f"{len(f(gs))}" + ("" if of is None else f" of {len(f(of))}")

    line = f"{n(groups, result.checkpoints)} checkpoints"
    if result.has_layers:
        line += f" ({n(groups, list)} layer groups, each checkpoint's last layer included)"
    return line
