"""Every extraction setting, defined once: its default, its validation, its flag and help, its ``--help`` section and
whether it is hashed (``ExtractConfig``). Light on purpose (no torch): ``ncanalyze extract --help`` builds its options
from these fields, and the library, the CLI and the training callback refuse a bad value with the same one line.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from ncanalyze.core import setting
from ncanalyze.core.errors import UserError
from ncanalyze.core.setting import CAP_MODES, DTYPES, MAX_TOKENS, STORED_DTYPES, whole_number

SECTIONS = ("Data", "Model", "Statistics", "Layers", "Hub", "Run control", "Cluster")  # ``extract --help``, in order
AUTO = "auto"  # --layers-per-pass auto
MAX_BLOCK = 2**20  # tokens per block at most (a million: above every model's context)
MAX_BATCH = 2**16  # blocks per forward pass at most
MAX_SAMPLES = 2**16  # raw features kept per class at most
MAX_LAYERS = 2**12  # layers per pass at most (above every model's depth)
MAX_STATE_EVERY = 86_400.0 * 365  # seconds between saves at most (a year)
PREFIXES = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
SIZE_RULE = ("a number of bytes, or a number and a unit: kB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers "
             "of 1024), in any case but a lowercase b (bits: 3Mb is refused), e.g. 40GB, 512MiB, 1e9")


def extract_setting(default: Any = None, *, hashed: bool, section: str, **how: Any):
    """An extraction setting (:func:`ncanalyze.core.setting.setting`), which must say whether it is ``hashed``:
    whether it determines the numbers, so goes into the config hash; its ``section`` is one of :data:`SECTIONS`."""
    assert section in SECTIONS, section
    return setting.setting(default, section=section, hashed=hashed, **how)


def extract_flag(name: str) -> str:
    """The command-line flag of the setting ``name``."""
    return setting.flag_of(setting.field_of(ExtractConfig, name))


def extract_refusal(name: str, reason: str, value: Any) -> UserError:
    """The one-line refusal of a setting's value: ``batch_size (--batch-size) must be between 1 and 65536, got 0``."""
    return setting.refused(setting.field_of(ExtractConfig, name), reason, value)


