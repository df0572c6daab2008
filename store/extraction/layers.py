"""NC at every depth in the same pass (``--layers``), and raw embeddings kept as chunked Zarr (``--save-embeddings``).

Layer l is transformers' ``hidden_states[l]``: 0 the embedding output, n (the number of blocks) the last hidden state
after the final norm, the input of the output layer, i.e. the features a checkpoint group holds (taken from
``last_hidden_state``, so it is bit for bit the default extraction's). One forward pass with
``output_hidden_states=True`` feeds every layer of a pass its own exact float64 statistics (count, mean, variance,
within-class covariance) and reservoir, all of the raw ``h_l``. ``--layers-per-pass K`` splits the layers into
passes over the data of at most K layers each (exact either way: every layer sees the same batches in the same
order); a finished pass's layers wait in the resume folder, off the device.

NC4 at a layer l < n uses the logit lens: the linear decision is the model's own head applied to the layer's
features after the model's final norm, argmax_c (w_c . final_norm(h_l) + b_c), and the nearest-class-mean decision is
argmin_c ||h_l - mu_c^(l)||^2 with the raw features and the layer's own (raw) means. The classifier every layer's
dataset exposes is the head as it is (so NC3 there is the duality of the head's rows with the layer's raw means),
stored once, in the checkpoint group, whose layer groups refer to it (classifier.py).

``--save-embeddings N`` keeps the first N labelled train positions' features of every stored layer, staged as .npy
files in the resume folder during the train pass (so a resume keeps them) and written as the chunked variable
``embeddings (position, hidden)`` with ``label (position)`` when the checkpoint is done. The staged files get their
disk space when made (a full disk fails there, never later as a SIGBUS), carry a running sha256 of their rows in
the resume state, and are reopened only when their header, size and rows are the ones saved.

The default extraction is the plan of the last layer alone: the same running state (running.py) and passes
(passes.py) serve both.
"""
from __future__ import annotations

import errno
import hashlib
import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path

import dask.array as da
import numpy as np
import torch
from ncanalyze.core.errors import CheckpointError, UserError
from ncanalyze.core.sizes import bytes_text
from ncanalyze.store.chunks import position_chunk
from ncanalyze.store.extraction.resume import RESTART
from ncanalyze.store.extraction.sites import RESID, Site, parse_sites

log = logging.getLogger(__name__)

# where models keep their final norm, on the base model (GPT-2/GPT-Neo, Llama/Mistral/Gemma, OPT, GPT-NeoX, Falcon)


def resolve_layers(spec: str, n: int | None) -> list[int]:
    """``last``, ``all`` or comma-separated indices (negative from the end) as sorted indices into hidden_states.

    Parameters
    ----------
    spec : the ``--layers`` value.
    n : the model's number of blocks (hidden_states 0..n), or None where its config does not say.

    Returns
    -------
    list of int : sorted, distinct indices (``[-1]`` for ``last`` when ``n`` is None).
    """
    spec = str(spec).strip().lower()
    if spec == "last":
        return [n] if n is not None else [-1]
    if n is None:
        raise UserError(f"--layers {spec} needs the model's number of layers, which its config does not name; use "
                        "--layers last")
    if spec == "all":
        return list(range(n + 1))
    try:
        asked = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--layers {spec!r} is not last, all or comma-separated integers like 0,6,12") from None
    bad = [i for i in asked if not -(n + 1) <= i <= n]
    if not asked or bad:
        raise UserError(f"--layers {spec!r}: layer(s) {bad} outside 0..{n} (this model has {n} blocks: hidden_states "
                        f"0..{n}, negative counting from the end); pass indices in that range")
    return sorted({i % (n + 1) for i in asked})


@dataclass(frozen=True)
class Plan:
    """What an extraction stores: ``layers``, its sites (``Site`` values in forward order, the last layer always, as
    the checkpoint group; the residual sites are ``--layers``'s), run in ``passes`` of at most ``per_pass`` sites; the first ``save_embeddings`` positions' features. The default
    extraction is the plan of the last layer alone without embeddings (:attr:`single`). ``auto``
    (``--layers-per-pass auto``): the passes are ``groups``, once :func:`auto_groups` has fitted them to the memory
    (one pass until then)."""
    layers: tuple[Site, ...]
    last: Site
    per_pass: int
    save_embeddings: int
    embeddings_dtype: str
    auto: bool = False
    groups: tuple[tuple[Site, ...], ...] = ()

    @property
    def passes(self) -> list[tuple[Site, ...]]:
        if self.groups:
            return list(self.groups)
        k = self.per_pass or len(self.layers)
        return [self.layers[i:i + k] for i in range(0, len(self.layers), k)]

    @property
    def widest_pass(self) -> int:
        return max(len(p) for p in self.passes)

    @property
    def single(self) -> bool:
        """The last layer alone, no embeddings (the default): one pass that the ranks of a DDP training share."""
        return self.layers == (self.last,) and not self.save_embeddings


