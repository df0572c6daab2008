"""The sizes of a checkpoint's extraction: the running state's per layer (:func:`state_bytes`) and the groups' in the
store (:func:`group_bytes`), the memory a pass may use
(``--state-memory``, else the device's free memory less a margin), the layers per pass that fit (``--layers-per-pass
auto``), and the check before the passes start.
"""
from __future__ import annotations

import logging

import psutil
import torch
from ncanalyze.analyzer.schema import NC4_MIN_COUNTS
from ncanalyze.core.errors import UserError
from ncanalyze.core.sizes import bytes_text
from ncanalyze.store.extraction.layers import Plan, auto_groups

log = logging.getLogger(__name__)

def state_bytes(vocab: int, dim: int, samples_per_class: int, device: torch.device) -> tuple[int, int]:
    """(bytes per layer, bytes shared by the layers) of an extraction's running state on ``device``, as the passes
    hold it (``tests/store/extraction/test_memory.py`` measures it). Per layer: the float64 means (vocab x d), the d x d scatter, the
    per-class vectors (count, M2, 3 validation counts, and in the validation pass the kept means' half squared
    norms; the means themselves are read in place), NC4's counts at each min_count (:func:`nc4_at_bytes`), its
    screen (:func:`screen_bytes`) and the unit-vector sum; on the CPU also the screen's float32 means (vocab x d) and
    the reservoir (float32 samples, their keys, positions and pool rows; at its most, every slot filled), which lives on
    the CPU whatever the device. Shared: the head's float64 copy
    and bias, and the kept classes' indices, one for the whole validation pass (the loss and every layer read it; the
    float32 screen of the linear decisions below the last layer reads it too, its float32 rows made a tile at a time).
    The batches' transient work (bounded chunks) is left to :func:`state_budget`'s margin.

    Parameters
    ----------
    vocab, dim : the head's shape.
    samples_per_class : the reservoir's samples per class.
    device : where the state lives.

    Returns
    -------
    (per_layer, shared) : bytes.
    """
    per_layer = vocab * dim * 8 + dim * dim * 8 + 6 * vocab * 8 + dim * 8 + nc4_at_bytes(vocab) + screen_bytes(vocab, dim)
    if device.type == "cpu":
        per_layer += vocab * samples_per_class * (4 * dim + 24) + vocab * dim * 4  # and NC4's float32 means
    return per_layer, vocab * dim * 8 + 2 * vocab * 8

def available_bytes(device: torch.device) -> int:
    """Free memory on ``device``: on CUDA torch.cuda.mem_get_info's free memory and what torch's caching allocator
    holds unallocated (a former checkpoint's state, freed, is still reserved there); psutil's available on the CPU."""
    if device.type == "cuda":
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(torch.cuda.mem_get_info(device)[0] + cached)
    return int(psutil.virtual_memory().available)

def nc4_at_bytes(vocab: int) -> int:
    """Bytes a layer's validation state adds for NC4 at each of ``NC4_MIN_COUNTS`` (at most): the two count rows per
    kept set (``val_correct_at``, ``val_ncc_agree_at``), one shared scratch count, and per kept set its classes'
    indices (every class kept)."""
    k = len(NC4_MIN_COUNTS)
    return 2 * k * vocab * 8 + vocab * 8 + k * vocab * 8


def screen_bytes(vocab: int, dim: int) -> int:
    """Bytes of a layer's NC4 screen (analyzer.screen.Screen) beside its float32 means (held on the CPU alone): the
    union of the kept sets twice (ascending, and in the screen's order), the shifted means' float32 offsets, each
    set's membership (one byte per class) and the shift (every class kept)."""
    return vocab * (8 + 8 + 4 + 1 + len(NC4_MIN_COUNTS)) + dim * 8


