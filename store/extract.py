"""One streamed pass of exact per-class statistics over the train tokens, then NC4 counts over validation.

For each checkpoint: features are the last hidden state after the final norm (the output layer's
input) at every position but the last of each block; labels are the next tokens. Statistics are
float64 and merged batch by batch (Chan), a reservoir keeps raw samples, and the running state is
saved atomically beside the store so a killed run resumes and ends bit-identical.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import xarray as xr
import zarr
from tqdm.auto import tqdm

from ncanalyze.analyzer.accumulate import ClassStats, DecisionCounts
from ncanalyze.analyzer.errors import UserError
from ncanalyze.store.data import Blocks, default_val_spec, open_blocks
from ncanalyze.store.discover import PICKLE_WEIGHTS, WEIGHTS, Checkpoint, discover, training_metadata
from ncanalyze.store.reservoir import Reservoir

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


@dataclass
class ExtractConfig:
    """Everything that determines the numbers (and so the config hash), plus how to run."""
    dataset: str
    val_dataset: str | None = None
    split: str = "train"
    val_split: str = "validation"
    text_column: str = "text"
    block_size: int | None = None
    max_train_tokens: int | None = None
    max_val_tokens: int | None = None
    batch_size: int = 8
    device: str = "auto"
    dtype: str = "float32"
    samples_per_class: int = 8
    tokenizer: str | None = None
    min_count: int = 1
    seed: int = 0
    allow_pickle: bool = False
    trust_remote_code: bool = False
    state_every: float = 120.0  # seconds between resume-state saves (0: every batch)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError("--device cuda was asked for but no CUDA device is visible; use --device cpu or auto")
    return torch.device(device)


# ---------------------------------------------------------------- model, tokenizer, identity

def load_model(ckpt: Checkpoint, cfg: ExtractConfig, device: torch.device):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own bars say what is going on
    safe = any((ckpt.path / w).is_file() for w in WEIGHTS)
    if not safe and not cfg.allow_pickle:
        raise UserError(f"{ckpt.path} has only pickle weights ({'/'.join(PICKLE_WEIGHTS)}), which can run arbitrary "
                        "code when loaded; convert them to safetensors or pass --allow-pickle if you trust the file")
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            str(ckpt.path), dtype=DTYPES[cfg.dtype], use_safetensors=safe, trust_remote_code=cfg.trust_remote_code,
            output_loading_info=True)
    except Exception as e:  # corrupt or truncated files, unknown architectures
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"cannot load the model in {ckpt.path}: {msg} (is the weight file complete? "
                        "custom code needs --trust-remote-code)") from None
    missing = [k for k in info.get("missing_keys", []) if "lm_head" not in k or not model.config.tie_word_embeddings]
    if missing:
        raise UserError(f"{ckpt.path}: the weight file lacks {len(missing)} tensors (e.g. {missing[0]}); "
                        "it is incomplete or from another architecture")
    return model.to(device).eval()


def load_config(ckpt: Checkpoint, cfg: ExtractConfig):
    """The checkpoint's model config, read without its weights."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(ckpt.path), trust_remote_code=cfg.trust_remote_code)
    except Exception as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"cannot read the model config in {ckpt.path}: {msg} (custom code needs "
                        "--trust-remote-code)") from None


def find_tokenizer(ckpt: Checkpoint, cfg: ExtractConfig):
    """The tokenizer named by --tokenizer, else the checkpoint's, else its run's; None if there is none."""
    from transformers import AutoTokenizer

    names = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
    candidates = [cfg.tokenizer] if cfg.tokenizer else [
        str(p) for p in (ckpt.path, ckpt.run_dir) if any((p / n).is_file() for n in names)]
    if not candidates:
        return None, None
    try:
        return AutoTokenizer.from_pretrained(candidates[0], trust_remote_code=cfg.trust_remote_code), candidates[0]
    except Exception as e:
        raise UserError(f"cannot load tokenizer {candidates[0]}: {str(e).splitlines()[0] if str(e) else e!r}; "
                        "pass --tokenizer with a local folder") from None


def weights_fingerprint(path: Path) -> str:
    """Size plus the first and last MiB of each weight file: cheap, and different for every checkpoint."""
    h = hashlib.sha256()
    for w in sorted(p for p in path.iterdir() if p.name.endswith((".safetensors", ".bin"))):
        size = w.stat().st_size
        h.update(f"{w.name}:{size}".encode())
        with open(w, "rb") as f:
            h.update(f.read(1 << 20))
            f.seek(max(0, size - (1 << 20)))
            h.update(f.read())
    return h.hexdigest()[:16]


