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
argmin_c ||h_l - mu_c^(l)||^2 with the raw features and the layer's own (raw) means. The classifier stored with every
layer is the head as it is (so NC3 there is the duality of the head's rows with the layer's raw means).

``--save-embeddings N`` keeps the first N labelled train positions' features of every stored layer, staged as .npy
files in the resume folder during the train pass (so a resume keeps them) and written as the chunked variable
``embeddings (position, hidden)`` with ``label (position)`` when the checkpoint is done.
"""
from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import dask.array as da
import numpy as np
import torch
import xarray as xr

from ncanalyze.analyzer.accumulate import DecisionCounts
from ncanalyze.analyzer.errors import UserError
from ncanalyze.store.data import Blocks
from ncanalyze.store.io import position_chunk
from ncanalyze.store.passes import Extraction, batch_features, features, model_loss
from ncanalyze.store.resume import Phase, Saver, save_state

# where models keep their final norm, on the base model (GPT-2/GPT-Neo, Llama/Mistral/Gemma, OPT, GPT-NeoX, Falcon)
FINAL_NORMS = ("ln_f", "norm", "final_layer_norm", "decoder.final_layer_norm", "final_layernorm", "norm_f")
EMBEDDING_DTYPES = ("float32", "float16", "float64")


def resolve_layers(spec: str, n: int | None) -> list[int]:
    """``last``, ``all`` or comma-separated indices (negative from the end) as sorted indices into hidden_states
    (0..n)."""
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
    """What a layered extraction stores: ``layers`` (sorted, the last one always, as the checkpoint group), run in
    ``passes`` of at most ``per_pass`` layers; the first ``save_embeddings`` positions' features."""
    layers: tuple[int, ...]
    last: int
    per_pass: int
    save_embeddings: int
    embeddings_dtype: str

    @property
    def passes(self) -> list[tuple[int, ...]]:
        k = self.per_pass or len(self.layers)
        return [self.layers[i:i + k] for i in range(0, len(self.layers), k)]

    @property
    def widest_pass(self) -> int:
        return max(len(p) for p in self.passes)


def plan(layers: str, layers_per_pass: int | None, save_embeddings: int, embeddings_dtype: str,
         n: int | None) -> Plan | None:
    """The plan, or None for the default extraction (the last layer only, no embeddings)."""
    chosen = resolve_layers(layers, n)
    last = n if n is not None else -1
    if chosen == [last] and not save_embeddings:
        return None
    return Plan(tuple(sorted(set(chosen) | {last})), last, int(layers_per_pass or 0), int(save_embeddings),
                embeddings_dtype)


def final_norm(model) -> tuple[str, torch.nn.Module] | None:
    """(its path on the base model, the module) of the model's final norm, or None if none is known."""
    for path in FINAL_NORMS:
        m = model.base_model
        for part in path.split("."):
            m = getattr(m, part, None)
        if isinstance(m, torch.nn.Module):
            return path, m
    return None