def plan(layers: str = "last", layers_per_pass: int | str | None = None, save_embeddings: int = 0,
         embeddings_dtype: str = "float32", n: int | None = None, sites: str | None = None) -> Plan:
    """The plan of ``--layers``, ``--sites``, ``--layers-per-pass``, ``--save-embeddings`` and ``--embeddings-dtype``
    for a model of ``n`` blocks (None: not known; only ``last`` is then possible).

    Parameters
    ----------
    layers : ``last``, ``all`` or comma-separated indices into hidden_states (negative from the end): residual sites.
    layers_per_pass : at most this many layers per pass over the data (None or 0: all in one; ``auto``: as many as
        the memory holds, :func:`auto_groups`).
    save_embeddings : keep the first N labelled train positions' features of every layer.
    embeddings_dtype : their dtype on disk.
    n : the model's number of blocks.
    sites : ``--sites``, comma-separated sites (sites.parse_sites), beside ``layers``'s.

    Returns
    -------
    Plan : the plan (:attr:`Plan.single` for the last layer alone without embeddings, the default).
    """
    chosen = {Site(RESID, l) for l in resolve_layers(layers, n)} | set(parse_sites(sites, n))
    last = Site(RESID, n if n is not None else -1)
    auto = not layers_per_pass or layers_per_pass == AUTO
    if not auto and not (str(layers_per_pass).isdigit() and int(layers_per_pass) >= 1):
        raise UserError(f"--layers-per-pass {layers_per_pass!r} is not auto or a positive integer")
    return Plan(tuple(sorted(chosen | {last})), last, 0 if auto else int(layers_per_pass or 0),
                int(save_embeddings), embeddings_dtype, auto)


AUTO = "auto"  # --layers-per-pass auto


def auto_groups(plan_: Plan, per_layer: int, shared: int, budget: int) -> Plan:
    """An ``auto`` plan's passes: as many layers per pass as the float64 state (``per_layer`` bytes a layer, plus
    ``shared``) fits in ``budget`` bytes, the passes aligned on the deepest layers, so that the last pass (the whole
    forward) holds the most and the earlier ones stop early. Any other plan is returned as it is.

    Parameters
    ----------
    plan_ : the extraction's plan.
    per_layer, shared : the state's bytes per layer and shared by the layers (memory.state_bytes).
    budget : the bytes the state may take (``--state-memory``, or the free memory less a margin).

    Returns
    -------
    Plan : ``plan_`` with its ``groups`` set (``auto`` plans only).
    """
    if not plan_.auto:
        return plan_
    fits = (budget - shared) // per_layer
    if fits < 1:
        raise UserError(f"the float64 state of one layer needs ~{bytes_text(per_layer + shared)} but the state "
                        f"may take {bytes_text(budget)}: raise --state-memory, or use a device with more memory "
                        "(or --device cpu)")
    n = len(plan_.layers)
    k = min(n, int(fits))
    starts = [0, *range(n % k or k, n, k)] if n % k else list(range(0, n, k))
    groups = tuple(plan_.layers[a:b] for a, b in zip(starts, [*starts[1:], n]))
    return replace(plan_, groups=groups)


def fit_embeddings(plan_: Plan, positions: int | None) -> Plan:
    """The plan with ``--save-embeddings`` capped at the labelled train positions there are, so that a larger N
    stages only what exists.

    Parameters
    ----------
    plan_ : the extraction's plan.
    positions : the train positions (blocks x (block size - 1)); None where the data's length is not known.

    Returns
    -------
    Plan : ``plan_``, its ``save_embeddings`` at most ``positions``.
    """
    if positions is None or plan_.save_embeddings <= positions:
        return plan_
    return replace(plan_, save_embeddings=positions)