def config_record(ckpt: Checkpoint, cfg: ExtractConfig, device: torch.device, block_size: int, val_spec: str,
                  val_split: str) -> dict:
    """The settings that determine a checkpoint's numbers; their hash guards resumes and re-runs."""
    keep = {k: v for k, v in dataclasses.asdict(cfg).items()
            if k not in ("device", "allow_pickle", "trust_remote_code", "state_every")}
    return {**keep, "val_dataset": val_spec, "val_split": val_split, "block_size": block_size,
            "device_type": device.type, "weights": weights_fingerprint(ckpt.path)}


def config_hash(record: dict) -> str:
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:16]


# ---------------------------------------------------------------- resume state

def state_path(store: Path, ckpt: Checkpoint) -> Path:
    """Resume state lives beside the store (``<store>.partial/``), so the Zarr hierarchy stays clean."""
    return store.with_name(store.name + ".partial") / ckpt.run / f"{ckpt.name}.npz"


def save_state(path: Path, arrays: dict[str, np.ndarray]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npz")
    try:
        np.savez(tmp, **arrays)
        os.replace(tmp, path)  # atomic: a kill leaves the old state or the new one
    finally:
        tmp.unlink(missing_ok=True)


def drop_state(path: Path) -> None:
    path.unlink(missing_ok=True)
    for d in (path.parent, path.parent.parent):
        if d.is_dir() and not any(d.iterdir()):
            d.rmdir()


def _differences(a: dict, b: dict) -> str:
    return ", ".join(f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k))


# ---------------------------------------------------------------- the passes

class Extraction:
    """The running state of one checkpoint's extraction: statistics, reservoir, validation counts."""

    def __init__(self, vocab: int, dim: int, k: int, seed: int, device: torch.device):
        self.stats = ClassStats(vocab, dim, device)
        self.reservoir = Reservoir(vocab, k, dim, seed)
        self.val = {n: torch.zeros(vocab, dtype=torch.int64, device=device) for n in DecisionCounts.NAMES}
        self.phase, self.batches = 0, 0  # phase 0: train pass, 1: validation pass, 2: done

    def state(self, record: dict) -> dict[str, np.ndarray]:
        arrays = {f"stats.{k}": v.cpu().numpy() for k, v in self.stats.state_dict().items()}
        arrays |= {f"reservoir.{k}": v for k, v in self.reservoir.state_dict().items()}
        arrays |= {f"val.{k}": v.cpu().numpy() for k, v in self.val.items()}
        return arrays | {"phase": np.array(self.phase), "batches": np.array(self.batches),
                         "config": np.array(json.dumps(record, sort_keys=True))}

    def load(self, arrays) -> None:
        self.stats.load_state_dict({k[6:]: arrays[k] for k in arrays.files if k.startswith("stats.")})
        self.reservoir.load_state_dict({k[10:]: arrays[k] for k in arrays.files if k.startswith("reservoir.")})
        for k in self.val:
            self.val[k].copy_(torch.as_tensor(arrays[f"val.{k}"]))
        self.phase, self.batches = int(arrays["phase"]), int(arrays["batches"])


@torch.inference_mode()
def features(model, ids: torch.Tensor) -> torch.Tensor:
    """Last hidden state after the final norm, at every position but the last: (b, L-1, d)."""
    return model.base_model(input_ids=ids).last_hidden_state[:, :-1]


def _check_ids(batch: np.ndarray, vocab: int, spec: str) -> None:
    lo, hi = int(batch.min()), int(batch.max())
    if lo < 0 or hi >= vocab:
        raise UserError(f"token id {hi if hi >= vocab else lo} in {spec} is outside the model's vocabulary "
                        f"(0..{vocab - 1}): the data was tokenized with another tokenizer? pass the right "
                        "--tokenizer or token files")


def _check_finite(h: torch.Tensor, where: str) -> None:
    if not torch.isfinite(h).all():
        raise UserError(f"NaN/Inf features in {where}: the checkpoint has diverged or the dtype overflows; "
                        "try --dtype float32, or exclude this checkpoint")


class Saver:
    """Saves the resume state every ``every`` seconds (and when asked), atomically."""

    def __init__(self, path: Path, record: dict, every: float):
        self.path, self.record, self.every, self.last = path, record, every, time.monotonic()

    def maybe(self, ex: Extraction, force: bool = False) -> None:
        if force or time.monotonic() - self.last >= self.every:
            save_state(self.path, ex.state(self.record))
            self.last = time.monotonic()