def hidden_forward(model, layers: tuple[int, ...], last: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """ids (b x L) -> the chosen layers' features at every position but the last, stacked: (k, b, L-1, d). The last
    layer is ``last_hidden_state``; with only the last layer asked, no hidden states are formed."""
    if layers == (last,):
        return lambda ids: features(model, ids)[None]

    @torch.inference_mode()
    def forward(ids: torch.Tensor) -> torch.Tensor:
        out = model.base_model(input_ids=ids, output_hidden_states=True)
        return torch.stack([(out.last_hidden_state if l == last else out.hidden_states[l])[:, :-1] for l in layers])
    return forward


class LensCounts(DecisionCounts):
    """NC4's counts at one layer: the linear decision on ``lens(h)``, the nearest class mean on ``h`` with the
    layer's means. ``w``/``b`` (the kept rows of the head, float64) are shared between the layers."""

    def __init__(self, w: torch.Tensor, b: torch.Tensor, mean: torch.Tensor, kept: torch.Tensor,
                 counts: dict[str, torch.Tensor], lens: Callable[[torch.Tensor], torch.Tensor] | None,
                 budget: int = 1 << 25):
        self.kept, self.w, self.b, self.lens, self.counts = kept, w, b, lens, counts
        self.mu = mean.to(torch.float64)[kept]
        self.half_sq = 0.5 * (self.mu * self.mu).sum(1)
        self.chunk = max(1, budget // max(1, len(kept)))

    def update(self, h: torch.Tensor, y: torch.Tensor) -> None:
        if self.lens is None:
            return super().update(h, y)
        with torch.inference_mode():
            z = self.lens(h)
        h, z, y = h.to(torch.float64), z.to(torch.float64), y.to(self.mu.device, torch.int64)
        vocab = self.counts["val_count"].shape[0]
        for s in range(0, len(y), self.chunk):
            hc, zc, yc = h[s:s + self.chunk], z[s:s + self.chunk], y[s:s + self.chunk]
            linear = self.kept[(zc @ self.w.T + self.b).argmax(1)]
            ncc = self.kept[(hc @ self.mu.T - self.half_sq).argmax(1)]
            self.counts["val_count"] += torch.bincount(yc, minlength=vocab)
            self.counts["val_correct"] += torch.bincount(yc[linear == yc], minlength=vocab)
            self.counts["val_ncc_agree"] += torch.bincount(yc[linear == ncc], minlength=vocab)


class Prefixed:
    """The arrays of a saved state under ``prefix``, as :meth:`Extraction.load` reads them."""

    def __init__(self, arrays, prefix: str):
        self.arrays, self.prefix = arrays, prefix
        self.files = [k[len(prefix):] for k in arrays if k.startswith(prefix)] + ["phase", "batches"]

    def __getitem__(self, k: str):
        return self.arrays[k] if k in ("phase", "batches") else self.arrays[self.prefix + k]


class Embeddings:
    """The first ``n`` labelled train positions' features of each layer, their labels and stream positions, staged
    as .npy memory maps in ``folder`` (flushed before every state save, so a resume keeps what was written)."""

    def __init__(self, folder: Path, layers: tuple[int, ...], n: int, dim: int, dtype: str, resume: bool):
        folder.mkdir(parents=True, exist_ok=True)
        files = {**{l: folder / f"embeddings-{l}.npy" for l in layers}, "label": folder / "label.npy",
                 "position": folder / "position.npy"}
        if resume and not all(f.is_file() for f in files.values()):
            raise UserError(f"the saved embeddings of an interrupted extraction are missing from {folder}; pass "
                            "--overwrite to start this checkpoint again")
        mode = "r+" if resume else "w+"
        self.n = n
        self.h = {l: np.lib.format.open_memmap(files[l], mode, np.dtype(dtype), (n, dim)) for l in layers}
        self.label = np.lib.format.open_memmap(files["label"], mode, np.int64, (n,))
        self.position = np.lib.format.open_memmap(files["position"], mode, np.int64, (n,))

    def write(self, row: int, layer_h: dict[int, torch.Tensor], y: torch.Tensor, pos: np.ndarray) -> None:
        """Rows ``row``.. of the stream: features per layer, labels and positions (as much as fits in ``n``)."""
        take = min(self.n - row, len(pos))
        if take <= 0:
            return
        for l, h in layer_h.items():
            self.h[l][row:row + take] = h[:take].to(torch.float64 if self.h[l].dtype == np.float64
                                                    else torch.float32).cpu().numpy()
        self.label[row:row + take] = y[:take].cpu().numpy()
        self.position[row:row + take] = pos[:take]

    def flush(self) -> None:
        for m in (*self.h.values(), self.label, self.position):
            m.flush()

    def variables(self, layer: int, written: int) -> dict:
        """``stats_dataset``'s embedding arguments for ``layer``: a lazy dask array in ~32 MB chunks."""
        m = min(self.n, written)
        h = self.h[layer][:m]
        chunk = position_chunk(m, h.shape[1] * h.dtype.itemsize)
        return {"embeddings": da.from_array(h, chunks=(chunk, h.shape[1]), asarray=False),
                "embedding_label": np.array(self.label[:m]), "embedding_position": np.array(self.position[:m])}


class Layered:
    """The running state of a layered extraction (:class:`Plan`): an :class:`Extraction` per layer of the current
    pass, where the passes stand (``pass_index``, ``phase``, ``batches`` done in that phase), the finished passes'
    layers in ``folder`` (``layer-<l>.npz``), and the staged embeddings. It reads like an Extraction to the passes."""

    def __init__(self, plan_: Plan, vocab: int, dim: int, k: int, seed: int, device: torch.device, folder: Path):
        self.plan, self.folder = plan_, folder
        self.args = (vocab, dim, k, seed)
        self.device = device
        self.pass_index, self.phase, self.batches = 0, Phase.TRAIN, 0
        self.stream = ""  # as Extraction.stream: the hash of the blocks read in this phase, checked on resume
        self.transform = None  # the model's logit transform, once the validation pass has checked it (val_loss)
        self.ex = self._fresh()
        self.embeddings: Embeddings | None = None

    def reset(self) -> None:
        """Back to a fresh start (a discarded state)."""
        self.pass_index, self.phase, self.batches, self.stream = 0, Phase.TRAIN, 0, ""
        self.ex = self._fresh()
        self.start()

    def _fresh(self) -> dict[int, Extraction]:
        return {l: Extraction(*self.args, self.device) for l in self.plan.passes[self.pass_index]}

    @property
    def stats(self):  # what batch_features reads: the vocabulary size and the device
        return next(iter(self.ex.values())).stats

    def start(self, resume_arrays=None) -> None:
        """Load a saved state (or start afresh) and open the staged embeddings."""
        if resume_arrays is not None:
            self.pass_index = int(resume_arrays["pass"])
            self.phase, self.batches = Phase(int(resume_arrays["phase"])), int(resume_arrays["batches"])
            self.stream = str(resume_arrays["stream"]) if "stream" in resume_arrays else ""
            self.ex = self._fresh()
            for l, e in self.ex.items():
                e.restore(Prefixed(resume_arrays, f"layer{l}."))
        elif self.folder.exists():
            shutil.rmtree(self.folder)  # leftovers of an abandoned run
        if self.plan.save_embeddings:
            self.embeddings = Embeddings(self.folder, self.plan.layers, self.plan.save_embeddings,
                                         self.args[1], self.plan.embeddings_dtype, resume_arrays is not None)

    def state(self, record: dict) -> dict[str, np.ndarray]:
        if self.embeddings is not None:
            self.embeddings.flush()
        arrays = {"pass": np.array(self.pass_index)}
        for l, e in self.ex.items():
            arrays |= {f"layer{l}.{k}": v for k, v in e.state(record).items()
                       if k not in ("phase", "batches", "config")}
        return arrays | {"phase": np.array(int(self.phase)), "batches": np.array(self.batches),
                         "stream": np.array(self.stream), "config": np.array(json_record(record))}

    def run(self, model, train: Blocks, val: Callable[[], Blocks | None], classifier: torch.Tensor,
            bias: torch.Tensor | None, min_count: int, batch_size: int, saver: Saver, desc: str) -> None:
        """Every pass not yet done: its train pass, then its validation pass; a finished pass's layers go to disk."""
        norm = final_norm(model)
        while True:
            layers = tuple(self.ex)
            forward = hidden_forward(model, layers, self.plan.last)
            tag = f"{desc} layers {','.join(map(str, layers))}" if len(self.plan.passes) > 1 else desc
            if self.phase == Phase.TRAIN:
                self._train(model, train, forward, batch_size, saver, tag)
                self.phase, self.batches, self.stream = Phase.VALIDATION, 0, ""
                saver.maybe(force=True)
            if self.phase == Phase.VALIDATION:
                blocks = val()
                if blocks is not None:
                    self._validate(model, blocks, forward, norm, classifier, bias, min_count, batch_size, saver, tag)
                self.phase = Phase.DONE
            if self.pass_index == len(self.plan.passes) - 1:
                return
            for l, e in self.ex.items():
                save_state(self.folder / f"layer-{l}.npz", e.state({}))
            self.pass_index, self.phase, self.batches, self.stream = self.pass_index + 1, Phase.TRAIN, 0, ""
            self.ex = self._fresh()
            saver.maybe(force=True)

    def _train(self, model, blocks: Blocks, forward, batch_size: int, saver: Saver, desc: str) -> None:
        L = blocks.block_size
        for h, y, batch in batch_features(model, blocks, self, batch_size, saver, f"{desc} train", forward=forward):
            pos = ((self.batches * batch_size + np.arange(len(batch)))[:, None] * L + np.arange(L - 1)).ravel()
            labels = batch[:, 1:].ravel()
            for i, e in enumerate(self.ex.values()):
                e.stats.update(h[i], y)
                e.reservoir.update(h[i], labels, pos)
            if self.embeddings is not None:
                self.embeddings.write(self.batches * batch_size * (L - 1), dict(zip(self.ex, h)), y, pos)
        if next(iter(self.ex.values())).stats.count.sum() == 0:
            raise UserError(f"{blocks.spec} holds no full block of {L} tokens: the dataset is empty or shorter than "
                            "--block-size")

    def _validate(self, model, blocks: Blocks, forward, norm, classifier, bias, min_count: int, batch_size: int,
                  saver: Saver, desc: str) -> None:
        if norm is None and any(l != self.plan.last for l in self.ex):
            raise UserError(f"NC4 at layers other than the last needs the model's final norm, and none of "
                            f"{', '.join(FINAL_NORMS)} is on this model; pass --max-val-tokens 0 or --layers last")
        first = next(iter(self.ex.values()))
        kept = torch.nonzero(first.stats.count >= min_count).squeeze(1)  # the same at every layer: the same labels
        w = classifier.to(kept.device, torch.float64)[kept]  # the head's kept rows, shared by the layers
        b = (bias.to(kept.device, torch.float64)[kept] if bias is not None
             else torch.zeros(len(kept), dtype=torch.float64, device=kept.device))
        counts = {l: LensCounts(w, b, e.stats.mean, kept, e.val, None if l == self.plan.last else norm[1])
                  for l, e in self.ex.items()}
        last = list(self.ex).index(self.plan.last) if self.plan.last in self.ex else None
        loss = None
        if last is not None:  # the model's own loss, from the last layer, as the default path measures it
            self.transform, loss = model_loss(model, blocks, classifier, bias, self.ex[self.plan.last], desc)
        for h, y, _ in batch_features(model, blocks, self, batch_size, saver, f"{desc} validation", forward=forward):
            for i, c in enumerate(counts.values()):
                c.update(h[i], y)
            if loss:
                loss.update(h[last], y)

    def finished(self) -> Iterator[tuple[int, Extraction]]:
        """Every layer's finished state, one at a time: the earlier passes' from disk (on the CPU), then the last
        pass's."""
        for p in self.plan.passes[:-1]:
            for l in p:
                e = Extraction(*self.args, torch.device("cpu"))
                with np.load(self.folder / f"layer-{l}.npz", allow_pickle=False) as arrays:
                    e.restore(arrays)
                yield l, e
        yield from self.ex.items()

    def main(self) -> Extraction:
        """The last layer's state (the checkpoint group's)."""
        return self.ex[self.plan.last]

    def datasets(self, classifier: torch.Tensor, bias: torch.Tensor | None, tokens: list[str] | None, attrs: dict,
                 lens: str | None) -> tuple[xr.Dataset, Iterator[tuple[int, xr.Dataset]]]:
        """The checkpoint group's dataset (the last layer), and the other layers' ``(l, dataset)``, made one at a
        time as they are written. Each records ``layer`` and ``lens``: how NC4's linear decisions were made, "head(h)"
        at the last layer, "head(ln_f(h))" (the final norm's path on the base model) at the others."""
        written = int(self.main().stats.count.sum())

        def make(l: int, e: Extraction) -> xr.Dataset:
            emb = {} if self.embeddings is None else self.embeddings.variables(l, written)
            lens_ = "head(h)" if l == self.plan.last else f"head({lens}(h))"
            return e.dataset(classifier, bias, tokens, {**attrs, "layer": l, "lens": lens_}, **emb)

        others = ((l, make(l, e)) for l, e in self.finished() if l != self.plan.last)
        return make(self.plan.last, self.main()), others

    def cleanup(self) -> None:
        if self.folder.exists():
            shutil.rmtree(self.folder)


def json_record(record: dict) -> str:
    return json.dumps(record, sort_keys=True)


def record_layers(record: dict, plan_: Plan | None) -> None:
    """The configuration record names the layers resolved (indices), and not at all for the last layer alone, so
    ``--layers -1`` hashes as the default and ``all`` as its indices."""
    if plan_ is None or plan_.layers == (plan_.last,):
        record.pop("layers", None)
    else:
        record["layers"] = list(plan_.layers)
