"""``ncanalyze rm``: remove checkpoints, runs or tags from a store, safely."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click
from ncanalyze.cli.common import open_store
from ncanalyze.cli.options import option
from ncanalyze.core.errors import UserError
from ncanalyze.core.names import shown
from ncanalyze.core.sizes import bytes_text

if TYPE_CHECKING:
    from ncanalyze.store.store import Store


def split_store(names: tuple[str, ...], store: str | None) -> tuple[Store, list[str]]:
    """The store and the groups from ``[STORE] GROUP...``: without --store, a first name that is a store (a folder
    holding zarr.json) is the store."""
    if not store and names and (Path(names[0]) / "zarr.json").is_file():
        return open_store(names[0], None), list(names[1:])
    return open_store(None, store), list(names)


@click.command(short_help="Remove checkpoints, runs or a tag from the store, safely.")
@click.argument("names", nargs=-1, metavar="[STORE] GROUP...")
@option("store", "rm")
@click.option("--tag", "tags", multiple=True, metavar="NAME",
              help="Remove every run extracted with --tag NAME (its <run>@NAME groups). Repeatable.")
@click.option("-y", "--yes", is_flag=True, help="Do not ask for confirmation (needed when stdin is not a terminal).")
@click.option("-n", "--dry-run", is_flag=True, help="List what would be removed, and remove nothing.")
def rm(names, store, tags, yes, dry_run):
    """Remove checkpoint groups (RUN/CHECKPOINT), whole runs (RUN) or tags (--tag NAME) from STORE (or --store;
    default $NCANALYZE_STORE, else ./ncanalyze.zarr), with their resume states.

    Each checkpoint is removed under the lock its extraction takes (a running extraction of it is waited for), moved
    out of the store in one rename and then deleted, so that an interrupted rm leaves the store whole. Asks for
    confirmation unless --yes. `ncanalyze ls` lists the names.

    \b
    Examples:
      ncanalyze rm neo-s0/checkpoint-100        # one checkpoint, all its layers
      ncanalyze rm runs.zarr neo-s0 --dry-run   # what removing a run would remove
      ncanalyze rm --tag heldout --yes          # every run extracted with --tag heldout
    """
    from ncanalyze.store.inventory import plan_removal, remove

    store, groups = split_store(names, store)
    if not groups and not tags:
        raise click.UsageError("name what to remove: RUN/CHECKPOINT, RUN or --tag NAME (`ncanalyze ls` lists them)")
    plan = plan_removal(store, groups, tags)
    what = (f"{len(plan.groups)} checkpoint group(s)" + (f" and run(s) {', '.join(map(shown, plan.runs))}"
                                                          if plan.runs else "")
            + (f" and link(s) {', '.join(map(shown, plan.links))} (the links only)" if plan.links else "")
            + f", {bytes_text(plan.bytes)}, from {shown(store)}")
    if not (yes or dry_run or sys.stdin.isatty()):
        raise UserError(f"not removing {what} without confirmation: pass --yes (stdin is not a terminal), or "
                        "--dry-run to list it")
    for g in [*plan.links, *plan.groups]:
        click.echo(f"  {shown(g)}")
    if dry_run:
        click.echo(f"would remove {what} (dry run: nothing removed)")
        return
    if not yes:
        click.confirm(f"remove {what}?", abort=True)
    left = remove(plan)
    click.echo(f"removed {what}" + (f"; left {shown(', '.join(left))}" if left else ""))
