"""What a position's class is (``--labels``, SPEC section 2): ``next``, the next token (the paper's); ``current``, the
position's own token (every position of a block, the last included); ``file:PATH``, an integer ``.npy`` aligned with
the train data's token ids (-1 leaves a position out; classes 0..max). The one place that turns a batch of token
blocks (with, for a file, its aligned classes) into the positions whose features are kept and their labels: a new
label kind is a branch here (and, for classes that are not the vocabulary, :attr:`Labels.vocabulary`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from ncanalyze.analyzer.schema import CLASS_AXIS, FILE_CLASSES, LABELS
from ncanalyze.core.errors import UserError
from ncanalyze.store.data.blocks import is_token_file
from ncanalyze.store.data.identity import data_name, data_sha256
from ncanalyze.store.extraction.settings import CURRENT, FILE, NEXT


class Kept(NamedTuple):
    """A batch's kept positions: their labels, their positions in the train stream (each block's token index,
    block i at i * block_size) and which of the batch's b x width positions they are (None: all)."""
    y: np.ndarray
    pos: np.ndarray
    keep: np.ndarray | None

    def take(self, h: torch.Tensor) -> torch.Tensor:
        """The kept rows of features (..., b * width, d)."""
        return h if self.keep is None else h[..., torch.from_numpy(self.keep).to(h.device), :]

    def fold(self, fold: torch.Tensor | None) -> torch.Tensor | None:
        """The kept positions' folds."""
        return fold if fold is None or self.keep is None else fold[torch.from_numpy(self.keep).to(fold.device)]


@dataclass(frozen=True)
class Labels:
    """A ``--labels`` setting resolved: ``setting`` as written, ``classes`` the class axis's length for a file
    (max + 1; None: the model's vocabulary)."""
    setting: str = NEXT
    classes: int | None = None

    @property
    def path(self) -> str | None:
        """The label file (None for token labels)."""
        return self.setting[len(FILE):] if self.setting.startswith(FILE) else None

    @property
    def vocabulary(self) -> bool:
        """Whether the classes are the vocabulary, so that the model's head is their classifier (NC3, NC4)."""
        return self.path is None

    @property
    def end(self) -> int | None:
        """The positions of a block whose features are read: ``[:, :end]`` (the last has no next token)."""
        return -1 if self.setting == NEXT else None

    def width(self, block_size: int) -> int:
        """Positions read per block."""
        return block_size - 1 if self.setting == NEXT else block_size

    def size(self, vocab: int) -> int:
        """The class axis's length."""
        return vocab if self.classes is None else self.classes

    def rows(self, batch: np.ndarray, marks: np.ndarray | None, first: int) -> Kept:
        """The kept positions of ``batch`` (b x L token ids, blocks ``first``.. of the stream; ``marks`` the file's
        classes aligned with it) and their labels."""
        b, L = batch.shape
        w = self.width(L)
        pos = ((first + np.arange(b))[:, None] * L + np.arange(w)).ravel()
        if self.setting == NEXT:
            return Kept(batch[:, 1:].ravel(), pos, None)
        if self.setting == CURRENT:
            return Kept(batch.ravel(), pos, None)
        marks = marks.ravel()
        keep = marks >= 0
        return Kept(marks[keep].astype(np.int64), pos[keep], keep)

    @property
    def val_end(self) -> int | None:
        """The positions the validation pass reads: NC4's where the classes have a classifier (the vocabulary), else
        those of the model's own loss alone (every position but the last)."""
        return self.end if self.vocabulary else -1

    @staticmethod
    def next_token_features(h: torch.Tensor, blocks: int, end: int | None) -> torch.Tensor:
        """Of features read at the positions ``[:, :end]`` of ``blocks`` blocks (n x d), those of the positions that
        have a next token (the model's own loss)."""
        return h if end == -1 else h.reshape(blocks, -1, h.shape[-1])[:, :-1].reshape(-1, h.shape[-1])

    def attributes(self) -> dict:
        """The group's attributes naming them (none for the default, whose groups stay as they were): the setting,
        and for a file what the class axis holds (schema.CLASS_AXIS)."""
        if self.setting == NEXT:
            return {}
        if self.vocabulary:
            return {LABELS: self.setting}
        return {LABELS: self.setting, CLASS_AXIS: f"{FILE_CLASSES} 0..{self.classes - 1} of {data_name(self.path)}"}

    def record(self) -> dict:
        """What the configuration record holds (nothing for the default, whose records and hashes stay as they
        were; a file by its name and content)."""
        if self.setting == NEXT:
            return {}
        if self.path is None:
            return {"labels": self.setting}
        return {"labels": FILE + data_name(self.path), "labels_sha256": data_sha256(self.path)}