def group_bytes(vocab: int, dim: int, samples_per_class: int, layers: int = 1, embeddings: int = 0,
                embeddings_itemsize: int = 4, folds: int = 1) -> int:
    """A checkpoint's size in the store before compression: per stored layer the float64 means, the float32
    reservoir with its positions, the 7 per-class vectors and the d x d covariance, the fold sums (``folds`` > 1:
    :func:`fold_bytes` each) and the saved embeddings (and their labels); once per checkpoint, the float32 head (its
    layer groups refer to it)."""
    per_layer = vocab * dim * (8 + 4 * samples_per_class) + vocab * 8 * (7 + samples_per_class) + dim * dim * 8
    per_layer += len(NC4_MIN_COUNTS) * (2 * vocab * 8 + 8)  # val_correct_at, val_ncc_agree_at and their coordinate
    per_layer += folds * fold_bytes(vocab, dim) if folds > 1 else 0
    return layers * (per_layer + embeddings * (dim * embeddings_itemsize + 8)) + vocab * dim * 4

def state_budget(device: torch.device, state_memory: int | None = None) -> int:
    """The bytes ``--layers-per-pass auto`` lets a pass's state take.

    Parameters
    ----------
    device : where the state lives.
    state_memory : ``--state-memory`` in bytes, or None.

    Returns
    -------
    int : ``state_memory`` where given, else the free memory of ``device`` (after the model is loaded) less a margin
    for the forward's activations and the validation's logits: a tenth of it, at least 1 GiB.
    """
    if state_memory is not None:
        return int(state_memory)
    return budget_of(available_bytes(device))