class Embeddings:
    """The first ``n`` labelled train positions' features of each layer, their labels and stream positions, staged
    as .npy memory maps in ``folder`` (flushed before every state save, so a resume keeps what was written).

    Each file's rows written so far carry a running sha256 (:meth:`state_dict`, saved in the resume state): a resume
    reads them again and refuses files whose rows are not the ones saved (``saved``: the state's ``embeddings``)."""

    def __init__(self, folder: Path, layers: tuple[Site, ...], n: int, dim: int, dtype: str, resume: bool,
                 saved: dict | None = None):
        folder.mkdir(parents=True, exist_ok=True)
        files = {**{l: folder / f"embeddings-{l.key}.npy" for l in layers}, "label": folder / "label.npy",
                 "position": folder / "position.npy"}
        if resume and not all(f.is_file() for f in files.values()):
            raise CheckpointError(f"the saved embeddings of an interrupted extraction are missing from {folder}; "
                                  f"{RESTART}")
        self.n = n
        self.h = {l: _staged(files[l], np.dtype(dtype), (n, dim), resume) for l in layers}
        self.label = _staged(files["label"], np.dtype(np.int64), (n,), resume)
        self.position = _staged(files["position"], np.dtype(np.int64), (n,), resume)
        self._maps = {l.key: m for l, m in self.h.items()} | {"label": self.label, "position": self.position}
        self._rows = dict.fromkeys(self._maps, 0)  # rows written, hashed and not
        self._done = dict.fromkeys(self._maps, 0)  # rows in the running digest
        self._sha = {k: hashlib.sha256() for k in self._maps}
        if resume:
            self._verify(saved or {}, files)

    def _verify(self, saved: dict, files: dict) -> None:
        """Hash each file's saved rows again and compare them with the state's digests."""
        for (k, m), path in zip(self._maps.items(), files.values()):
            entry = saved.get(k, {})
            rows = int(entry["rows"]) if "rows" in entry and np.shape(entry["rows"]) == () else -1
            if 0 <= rows <= self.n:
                self._rows[k] = self._done[k] = rows
                self._sha[k].update(m[:rows].reshape(-1).view(np.uint8))
            if rows < 0 or rows > self.n or self._sha[k].hexdigest() != str(entry.get("sha256")):
                raise CheckpointError(f"the staged embeddings {path} are not the ones saved (their first "
                                      f"{max(rows, 0)} rows fail the digest in the resume state); {RESTART}")

    def write(self, row: int, layer_h: dict[Site, torch.Tensor], y: torch.Tensor, pos: np.ndarray) -> None:
        """Rows ``row``.. of the stream: features per site, labels and positions (as much as fits in ``n``)."""
        take = min(self.n - row, len(pos))
        if take <= 0:
            return
        for l, h in layer_h.items():
            self.h[l][row:row + take] = h[:take].to(torch.float64 if self.h[l].dtype == np.float64
                                                    else torch.float32).cpu().numpy()
        self.label[row:row + take] = y[:take].cpu().numpy()
        self.position[row:row + take] = pos[:take]
        for k in (*(l.key for l in layer_h), "label", "position"):
            self._rows[k] = max(self._rows[k], row + take)

    def flush(self) -> None:
        """Flush the maps and take the rows written since the last flush into the running digests."""
        for k, m in self._maps.items():
            m.flush()
            if self._rows[k] > self._done[k]:
                self._sha[k].update(m[self._done[k]:self._rows[k]].reshape(-1).view(np.uint8))
                self._done[k] = self._rows[k]

    def state_dict(self) -> dict[str, dict[str, np.ndarray]]:
        """Per file (``<site key>``, ``label``, ``position``): the rows flushed and their sha256, for the resume state."""
        return {k: {"rows": np.array(self._done[k]), "sha256": np.array(self._sha[k].hexdigest())}
                for k in self._maps}

    def variables(self, layer: Site, written: int) -> dict:
        """``stats_dataset``'s embedding arguments for ``layer``: a lazy dask array in ~32 MB chunks."""
        m = min(self.n, written)
        h = self.h[layer][:m]
        chunk = position_chunk(m, h.shape[1] * h.dtype.itemsize)
        return {"embeddings": da.from_array(h, chunks=(chunk, h.shape[1]), asarray=False),
                "embedding_label": np.array(self.label[:m]), "embedding_position": np.array(self.position[:m])}


def _staged(path: Path, dtype: np.dtype, shape: tuple[int, ...], resume: bool) -> np.memmap:
    """A staged .npy of ``shape`` as a memory map: made with its disk space reserved (a full disk is ENOSPC here, the
    command's full-disk line, never a SIGBUS when a page is written later), or, on resume, reopened after checking
    that its header and size are those of ``shape`` (a truncated file is refused, never zero-filled)."""
    if resume:
        _check_staged(path, dtype, shape)
    else:
        try:
            made = np.lib.format.open_memmap(path, "w+", dtype, shape)
            del made
        except OSError as e:
            if e.errno not in (errno.EFBIG, errno.EINVAL, errno.EOVERFLOW):
                raise
            raise UserError(f"--save-embeddings {shape[0]}: {path.name} would be {_bytes(shape, dtype)} bytes, more "
                            f"than the file system holds in one file ({e.strerror}); lower --save-embeddings") from None
    if hasattr(os, "posix_fallocate"):  # not on macOS
        with open(path, "r+b") as f:  # reserved again on resume: a copied (sparse) file gets its blocks too
            os.posix_fallocate(f.fileno(), 0, os.fstat(f.fileno()).st_size)
    return np.lib.format.open_memmap(path, "r+")


def _bytes(shape: tuple[int, ...], dtype: np.dtype) -> int:
    return int(np.prod(shape, dtype=object)) * dtype.itemsize


def _check_staged(path: Path, dtype: np.dtype, shape: tuple[int, ...]) -> None:
    """Refuse (one line naming ``--restart``) a staged .npy whose header or size is not that of ``shape``."""
    readers = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
    try:
        with open(path, "rb") as f:
            found, fortran, kind = readers[np.lib.format.read_magic(f)](f)
            want = f.tell() + _bytes(shape, dtype)
        ok = (tuple(found), fortran, np.dtype(kind)) == (shape, False, dtype) and path.stat().st_size == want
        why = f"shape {tuple(found)} {np.dtype(kind)}, {path.stat().st_size} bytes; expected {shape} {dtype}, {want}"
    except (OSError, ValueError, KeyError, TypeError, SyntaxError) as e:
        ok, why = False, f"{type(e).__name__}: {e}"
    if not ok:
        raise CheckpointError(f"the staged embeddings {path} are not the ones saved ({why}); {RESTART}")
