"""``ncanalyze ls``: what a store holds, as a table or as JSON."""
from __future__ import annotations

import json

import click
from ncanalyze.cli.common import open_store
from ncanalyze.cli.options import store_argument
from ncanalyze.core.names import shown
from ncanalyze.core.sizes import bytes_text


def _layers(layers: list[int | str]) -> str:
    """[0, 1, 2, 6] as '0-2,6'; sublayer sites (``attn:1``) as they are."""
    runs: list[list] = []
    for l in layers:
        if runs and isinstance(l, int) and isinstance(runs[-1][-1], int) and l == runs[-1][-1] + 1:
            runs[-1].append(l)
        else:
            runs.append([l])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 2 else ",".join(map(str, r)) for r in runs)


def _short(value, width: int = 40) -> str:
    text = "-" if value is None else shown(value) if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= width else "…" + text[-(width - 1):]


def table(inv: dict) -> str:
    """The compact table of ``ls``: a row per checkpoint (the run named once), the settings that differ, and a
    summary line."""
    from tabulate import tabulate

    rows, last_run = [], None
    tagged = bool(inv["tags"])
    for e in inv["entries"]:
        r = e.row(inv["settings"])
        rows.append({"run": shown(r["run"]) if r["run"] != last_run else "", "checkpoint": shown(r["checkpoint"]),
                     "step": "-" if r["global_step"] is None else r["global_step"],
                     **({"tag": shown(r["tag"] or "-")} if tagged else {}), "layers": _layers(r["layers"]) or "-",
                     "dataset": _short(r["dataset"]),
                     **{k: _short(v, 24) for k, v in r["settings"].items() if k != "layers"},  # shown as stored
                     "measured": r["measured"] if r["status"] == "ok" else "-", "size": bytes_text(r["bytes"]),
                     "status": shown(r["status"])})
        last_run = r["run"]
    n = len(inv["entries"])
    ok = sum(e.status == "ok" for e in inv["entries"])
    summary = (f"{len(inv['runs'])} run(s), {n} checkpoint(s) ({n - ok} not ok), "
               f"tags: {shown(', '.join(inv['tags'])) or 'none'}; {bytes_text(inv['bytes'])} on disk in "
               f"{shown(inv['store'])} "
               f"(with its resume folder and {bytes_text(inv['token_cache_bytes'])} of token cache)")
    if inv["settings"]:
        summary += f"; settings that differ: {', '.join(inv['settings'])}"
    return (tabulate(rows, headers="keys", disable_numparse=True) + "\n" if rows else "") + summary


@click.command(short_help="What the store holds: runs, checkpoints, tags, layers, settings, sizes.")
@store_argument("ls")
@click.option("--json", "as_json", is_flag=True, help="One JSON object (store, bytes, runs, tags, settings, "
              "checkpoints) for scripts.")
def ls(store_positional, store, as_json):
    """List what STORE (or --store; default $NCANALYZE_STORE, else ./ncanalyze.zarr) holds.

    A row per checkpoint, runs by name and checkpoints in step order: its step, tag, stored layers, dataset, the
    extraction settings that differ across the store (the others are the same everywhere), whether it is measured
    (under which min_count; 'stale' when extracted again since), its size on disk, and its status (corrupt or
    interrupted groups are listed as such). Reads metadata only.

    \b
    Examples:
      ncanalyze ls
      ncanalyze ls runs.zarr
      ncanalyze ls --store runs.zarr --json | jq '.checkpoints[].group'
    """
    from ncanalyze.store.inventory import inventory

    inv = inventory(open_store(store_positional, store))
    if as_json:
        click.echo(json.dumps({"store": inv["store"], "bytes": inv["bytes"], "token_cache_bytes":
                               inv["token_cache_bytes"], "runs": inv["runs"], "tags": inv["tags"],
                               "settings": inv["settings"],
                               "checkpoints": [e.row(inv["settings"]) for e in inv["entries"]]}, indent=1))
    else:
        click.echo(table(inv))
