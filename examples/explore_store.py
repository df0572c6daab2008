"""Open an ncanalyze store with xarray and look inside: the raw embeddings kept for a few tokens, and the
per-class CDNV (the ``class_cdnv`` variable ``ncanalyze measure`` writes) as a histogram.

    python examples/explore_store.py ncanalyze.zarr --tokens " the" " LORD" --out explore/

Prints the store's checkpoints, then for the chosen checkpoint (default: the largest model's latest) each
token's train count and its sampled embeddings (``ds.samples.sel(vocab=t)``), and writes
``embeddings.png`` (the samples of those tokens and their class means, projected on two principal axes)
and ``cdnv_hist.png`` (that checkpoint's per-class CDNV beside its run's first checkpoint). A starting point
for your own questions: every variable is an xarray DataArray.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import xarray as xr  # noqa: E402


def open_tree(path: str) -> xr.DataTree:
    try:
        import ncanalyze.store
    except ImportError:  # the package is not installed: the store is plain Zarr v3 all the same
        return xr.open_datatree(path, engine="zarr", consolidated=False)
    return ncanalyze.store.open(path)


def checkpoints(tree: xr.DataTree) -> pd.DataFrame:
    """One row per checkpoint group (a node holding ``count``), with its attributes."""
    rows = [{"group": node.path.strip("/"), **{k: node.attrs.get(k) for k in
             ("run", "checkpoint", "global_step", "n_params", "n_layers", "hidden_size", "eval_loss")}}
            for node in tree.subtree if "count" in node.data_vars]
    return pd.DataFrame(rows).sort_values(["n_params", "run", "global_step"]).reset_index(drop=True)


def find_var(tree: xr.DataTree, group: str, name: str) -> xr.DataArray | None:
    """``name`` in the checkpoint's group or in a subgroup of it (wherever ``ncanalyze measure`` put it)."""
    for node in tree[group].subtree:
        if name in node.data_vars:
            return node[name]
    return None


def token_id(spec: str, ds: xr.Dataset) -> int:
    """A token given as an id or as its decoded string, read as ``ncanalyze report --tokens`` reads it (one
    resolver): a bare word means its space-prefixed BPE token (``the`` -> `` the``) when there is one, as
    byte-level BPEs mark words that way."""
    import warnings

    from ncanalyze.core.errors import UserError
    from ncanalyze.analyzer.report.tokens import resolve_token

    strings = np.array(ds["token"].values.tolist(), dtype=object) if "token" in ds.coords else None
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            i = resolve_token(spec, strings, ds.attrs.get("tokenizer"), ds.sizes["vocab"])
    except UserError as e:
        raise SystemExit(f"error: {e}") from None
    for w in caught:
        print(f"  note: {w.message}")
    return i


def show_embeddings(ds: xr.Dataset, tokens: list[int], out: Path) -> None:
    fig, ax = plt.subplots(figsize=(5.5, 4.5))
    per_token = []
    for t in tokens:
        n = int(ds.n_samples.sel(vocab=t))
        emb = ds.samples.sel(vocab=t).values[:n]  # (n, hidden): the raw features kept for this token
        name = str(ds.token.sel(vocab=t).values) if "token" in ds.coords else str(t)
        mu = ds["mean"].sel(vocab=t).values
        print(f"  token {t:>5} {name!r:>12}: {int(ds['count'].sel(vocab=t)):>7} train occurrences, {n} samples kept, "
              f"|mean| {np.linalg.norm(mu):.2f}, within-class variance {float(ds.variance.sel(vocab=t)):.3f}")
        if n:
            print("      first sample, first 6 dims:", np.array2string(emb[0, :6], precision=3))
            per_token.append((name, emb, mu))
    if not per_token:
        print("  (no samples kept for these tokens)")
        return
    allx = np.concatenate([e for _, e, _ in per_token])
    centre = allx.mean(0)
    axes = np.linalg.svd(allx - centre, full_matrices=False)[2][:2].T  # the top two principal axes
    for name, emb, mu in per_token:
        p = (emb - centre) @ axes
        dots = ax.scatter(p[:, 0], p[:, 1], s=18, alpha=0.7, label=repr(name))
        m = (mu - centre) @ axes
        ax.scatter([m[0]], [m[1]], marker="X", s=120, color=dots.get_facecolor()[0], edgecolor="k")
    ax.set_xlabel("PC 1")
    ax.set_ylabel("PC 2")
    ax.set_title(f"sampled features (dots) and class means (X)\n{ds.attrs.get('run')}/{ds.attrs.get('checkpoint')}",
                 fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "embeddings.png", dpi=120)
    plt.close(fig)


def cdnv_histogram(curves: dict[str, xr.DataArray], out: Path) -> None:
    """One histogram per checkpoint (e.g. early and late in a run) of log10 per-class CDNV."""
    fig, ax = plt.subplots(figsize=(6, 3.8))
    logs = {g: np.log10(c.values[np.isfinite(c.values) & (c.values > 0)]) for g, c in curves.items()}
    bins = np.histogram_bin_edges(np.concatenate(list(logs.values())), bins=40)
    for group, cdnv in curves.items():
        values = cdnv.values[np.isfinite(cdnv.values)]
        print(f"  per-class CDNV of {group}, {len(values)} kept classes: median {np.median(values):.3g}, "
              f"10%-90% {np.quantile(values, 0.1):.3g} - {np.quantile(values, 0.9):.3g}")
        ax.hist(logs[group], bins=bins, alpha=0.55, label=group)
    ax.set_xlabel("log10 per-class CDNV (mean over the other kept classes)")
    ax.set_ylabel("classes")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "cdnv_hist.png", dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("store", help="an ncanalyze Zarr store")
    p.add_argument("--checkpoint", metavar="RUN/CHECKPOINT", help="default: the largest model's latest checkpoint")
    p.add_argument("--tokens", nargs="+", default=["the", "LORD", "God", "and"],
                   help="token ids or decoded strings")
    p.add_argument("--out", type=Path, default=Path("explore"), help="folder for the PNG figures")
    args = p.parse_args(argv)

    tree = open_tree(args.store)
    table = checkpoints(tree)
    if table.empty:
        raise SystemExit(f"error: {args.store} holds no checkpoints")
    with pd.option_context("display.width", 140, "display.max_rows", 200):
        print(table.drop(columns="group").to_string(index=False))
    group = args.checkpoint or table.iloc[-1]["group"]
    if group not in table["group"].values:
        raise SystemExit(f"error: no checkpoint {group!r} in {args.store}")
    ds = tree[group].to_dataset()
    print(f"\n{group}: {dict(ds.sizes)}, eval loss {ds.attrs.get('eval_loss')}")
    args.out.mkdir(parents=True, exist_ok=True)
    show_embeddings(ds, [token_id(t, ds) for t in args.tokens], args.out)
    run = table[table["group"] == group].iloc[0]["run"]
    first = table[table["run"] == run].sort_values("global_step").iloc[0]["group"]  # the run's earliest, to compare
    curves = {g: find_var(tree, g, "class_cdnv") for g in dict.fromkeys([first, group])}
    if any(v is None for v in curves.values()):
        print(f"  no class_cdnv in {group}: run `ncanalyze measure {args.store}` first for the CDNV histogram")
    else:
        cdnv_histogram(curves, args.out)
    print(f"figures in {args.out}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
