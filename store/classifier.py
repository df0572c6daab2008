"""The classifier stored once per checkpoint (SPEC section 2): the output layer's ``classifier`` (vocab x hidden)
and ``classifier_bias`` (vocab) are coordinates of the checkpoint group ``<run>/<checkpoint>``, and its layer groups
``<run>/<checkpoint>/layers/<l>`` hold no copy of them: they refer to the checkpoint's.

- Writing (io.write_checkpoint, the one writer): :func:`on_checkpoint` makes the head of the checkpoint's dataset
  coordinates, :func:`without_head` drops it from each layer's.
- Reading: :func:`attach` gives each layer node of a store's tree the checkpoint's head (the same lazy arrays: nothing
  read, nothing copied), so ``tree[layer].to_dataset()`` and ``ds.nc.measure()`` work on any layer group; io's
  ``read_statistics`` takes it from :func:`checkpoint_group` for a layer group. Plain xarray reaches it with
  ``tree[layer].to_dataset(inherit="all_coords")`` on the tree of ``xr.open_datatree`` (xarray inherits only indexed
  coordinates by default).
"""
from __future__ import annotations

import xarray as xr
from ncanalyze.analyzer.schema import HEAD

LAYERS = "layers"  # a checkpoint's layer groups are <run>/<checkpoint>/layers/<l>
SITES = "sites"  # and its sublayer sites' <run>/<checkpoint>/sites/<kind>_<B> (store/extraction/sites.py)


def checkpoint_group(group: str) -> str:
    """The checkpoint group a group belongs to: ``run/ckpt`` for ``run/ckpt/layers/3`` (or ``run/ckpt/sites/attn_1``),
    and a checkpoint group itself.

    Parameters
    ----------
    group
        A group of the store.

    Returns
    -------
    str
        Its checkpoint's group.
    """
    owner, sep, layer = group.strip("/").rpartition(f"/{LAYERS}/")
    if sep and layer.isdigit():
        return owner
    owner, sep, site = group.strip("/").rpartition(f"/{SITES}/")
    return owner if sep and "/" not in site and site.rpartition("_")[2].isdigit() else group.strip("/")


def on_checkpoint(ds: xr.Dataset) -> xr.Dataset:
    """The checkpoint's dataset as written: its head (data variables in memory) as coordinates.

    Parameters
    ----------
    ds
        The checkpoint group's dataset.

    Returns
    -------
    xarray.Dataset
        The same variables (no copy), the head among the coordinates.
    """
    return ds.set_coords([h for h in HEAD if h in ds.data_vars])


def without_head(ds: xr.Dataset) -> xr.Dataset:
    """A layer's dataset as written: without the head, which the checkpoint group holds.

    Parameters
    ----------
    ds
        A layer group's dataset.

    Returns
    -------
    xarray.Dataset
        The other variables (no copy), its attributes.
    """
    return ds.drop_vars([h for h in HEAD if h in ds.variables])


def with_head(ds: xr.Dataset, checkpoint: xr.Dataset) -> xr.Dataset:
    """``ds`` (a layer group's) with the head of its ``checkpoint``'s dataset as coordinates: the same arrays, lazy
    where they are.

    Parameters
    ----------
    ds
        A layer group's dataset.
    checkpoint
        Its checkpoint group's dataset.

    Returns
    -------
    xarray.Dataset
        ``ds`` with the head.
    """
    return ds.assign_coords({h: checkpoint.variables[h] for h in HEAD if h in checkpoint.variables})


def attach(tree: xr.DataTree) -> xr.DataTree:
    """Give every layer node of a store's ``tree`` its checkpoint's head (:func:`with_head`), in place.

    Parameters
    ----------
    tree
        A store's tree (io.open_tree).

    Returns
    -------
    xarray.DataTree
        ``tree``.
    """
    for node in list(tree.subtree):
        path, own = node.path.strip("/"), node.to_dataset(inherit=False)
        owner = checkpoint_group(path)
        if owner != path and "mean" in own.data_vars:
            node.dataset = with_head(own, tree[owner].to_dataset(inherit=False))
    return tree