def resolve_labels(setting: str, dataset: str) -> Labels:
    """The setting checked against the train data ``dataset``: a label file must be an integer ``.npy`` of the
    token array's shape, its classes -1 (left out) or more, with at least one class. Once per file content."""
    if not setting.startswith(FILE):
        return Labels(setting)
    path = setting[len(FILE):]
    if not is_token_file(dataset):
        raise UserError(f"--labels {setting} needs token ids as --dataset (a .npy or .bin it is aligned with); "
                        f"{dataset} is text (or a dataset), whose token ids exist only once tokenized: save them as .npy "
                        "(examples/prepare_text.py), align the labels with that file and pass it as --dataset")
    try:
        st = os.stat(path)
    except OSError:
        raise UserError(f"no such label file: {path}; pass --labels file:PATH of an existing .npy") from None
    return Labels(setting, _classes(path, dataset, st.st_size, st.st_mtime_ns))


_SEEN: dict[tuple, int] = {}


def _classes(path: str, dataset: str, *stat) -> int:
    """max + 1 of the label file ``path``, checked against ``dataset``'s token array (remembered per file state)."""
    key = (path, dataset, *stat)
    if key in _SEEN:
        return _SEEN[key]
    marks, shape = _read(path), _token_shape(dataset)
    if marks.shape != shape:
        raise UserError(f"label file {path} has shape {marks.shape}, not the shape {shape} of the train data "
                        f"{dataset}: save one class per token id, aligned with it (-1 where a position has none)")
    low, high = int(marks.min()), int(marks.max())
    if low < -1:
        raise UserError(f"label file {path} holds {low}, below -1: classes are 0, 1, ... and -1 leaves a position "
                        "out; fix the file")
    if high < 0:
        raise UserError(f"label file {path} gives no position a class (all -1): fix the file")
    _SEEN[key] = high + 1
    return high + 1


def _read(path: str) -> np.ndarray:
    """The label file, memory-mapped, if it is a readable .npy of integers (else the one line saying how to save it)."""
    try:
        marks = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, EOFError, OSError) as e:
        raise UserError(f"label file {path} is not a readable .npy ({type(e).__name__}); save the labels with "
                        "np.save(path, labels.astype(np.int64))") from None
    if not isinstance(marks, np.ndarray) or not np.issubdtype(marks.dtype, np.integer):
        raise UserError(f"label file {path} holds {getattr(marks, 'dtype', 'an archive')}, not integers: classes "
                        "are integers 0, 1, ... (-1 leaves a position out); save labels.astype(np.int64)")
    return marks


def _token_shape(dataset: str) -> tuple[int, ...]:
    """The shape of a token file's array (a nanoGPT .bin: its uint16 count)."""
    if not Path(dataset).is_file():
        raise UserError(f"no such file: {dataset}; pass token ids (.npy or .bin) as --dataset")
    if dataset.endswith(".bin"):
        return (os.path.getsize(dataset) // 2,)
    return tuple(np.load(dataset, mmap_mode="r", allow_pickle=False).shape)