def batch_features(model, blocks: Blocks, ex: Extraction, cfg: ExtractConfig, saver: Saver, desc: str):
    """(features n x d, labels n, the batch of blocks) for every batch not yet done; after each is consumed it
    counts as done and the state may be saved."""
    vocab, device = ex.stats.count.shape[0], ex.stats.mean.device
    total = blocks.total and -(-blocks.total // cfg.batch_size)
    with tqdm(total=total, initial=ex.batches, desc=desc, unit="batch", leave=False) as bar:
        for batch in blocks.batches(cfg.batch_size, skip=ex.batches):
            _check_ids(batch, vocab, blocks.spec)
            ids = torch.from_numpy(batch).to(device)
            h = features(model, ids)
            _check_finite(h, f"{desc}, batch {ex.batches}")
            yield h.reshape(-1, h.shape[-1]), ids[:, 1:].reshape(-1), batch
            ex.batches += 1
            bar.update()
            saver.maybe(ex)


def train_pass(model, blocks: Blocks, ex: Extraction, cfg: ExtractConfig, saver: Saver, desc: str) -> None:
    """Class statistics and the reservoir; positions count tokens in the train stream."""
    L = blocks.block_size
    for h, y, batch in batch_features(model, blocks, ex, cfg, saver, f"{desc} train"):
        ex.stats.update(h, y)
        first = ex.batches * cfg.batch_size
        ex.reservoir.update(h, batch[:, 1:].ravel(), ((first + np.arange(len(batch)))[:, None] * L
                                                      + np.arange(L - 1)).ravel())
    if ex.stats.count.sum() == 0:
        raise UserError(f"{blocks.spec} ({cfg.split}) holds no full block of {L} tokens: the dataset is empty or "
                        "shorter than --block-size")


def val_pass(model, blocks: Blocks, ex: Extraction, classifier: torch.Tensor, bias: torch.Tensor | None,
             cfg: ExtractConfig, saver: Saver, desc: str) -> None:
    """NC4's decision counts over the classes kept at extraction (count >= --min-count)."""
    kept = torch.nonzero(ex.stats.count >= cfg.min_count).squeeze(1)
    counts = DecisionCounts(classifier, bias, ex.stats.mean, kept, counts=ex.val)
    for h, y, _ in batch_features(model, blocks, ex, cfg, saver, f"{desc} validation"):
        counts.update(h, y)


# ---------------------------------------------------------------- the store

def to_dataset(ex: Extraction, classifier: torch.Tensor, bias: torch.Tensor | None, tokens: list[str] | None,
               attrs: dict) -> xr.Dataset:
    s, r = ex.stats, ex.reservoir
    mean = s.mean.cpu().numpy()
    data = {
        "count": ("vocab", s.count.cpu().numpy()),
        "mean": (("vocab", "hidden"), mean),
        "variance": ("vocab", s.variance.cpu().numpy()),
        "within_covariance": (("hidden", "hidden2"), s.within_covariance.cpu().numpy()),
        "classifier": (("vocab", "hidden"), classifier.float().cpu().numpy()),
        **{k: ("vocab", v.cpu().numpy()) for k, v in ex.val.items()},
        "samples": (("vocab", "slot", "hidden"), r.samples),
        "n_samples": ("vocab", r.n_samples),
        "sample_position": (("vocab", "slot"), r.position),
    }
    if bias is not None:
        data["classifier_bias"] = ("vocab", bias.float().cpu().numpy())
    coords = {"vocab": np.arange(mean.shape[0])}
    if tokens is not None:
        coords["token"] = ("vocab", np.array(tokens, dtype=object))
    return xr.Dataset(data, coords=coords, attrs=attrs)


def _encoding(ds: xr.Dataset) -> dict:
    d = ds.sizes["hidden"]
    rows = max(1, min(ds.sizes["vocab"], (32 << 20) // (8 * d)))  # ~32 MB float64 chunks of class rows
    enc = {}
    for name, var in ds.data_vars.items():
        if "vocab" in var.dims:
            per_row = int(np.prod([ds.sizes[x] for x in var.dims if x != "vocab"]))
            n = max(1, min(ds.sizes["vocab"], (8 << 20) // max(1, per_row * var.dtype.itemsize)))
            enc[name] = {"chunks": tuple(min(rows, n) if x == "vocab" else ds.sizes[x] for x in var.dims)}
    return enc


def write_group(store: Path, group: str, ds: xr.Dataset) -> None:
    """Write the finished dataset, then mark the group complete: an interrupted write is never taken as done."""
    ds.attrs["complete"] = False
    ds.to_zarr(store, group=group, mode="w", consolidated=False, zarr_format=3, encoding=_encoding(ds))
    zarr.open_group(store, path=group, mode="r+", zarr_format=3).attrs["complete"] = True


def group_attrs(store: Path, group: str) -> dict | None:
    """The attributes of ``group`` if it exists, else None."""
    try:
        return dict(zarr.open_group(store, path=group, mode="r", zarr_format=3).attrs)
    except (FileNotFoundError, zarr.errors.GroupNotFoundError, KeyError):
        return None


# ---------------------------------------------------------------- orchestration

def _n_layers(config) -> int | None:
    for k in ("num_hidden_layers", "num_layers", "n_layer"):
        if isinstance(getattr(config, k, None), int):
            return getattr(config, k)
    return None


def _block_size(cfg: ExtractConfig, config) -> int:
    if cfg.block_size:
        return cfg.block_size
    n = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None) or 1024
    return min(int(n), 1024)


def _open(spec: str, split: str, cap: int | None, cfg: ExtractConfig, block_size: int, tokenizer) -> Blocks:
    tokenize = None if tokenizer is None else (lambda texts: tokenizer(texts)["input_ids"])
    return open_blocks(spec, split, block_size, cap, cfg.text_column, tokenize)


def _decoded(tokenizer, vocab: int) -> list[str] | None:
    if tokenizer is None:
        return None
    n = min(vocab, len(tokenizer))
    return tokenizer.batch_decode([[i] for i in range(n)]) + [""] * (vocab - n)


def extract_checkpoint(ckpt: Checkpoint, store: Path, cfg: ExtractConfig, overwrite: bool = False,
                       announce: Callable[[object, Blocks], None] | None = None) -> str:
    """Extract one checkpoint into ``<store>/<run>/<checkpoint>``; returns 'done', 'skipped' or 'resumed'.

    ``announce(model, train_blocks)`` is called before the passes start (the CLI prints its estimate there)."""
    device = resolve_device(cfg.device)
    block_size = _block_size(cfg, load_config(ckpt, cfg))
    if cfg.max_val_tokens == 0:
        val_spec, val_split = None, None
    elif cfg.val_dataset:
        val_spec, val_split = cfg.val_dataset, cfg.val_split
    else:
        val_spec, val_split = default_val_spec(cfg.dataset, cfg.val_split)
    record = config_record(ckpt, cfg, device, block_size, val_spec, val_split)
    chash = config_hash(record)

    existing = group_attrs(store, ckpt.group)
    if existing and existing.get("complete") and not overwrite:
        if existing.get("config_hash") == chash:
            return "skipped"
        raise UserError(f"{ckpt.group} is already in {store} under another configuration "
                        f"({_differences(json.loads(existing.get('config', '{}')), record)}); "
                        "rerun with the same options, or pass --overwrite to replace it")
    model = load_model(ckpt, cfg, device)  # only now: a finished checkpoint is skipped without loading weights
    tokenizer, tok_name = find_tokenizer(ckpt, cfg)
    spath = state_path(store, ckpt)
    out = model.get_output_embeddings()
    classifier, bias = out.weight.detach(), (out.bias.detach() if getattr(out, "bias", None) is not None else None)
    ex = Extraction(classifier.shape[0], classifier.shape[1], cfg.samples_per_class, cfg.seed, device)
    status = "done"
    if spath.exists():
        with np.load(spath, allow_pickle=False) as arrays:
            old = json.loads(str(arrays["config"]))
            if old != record and not overwrite:
                raise UserError(f"an interrupted extraction of {ckpt.group} in {store} used another configuration "
                                f"({_differences(old, record)}); rerun with the same options to resume it, "
                                "or pass --overwrite to start again")
            if old == record:
                ex.load(arrays)
                status = "resumed"
    saver = Saver(spath, record, cfg.state_every)

    train = _open(cfg.dataset, cfg.split, cfg.max_train_tokens, cfg, block_size, tokenizer)
    if announce:
        announce(model, train)
    if ex.phase == 0:
        train_pass(model, train, ex, cfg, saver, ckpt.group)
        ex.phase, ex.batches = 1, 0
        saver.maybe(ex, force=True)
    if ex.phase == 1:
        if val_spec is not None:
            val = _open(val_spec, val_split, cfg.max_val_tokens, cfg, block_size, tokenizer)
            val_pass(model, val, ex, classifier, bias, cfg, saver, ckpt.group)
        ex.phase = 2

    meta = training_metadata(ckpt)
    attrs = {
        "run": ckpt.run, "checkpoint": ckpt.name, **meta,
        "n_params": sum(p.numel() for p in model.parameters()), "n_layers": _n_layers(model.config),
        "hidden_size": int(classifier.shape[1]), "vocab_size": int(classifier.shape[0]),
        "model_type": model.config.model_type, "train_tokens": int(ex.stats.count.sum()),
        "val_tokens": int(ex.val["val_count"].sum()), "min_count": cfg.min_count, "block_size": block_size,
        "dataset": cfg.dataset, "split": cfg.split, "val_dataset": val_spec,
        "val_split": val_split, "tokenizer": tok_name, "dtype": cfg.dtype, "device": str(device),
        "samples_per_class": cfg.samples_per_class, "seed": cfg.seed, "source": str(ckpt.path.resolve()),
        "ncanalyze_version": _version(), "config_hash": chash, "config": json.dumps(record, sort_keys=True),
    }
    write_group(store, ckpt.group, to_dataset(ex, classifier, bias, _decoded(tokenizer, classifier.shape[0]), attrs))
    drop_state(spath)
    return status


def _version() -> str:
    from ncanalyze.cli.common import version
    return version()


def estimate(n_ckpts: int, model, train: Blocks, cfg: ExtractConfig, store: Path) -> str:
    """One line before starting: tokens, time (from a timed forward pass of this model) and disk."""
    device = next(model.parameters()).device
    vocab, d = model.get_output_embeddings().weight.shape
    ids = torch.randint(0, vocab, (cfg.batch_size, train.block_size), device=device)
    features(model, ids)  # warm-up
    t0 = time.perf_counter()
    features(model, ids)
    if device.type == "cuda":
        torch.cuda.synchronize()
    rate = cfg.batch_size * train.block_size / (time.perf_counter() - t0)
    per_ckpt = vocab * d * (8 + 4 + 4 * cfg.samples_per_class) + vocab * 8 * 6 + d * d * 8
    disk = f"~{n_ckpts * per_ckpt / 1e6:,.0f} MB in {store}"
    n_train, n_val = train.total and train.total * train.block_size, cfg.max_val_tokens
    if n_train is None:
        return (f"{n_ckpts} checkpoint(s); train tokens unknown (uncapped text: pass --max-train-tokens for a "
                f"bound); forward pass ~{rate:,.0f} tokens/s on {device}; {disk}")
    secs = n_ckpts * (n_train + (n_val or 0)) / rate
    took = f"{secs:,.0f} s" if secs < 120 else f"{secs / 60:,.1f} min" if secs < 7200 else f"{secs / 3600:,.1f} h"
    val = "no validation" if n_val == 0 else f"{n_val:,} val tokens" if n_val else "the validation split"
    return (f"{n_ckpts} checkpoint(s) x {n_train:,} train tokens + {val}; ~{took} "
            f"{'' if n_val is not None else '+ validation '}at ~{rate:,.0f} tokens/s on {device}; {disk}")


def extract(path: str | Path, store: str | Path, cfg: ExtractConfig, overwrite: bool = False,
            echo=print) -> dict[str, str]:
    """Extract every checkpoint under ``path`` into ``store``; returns {group: status}."""
    store = Path(store)
    ckpts = discover(path)
    zarr.open_group(store, mode="a", zarr_format=3)  # the root group, so the store opens even while empty
    todo = sum(overwrite or not (group_attrs(store, c.group) or {}).get("complete") for c in ckpts)
    announced = False

    def announce(model, train: Blocks) -> None:  # once, at the first checkpoint that does work
        nonlocal announced
        if not announced:
            echo(f"estimate: {estimate(todo, model, train, cfg, store)}")
            announced = True

    results = {}
    for ckpt in tqdm(ckpts, desc="checkpoints", unit="ckpt", disable=len(ckpts) < 2):
        results[ckpt.group] = extract_checkpoint(ckpt, store, cfg, overwrite, announce)
        echo(f"{ckpt.group}: {results[ckpt.group]}")
    return results