def parse_size(size: str | None) -> int | None:
    """The bytes of a ``--state-memory`` size, by one rule (:data:`SIZE_RULE`, stated in ``--help``): a number alone
    is bytes (``1e9``); a unit is an SI or IEC prefix (its case free) and an optional ``B``, which must be upper case:
    ``3Mb`` is megabits and refused, never read as megabytes. More than 0 bytes.

    Parameters
    ----------
    size
        The size, e.g. ``40GB``, ``512MiB``, ``1.5 GiB``, ``1e9``; None.

    Returns
    -------
    int or None
        The bytes (None for None).
    """
    if size is None:
        return None
    text = str(size).strip().replace(" ", "")
    number = text.rstrip("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
    unit = text[len(number):]
    if unit.endswith("b"):
        raise extract_refusal("state_memory", f"ends in a lowercase b, and a lowercase b is bits; write {number}{unit[:-1]}B for bytes", size)
    prefix = unit.removesuffix("B").lower()
    try:
        value = float(number)
    except ValueError:
        value = math.nan
    if prefix not in PREFIXES or not math.isfinite(value) or value * PREFIXES[prefix] > 2**62:
        raise extract_refusal("state_memory", f"is not a size: pass {SIZE_RULE}", size)
    if not int(value * PREFIXES[prefix]) > 0:
        raise extract_refusal("state_memory", "is not above 0 bytes: pass a size such as 40GB", size)
    return int(value * PREFIXES[prefix])


def _size(value: str) -> str:
    parse_size(value)
    return value


def _layers(value: str) -> str:
    """``last``, ``all`` (any case) or comma-separated integers; which indices the model has is asked at
    resolution, where its depth is known."""
    if not isinstance(value, str) or not value.strip(" ,"):
        raise ValueError("names no layer: pass last, all, or indices like 0,-1")
    spec = value.strip().lower()
    indices = [x for x in spec.split(",") if x.strip()]
    if spec not in ("last", "all") and not all(re.fullmatch(r"\s*[-+]?\d+\s*", x) for x in indices):
        raise ValueError("is not last, all or comma-separated integers like 0,6,12")
    return spec


def _sites(value: str | None) -> str | None:
    """Comma-separated ``kind:index`` (spaces and case free); which kinds and indices the model has is asked at
    resolution (sites.parse_sites), where its depth and anatomy are known."""
    if value is None or not str(value).strip(" ,"):
        return None
    items = [x.strip() for x in str(value).lower().split(",") if x.strip()]
    if not all(re.fullmatch(r"[a-z]+\s*:\s*[-+]?\d+", x) for x in items):
        raise ValueError("is not comma-separated sites kind:index, e.g. resid:2,attn:1,mlp:-1")
    return ",".join(re.sub(r"\s", "", x) for x in items)


def _per_pass(value: int | str | None) -> int | str:
    """``auto`` (None too: one pass where it fits) or a positive integer, as an int (so the record hashes alike)."""
    if value is None or value == AUTO:
        return AUTO
    return whole_number(value, MAX_LAYERS)


NEXT, CURRENT, FILE = "next", "current", "file:"  # --labels (store/extraction/labels.py)


def _labels(value: str) -> str:
    """``next``, ``current`` or ``file:PATH`` of an existing file; its content is checked against the train data
    when the job is resolved (labels.resolve_labels)."""
    if not isinstance(value, str) or not (value in (NEXT, CURRENT) or value.startswith(FILE)):
        raise ValueError(f"is not one of {NEXT}, {CURRENT}, {FILE}PATH")
    path = value[len(FILE):]
    if value.startswith(FILE) and not Path(path).is_file():
        raise ValueError(f"names no file ({path or 'no path given'}): pass file:PATH of an integer .npy aligned with "
                         "the train data's token ids")
    return value


_VAL_HELP = ("Validation data (NC4, val_loss), any form --dataset takes. Default: a sibling file (val.bin beside "
             "train.bin, validation.txt beside train.txt), else the --val-split of --dataset where it has one, else "
             "--val-split-percentage of the train data held out (never the train tokens).")


@dataclass(frozen=True)
class ExtractConfig:
    """Everything that determines the numbers (``hashed``, and so the config hash), plus how to run. Frozen: a changed
    value is a new configuration (``dataclasses.replace``), so every value and the settings that must go together are
    checked whenever one is made (:meth:`__post_init__`), by the library, the training callback and the CLI alike."""
    dataset: str = extract_setting(required=True, hashed=True, section="Data", metavar="SPEC", help=(
        "Train data: a Hub name, a local dataset folder, a .txt/.json/.jsonl/.parquet/.csv file, or token ids in .npy "
        "(1-D stream or 2-D blocks) or nanoGPT .bin (uint16 stream)."))
    val_dataset: str | None = extract_setting(hashed=True, section="Data", metavar="SPEC", help=_VAL_HELP)
    split: str = extract_setting("train", hashed=True, section="Data", help=(
        "Split of --dataset (slices like 'train[:95%]' work for local data)."))
    val_split: str = extract_setting("validation", hashed=True, section="Data", help="Split of the validation data.")
    # held out of the train data when no validation is given or found; recorded resolved, as val_held_out
    val_split_percentage: int = extract_setting(5, hashed=False, section="Data", metavar="P", minimum=0, maximum=99, help=(
        "With no validation data given or found, hold out the first P% of the train data as validation and train on "
        "the rest, as run_clm's validation_split_percentage: splits 'train[:P%]' and 'train[P%:]' (text, datasets), "
        "or the first P% of the blocks (.npy/.bin). 0: validate on --val-split of --dataset (a token file "
        "without a sibling is then refused)."))
    text_column: str = extract_setting("text", hashed=True, section="Data", help="Column holding the text.")
    block_size: int | None = extract_setting(hashed=True, section="Data", kind=int, minimum=2,
                                                 maximum=MAX_BLOCK, help=(
        "Block length for 1-D streams and text [default: the model's context, at most 1024]."))
    max_train_tokens: int | None = extract_setting(hashed=True, section="Data", kind=int, minimum=0,
                                                   maximum=MAX_TOKENS, help=(
        "Cap on train tokens read: whole blocks, spread over the whole split (see --cap-mode)."))
    max_val_tokens: int | None = extract_setting(hashed=True, section="Data", kind=int, minimum=0,
                                                 maximum=MAX_TOKENS, help=(
        "Cap on validation tokens read (as --max-train-tokens); 0 skips NC4."))
    # recorded resolved: None without a cap (config_record, cap_mode)
    cap_mode: str = extract_setting("spread", hashed=True, section="Data", choices=CAP_MODES, help=(
        "How a token cap reads a split: 'spread', whole blocks drawn over all of it (one from each of N equal "
        "stretches, N the blocks the cap allows; drawn with --seed, the same for every checkpoint and across a resume; "
        "text is tokenized whole into the token cache first); 'prefix', its first blocks. Recorded where a cap is set "
        "(attribute cap_mode; spread also in the config hash)."))
    batch_size: int = extract_setting(8, hashed=True, section="Statistics", minimum=1,
                                     maximum=MAX_BATCH, help="Blocks per forward pass.")
    # only its type is hashed, as device_type
    device: str = setting.shared("device", hashed=False, section="Model", help=(
        "auto (CUDA when present, else CPU), cpu, cuda, cuda:N."))
    dtype: str = extract_setting("float32", hashed=True, section="Model", choices=DTYPES, help=(
        "Model dtype; statistics are always accumulated in float64."))
    samples_per_class: int = extract_setting(8, hashed=True, section="Statistics", minimum=0, maximum=MAX_SAMPLES,
                                             help=(
        "Raw features kept per class (uniform reservoir sample)."))
    folds: int = extract_setting(8, hashed=True, section="Statistics", minimum=1, maximum=64, help=(
        "Disjoint folds of whole token blocks (block i -> fold i mod F) whose statistics are kept beside the totals, "
        "for each metric's jackknife error (<metric>_se); fewer where they do not fit --state-memory (said in the log "
        "and the attribute folds); 1 turns them off. With F > 1 the totals are the folds merged (attribute totals: "
        "folds), equal to F = 1's to float64 rounding, counts exactly."))
    tokenizer: str | None = extract_setting(hashed=True, section="Data", metavar="PATH_OR_NAME", help=(
        "Tokenizer for text data [default: the checkpoint's, else its run folder's]."))
    min_count: int = setting.shared("min_count", hashed=True, section="Statistics", help=(
        "Classes with fewer train tokens are left out of NC4's decisions (fixed at extraction: measuring with "
        "another --min-count reports NC4 as nan)."))
    seed: int = setting.shared("seed", hashed=True, section="Statistics", help=(
        "Seed of the reservoir sample and of the blocks a token cap draws (--cap-mode spread)."))
    # where, not what: the base's weights are in each adapter's weights fingerprint (the record's weights)
    base: str | None = extract_setting(hashed=False, section="Model", metavar="PATH", help=(
        "The base model of PEFT adapters (a model folder, or a Hub id in the local Hub cache), in place of the "
        "base_model_name_or_path of their adapter_config.json [default: that, a relative path read from the "
        "adapter's folder]."))
    allow_pickle: bool = extract_setting(False, hashed=False, section="Model", help=(
        "Load pickle weights (pytorch_model.bin); only for trusted files."))
    trust_remote_code: bool = extract_setting(False, hashed=False, section="Model", help=(
        "Allow custom model or tokenizer code from the checkpoint."))
    state_every: float = extract_setting(120.0, hashed=False, section="Run control", minimum=0,
                                         maximum=MAX_STATE_EVERY, help=(
        "Seconds between saves of the resume state (a killed run continues from the last save)."))
    keep_linebreaks: bool = extract_setting(True, hashed=True, section="Data", help=(
        "Plain text files (.txt, folders of them) keep each line's line break, as run_clm reads them; "
        "--no-keep-linebreaks strips them."))
    tag: str | None = extract_setting(hashed=False, section="Run control", metavar="NAME", help=(  # where, not what
        "Store these checkpoints under <run>@NAME/<checkpoint> (attribute and metrics.csv column `tag`): the same "
        "checkpoints measured on several datasets in one store."))
    token_cache: bool = extract_setting(True, hashed=False, section="Data", help=(
        "Tokenize text once into <store>.tokens/ (keyed by data, tokenizer, block size, cap and line breaks) and "
        "reuse it for every checkpoint; progress bars and the estimate then know the totals."))
    layers: str = extract_setting("last", hashed=True, section="Layers", metavar="last|all|I,J,...",
                          check=_layers, help=(  # recorded resolved (indices)
        "Layers to extract: transformers' hidden_states indices (0: the embedding output; the last: after the final "
        "norm, the checkpoint group itself), negative from the end. Others are stored at "
        "<run>/<checkpoint>/layers/<l>; NC4 there uses the logit lens (the head after the final norm)."))
    # not hashed itself: recorded resolved, with --layers's sites, in the record's layers (config_record)
    sites: str | None = extract_setting(hashed=False, section="Layers", metavar="SITE,...", check=_sites, help=(
        "Sites to extract beside --layers: resid:L (hidden_states[L], as --layers L), attn:B and mlp:B (the output "
        "of block B's attention and MLP sublayer, 0-based, before its residual add), negative from the end, e.g. "
        "attn:0,mlp:-1. A sublayer site is stored at <run>/<checkpoint>/sites/<kind>_<B> (attribute site)."))
    layers_per_pass: int | str | None = extract_setting(AUTO, hashed=True, section="Layers", kind=str,
                                                metavar="auto|K", check=_per_pass,
                                                maximum=MAX_LAYERS, help=(
        "At most K layers' state at a time: several passes over the data (exact either way); auto: as many as "
        "--state-memory holds, the deepest layers together."))
    state_memory: str | None = extract_setting(hashed=False, section="Layers", metavar="SIZE", check=_size, help=(
        f"Memory the float64 state may take under --layers-per-pass auto: {SIZE_RULE} [default: the device's free "
        "memory after the model, less a tenth (at least 1 GiB)]."))
    labels: str = extract_setting(NEXT, hashed=True, section="Statistics", metavar="next|current|file:PATH",
                                  check=_labels, help=(  # recorded only when not next (labels.Labels.record)
        "The class of a position: next, the next token (the paper's); current, the position's own token (every "
        "position of a block, the last included); file:PATH, an integer .npy of the train token ids' shape "
        "(token files only; -1 leaves a position out; classes 0..max), for which NC3, UNC3, NC4 and the head "
        "metrics are nan (no classifier for these classes)."))
    save_embeddings: int = extract_setting(0, hashed=True, section="Layers", metavar="N", minimum=0,
                                           maximum=MAX_TOKENS, help=(
        "Keep the first N train positions' features of each stored layer as a chunked Zarr array embeddings "
        "(position, hidden) with label (position)."))
    embeddings_dtype: str = extract_setting("float32", hashed=True, section="Layers",
                                    choices=STORED_DTYPES, help="dtype of --save-embeddings.")
    threads: int | str = setting.shared("threads", hashed=False, section="Run control",
                                         help=setting.THREADS_HELP)

    def __post_init__(self) -> None:
        """Each value checked and converted (setting.checked), then the rules across fields."""
        for f in fields(self):
            object.__setattr__(self, f.name, setting.checked(f, getattr(self, f.name)))
        if self.max_train_tokens is not None and self.min_count > self.max_train_tokens:
            fix = (f"raise --max-train-tokens to at least {self.min_count} (--min-count), or leave it out to read all"
                   if self.max_train_tokens < 1 or self.min_count == 1 else
                   f"lower --min-count to at most {self.max_train_tokens}, or raise --max-train-tokens")
            raise UserError(f"--min-count {self.min_count} is above --max-train-tokens {self.max_train_tokens}, so no "
                            f"class could be kept: {fix}")