def budget_of(free: int) -> int:
    """The state's share of ``free`` bytes: all but a margin for the forward's activations and the validation's
    chunks of logits and scores, a tenth of it and at least 1 GiB (e.g. on an 80 GiB GPU holding a model's weights,
    ``budget_of(80 * 2**30 - weights)``)."""
    return max(0, free - max(free // 10, 1 << 30))

def host_bytes(vocab: int, dim: int, samples_per_class: int, device: torch.device) -> int:
    """Bytes per layer the running state keeps in host memory beside a GPU's: the reservoir (float32 samples, their
    keys, positions and pool rows), which lives on the CPU whatever the device (0 on the CPU, where
    :func:`state_bytes` counts it). Its pool grows with the samples taken and the group's dense samples are made at
    the write, so this is the most it takes."""
    return 0 if device.type == "cpu" else vocab * samples_per_class * (4 * dim + 24)

def fit_plan(plan: Plan, vocab: int, dim: int, samples_per_class: int, device: torch.device,
             state_memory: int | None = None, host_memory: int | None = None) -> Plan:
    """``plan`` with its passes fitted to the memory under ``--layers-per-pass auto`` (:func:`layers.auto_groups`
    with :func:`state_bytes` and :func:`state_budget`), and beside a GPU to the host memory the pass's reservoirs
    take (:func:`host_bytes`), whichever holds fewer layers; any other plan as it is. The fold sums take what the
    passes leave (:func:`fit_folds`: fewer folds where they do not fit, said), so the totals of every group are the
    same under any memory and the folds may be fewer.

    Parameters
    ----------
    plan : the extraction's plan.
    vocab, dim : the head's shape.
    samples_per_class : the reservoir's samples per class.
    device : where the state lives.
    state_memory : ``--state-memory`` in bytes (None: the free memory less a margin).
    host_memory : the host memory the reservoirs may take beside a GPU (None: the host's free memory less a margin).

    Returns
    -------
    Plan : the plan to run.
    """
    if not plan.auto:
        return plan
    fitted = auto_groups(plan, *state_bytes(vocab, dim, samples_per_class, device), state_budget(device, state_memory))
    host = host_bytes(vocab, dim, samples_per_class, device)
    if host:
        budget = host_memory if host_memory is not None else state_budget(torch.device("cpu"))
        if budget < host:
            raise UserError(f"the reservoir of one layer (--samples-per-class {samples_per_class}) needs "
                            f"~{bytes_text(host)} of host memory but {bytes_text(budget)} is free: lower "
                            "--samples-per-class")
        by_host = auto_groups(plan, host, 0, budget)
        if by_host.widest_pass < fitted.widest_pass:
            log.info("--layers-per-pass auto: the host memory holds the reservoirs of %d layers a pass (%s "
                     "each at --samples-per-class %d; fewer samples, more layers a pass)", by_host.widest_pass,
                     bytes_text(host), samples_per_class)
            fitted = by_host
    if len(fitted.passes) > 1:
        log.info("--layers-per-pass auto: %d passes of at most %d layers (%s)", len(fitted.passes),
                 fitted.widest_pass, "; ".join(",".join(str(s.recorded) for s in p) for p in fitted.passes))
    return fitted

def check_memory(sizes: tuple[int, int], per_pass: int | None, device: torch.device,
                 available: int | None = None) -> None:
    """A UserError if the state of ``per_pass`` layers (1 without --layers) does not fit in the ``available`` memory
    of ``device`` (default: what is free now), naming how many layers per pass would."""
    per_layer, shared = sizes
    k = per_pass or 1
    free = available_bytes(device) if available is None else available
    if k * per_layer + shared <= free:
        return
    fits = (free - shared) // per_layer
    hint = (f"pass fewer --layers, or --layers-per-pass {fits} (several passes over the data, exact either way)"
            if fits >= 1 else "use a device with more memory, or --device cpu")
    raise UserError(f"the float64 state of {k} layer(s) needs ~{bytes_text(k * per_layer + shared)} on {device} "
                    f"but {bytes_text(free)} is free: {hint}")

def fold_bytes(vocab: int, dim: int) -> int:
    """Bytes one fold adds to a layer's running state and its group: its float64 means (vocab x d), d x d scatter,
    count, M2, 3 validation counts and NC4's agreements under the means without it per class, and its unit-vector sum
    (accumulate.FoldStats, DecisionCounts' fold counts)."""
    return vocab * dim * 8 + dim * dim * 8 + 6 * vocab * 8 + dim * 8


def leave_out_bytes(vocab: int, dim: int, device: torch.device) -> int:
    """Bytes one fold adds to a layer's validation pass beside :func:`fold_bytes`: the screen of the means without
    it (accumulate.WithoutFold: the float32 means of the classes fold f holds, on the CPU alone; at most every class,
    as :func:`screen_bytes` for one set) and its kept classes' indices and masks (every class kept)."""
    return vocab * (8 + 8 + 8 + 4 + 1 + 8) + dim * 8 + (vocab * dim * 4 if device.type == "cpu" else 0)

def fit_folds(folds: int, vocab: int, dim: int, samples_per_class: int, layers: int, device: torch.device,
              state_memory: int | None = None, budget: int | None = None) -> int:
    """The folds the state of ``layers`` layers a pass can keep beside its totals within the memory budget
    (``--state-memory``, else the free memory less a margin; ``budget`` in bytes overrides both): ``folds``, or
    fewer where they do not fit (said in the log), 1 (none) where not even 2 do.

    Parameters
    ----------
    vocab, dim : the head's shape.
    samples_per_class : the reservoir's samples per class.
    layers : the layers of the widest pass.
    device : where the state lives.
    state_memory, budget : the memory the state may take.

    Returns
    -------
    int : the folds to keep.
    """
    if folds <= 1:
        return 1
    per_layer, shared = state_bytes(vocab, dim, samples_per_class, device)
    room = (budget if budget is not None else state_budget(device, state_memory)) - shared - layers * per_layer
    each = fold_bytes(vocab, dim) + leave_out_bytes(vocab, dim, device)
    fits = max(0, room) // max(1, layers * each)
    if fits >= folds:
        return folds
    kept = int(fits) if fits >= 2 else 1
    log.warning("--folds %d: the fold statistics of %d layer(s) need ~%s but %s is left of the state's memory; "
                "keeping %s (attribute folds)", folds, layers, bytes_text(folds * layers * each),
                bytes_text(max(0, room)), f"{kept} folds" if kept > 1 else "no folds: no jackknife errors")
    return kept
