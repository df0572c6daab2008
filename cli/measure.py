"""``ncanalyze measure``: the neural-collapse metrics of every checkpoint in the store not yet measured."""
from __future__ import annotations

import click
from ncanalyze.cli.common import resolve_store
from ncanalyze.cli.options import option, store_argument

SHOWN = ("nc1_cdnv", "nc1_trace", "nc2_etf_error", "gnc2_log_mean", "nc3_dual_error", "nc4_agreement")


@click.command(short_help="NC metrics of every checkpoint not yet measured, into the store.")
@store_argument("measure")
@option("min_count", "measure")
@option("scheduler", "measure")
@option("tile", "measure")
@option("device", "measure")
@click.option("--force", is_flag=True, help="Measure again checkpoints already measured.")
def measure(store_positional, store, min_count, scheduler, tile, device, force):
    """Compute the neural-collapse metrics of every checkpoint in STORE not yet measured.

    \b
    STORE (or --store) defaults to $NCANALYZE_STORE, else ./ncanalyze.zarr. The 23 scalar metrics go into each
    checkpoint group's attributes (`metrics`), the per-class views into variables class_norm,
    class_cdnv, class_interference, class_duality and class_nc4; a checkpoint is measured again
    when its statistics or --min-count change. --device auto runs the pairwise sums and the d x d work in torch
    float64 on CUDA where torch sees a GPU (equal to the CPU's numba path to 1e-12), else on the CPU.
    """
    import pandas as pd
    from ncanalyze.analyzer.schema import SCALARS
    from ncanalyze.store.measure import measure_store

    store = resolve_store(store_positional, store)
    df = measure_store(store, min_count=min_count, scheduler=scheduler, tile=tile, force=force, device=device)
    done = df.attrs["measured"]
    if not done:
        click.echo(f"all {len(df)} checkpoints in {store} already measured (min_count={min_count}); --force measures "
                   "them again")
        return
    rows = df[[f"{r}/{c}" in set(done) for r, c in zip(df.run, df.checkpoint)]]
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        click.echo(rows[["run", "checkpoint", "global_step", *SHOWN]].to_string(index=False,
                                                                              float_format="{:.4g}".format))
    skipped = df.attrs.get("skipped", {})
    click.echo(f"measured {len(done)} of {len(df)} checkpoints in {store} (min_count={min_count})"
               + (f", {len(skipped)} skipped (see above)" if skipped else "")
               + f"; all {len(SCALARS)} metrics: ncanalyze report, or the group attributes `metrics`")
