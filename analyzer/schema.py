"""The names everything else agrees on, defined once: a checkpoint dataset's variables (SPEC section 3), the metric
names (section 4) and the descriptive columns of a metrics table (section 5); and the one builder of a checkpoint
dataset, used by extraction (``ncanalyze.store``) and by :func:`ncanalyze.analyzer.class_stats`. The metric
families come from the metric records (``metric_records.py``).

Light on purpose (numpy only; xarray when a dataset is built), so the CLI and the report can import the names without the metrics'
compiled code.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ncanalyze.analyzer.metric_records import DEBIASED, GEOMETRY, NC, RECORDS

if TYPE_CHECKING:  # xarray loads in stats_dataset: the CLI's --help reads these names without it
    import xarray as xr

# The metrics' definitions' version: bumped whenever a definition of SPEC section 4 changes (2: erank's rounding cut,
# rankme, alpha-ReQ's weighted fit, CDNV over classes with a variance, coefficients of variation only where defined;
# 3: a coefficient of variation only where its mean is 3 standard errors above 0, classes whose means differ by less
# than rounding of the within-class spread refused; 4: nc1_cdnv_debiased, the class counts it rests on). A group measured under another version is measured again by
# `ncanalyze measure` and `report`.
METRICS_VERSION = 4
# the neural-collapse metrics, in SPEC order (section 4, first table), from their records (metric_records.py); each is a
# function of the same name in metrics.py
NC_METRICS = tuple(r.name for r in RECORDS if r.family == NC)
# metrics whose value is not scale-free, each with what is said wherever it is printed: outside the "lower is more
# collapse" reading and outside the NC Holm family (a family of their own; SPEC section 4)
SCALE_DEPENDENT = {r.name: r.scale for r in RECORDS if r.scale}
# the representation geometry beyond NC (section 4, second table); each is a function of the same name in spectral.py
GEOMETRY_METRICS = tuple(r.name for r in RECORDS if r.family == GEOMETRY)
# the budget-stable estimates beside the paper's plug-in values (SPEC section 4, "Budget-stable estimates"): each
# estimates what the whole population of tokens would give over a class set fixed by the split's token frequencies
# (DEBIAS_SHARE), so it does not drift with the token budget; each is a family of its own in the report's tests.
# Where no sound correction exists, the plug-in metric's docstring says so (metrics.py, spectral.py).
DEBIASED_METRICS = tuple(r.name for r in RECORDS if r.family == DEBIASED)
# the debiased metrics' class set: the classes whose share of the train split's labels (``split_count``, counted from
# the token ids at extraction) is at least this, and that have 2 or
# more train tokens in the sample (a class of the set with fewer is left out, said in a warning). 2^-12: at the
# smallest budget worth measuring (32,768 tokens) such a class expects 8 tokens.
DEBIAS_SHARE = 2.0 ** -12
# the debiased estimate beside each plug-in metric it corrects: which column to compare across budgets or with the paper
PLUGIN_OF = {r.name: r.plugin_of for r in RECORDS if r.plugin_of}
COMPANION = {r.name: r.companion for r in RECORDS if r.companion}  # the budget-stable number shown beside a metric
# every scalar metric: the columns of metrics.csv and `tree.nc.table()`, and the metrics the report tests
# (stats.METRICS is SCALARS). NC_METRICS (less SCALE_DEPENDENT, each a family of its own) and GEOMETRY_METRICS are
# two Holm families (per scale and tag, stats.family): the geometry does not make the NC metrics' adjusted p-values
# more conservative.
SCALARS = NC_METRICS + GEOMETRY_METRICS + DEBIASED_METRICS
# the columns held fixed by the report's partial correlations by default (``--controls``): scale and training time.
# ``design`` stands for the architecture factors that vary among the selected runs (DESIGN_FACTORS, read from the
# stored config), so the scale control matches the design rather than one fixed expression (stats.expand_design)
DESIGN = "design"
CONTROLS = (DESIGN, "log1p(global_step)")
# the design factors ``design`` may stand for, each with what it is (said where printed)
COMPARISONS = (("unc3_cos_cv", "nc3_cos_mean"),  # the paper's "A relates to loss more than B" (its Figures 3 and 2),
               ("gnc2_log_std", "nc2_cos_std"))  # each tested by a paired bootstrap of R²(A) - R²(B) (stats.csv d_r2*)
DESIGN_FACTORS = {"log(n_layers)": "depth", "log(hidden_size)": "width", "log(n_params)": "parameters"}
# how many classes the metrics rest on, beside them in measure's results and metrics.csv (not metrics: no tests):
# the kept classes K, and those of them with a variance (n_c >= 2), which the CDNV family reads; the fixed class set of
# the debiased metrics (those of it measured) and its pairs whose corrected distance is not clearly positive
CLASS_COUNTS = ("n_classes", "n_classes_var", "n_classes_debiased", "n_pairs_unresolved")
# each scalar metric's delete-one-fold jackknife error (analyzer/jackknife.py; SPEC section 5), after the metrics
ERRORS = tuple(f"{m}_se" for m in SCALARS)
# the per-class views (vocab), written back into each group by `ncanalyze measure`
PER_CLASS = ("class_norm", "class_cdnv", "class_interference", "class_duality", "class_nc4", "class_freq_weight")
# the attributes that describe a checkpoint in a metrics table, before the metrics
INFO = ("run", "tag", "checkpoint", "global_step", "epoch", "n_params", "n_layers", "hidden_size", "eval_loss",
        "val_loss", "val_accuracy")
# NC4's counts per true class, from the validation pass
VAL_COUNTS = ("val_count", "val_correct", "val_ncc_agree")
# and the decision counts over the kept set of each min_count the report compares (count >= m), counted in the same
# validation pass (nc4_min_count x vocab; val_count is the same for every kept set), so NC4 is measurable at each of
# them; the fold counts (fold_val_*) are at the extraction's --min-count only
NC4_MIN_COUNTS = (1, 2, 5, 20)
NC4_MIN_COUNT = "nc4_min_count"
VAL_AT = ("val_correct_at", "val_ncc_agree_at")
# NC4's agreements under the train means without each fold (fold x vocab, stored as fold_<name>): [f, c] counts the
# validation tokens of class c outside fold f whose linear decision equals the nearest of the means without train
# fold f, both over the classes of --min-count train tokens outside fold f (the jackknife's replicate without f)
NC4_WITHOUT = "val_ncc_agree_without"
# the output layer (vocab x hidden, and its bias when the model has one): in a store, once per checkpoint, as
# coordinates of the checkpoint group that its layer groups inherit (store/classifier.py); a data variable elsewhere
HEAD = ("classifier", "classifier_bias")
# the variables the metrics read (the rest of a group, such as the samples, they never need)
MEASURED = ("count", "split_count", "mean", "variance", "within_covariance", "unit_sum", *HEAD, *VAL_COUNTS, *VAL_AT)
# the metrics table's depth column (after INFO): transformers' hidden_states index; a checkpoint group is its last layer;
# a sublayer site of block B (attn:B, mlp:B) is at B + 0.5, between the block's input and output
LAYER = "layer"
# then the site as written (--sites): resid:<layer> for the checkpoint and layer groups, attn:B, mlp:B (attribute site)
SITE = "site"
# the metrics table's label column (after SITE): what a position's class is, the group's ``labels`` attribute as the
# extraction's --labels wrote it (``current``, ``file:PATH``), ``next`` (the paper's) where none is recorded
LABELS, NEXT_TOKEN = "labels", "next"
# then what the class axis holds (its dimension keeps the fixed name ``vocab``): ``tokens`` (token ids: the next or the
# current token), or a label file's classes, as the group's attribute ``class_axis`` names them ("file classes 0..4 of
# tags.npy"); a group of token classes records none (the default's bytes stay as they were)
CLASS_AXIS, TOKENS, FILE_CLASSES = "class_axis", "tokens", "file classes"
# why NC3, UNC3, NC4 and the head metrics are nan for classes that are not the vocabulary (a label file)
NO_CLASSIFIER = "no classifier for these classes"


def vocabulary_classes(attrs: dict) -> bool:
    """Whether a group's classes are the vocabulary (the next or the current token), so that it holds the model's head
    as their classifier and NC4's counts; a label file's classes (``labels`` ``file:PATH``) have neither."""
    return not str(attrs.get(LABELS, NEXT_TOKEN)).startswith("file:")


def class_axis(attrs: dict) -> str:
    """What a group's class axis holds: its ``class_axis`` attribute, else ``tokens`` (or ``file classes`` for a label
    file's group written before the attribute was)."""
    return str(attrs.get(CLASS_AXIS) or (TOKENS if vocabulary_classes(attrs) else FILE_CLASSES))


def _np(x: Any) -> np.ndarray:
    """A torch tensor (any device) or array-like as a numpy array."""
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    return np.asarray(x)


def stats_dataset(count: Any, mean: Any, variance: Any, within_covariance: Any, *, classifier: Any = None,
                  classifier_bias: Any = None, val: dict[str, Any] | None = None, samples: Any = None,
                  n_samples: Any = None, sample_position: Any = None, tokens: list[str] | None = None,
                  attrs: dict | None = None, embeddings: Any = None, embedding_label: Any = None,
                  embedding_position: Any = None, unit_sum: Any = None, split_count: Any = None) -> xr.Dataset:
    """One checkpoint's dataset with the store's variables and dimensions (vocab, hidden, hidden2, slot).

    Arrays keep their dtype (extraction passes the classifier as float32, as the model holds it); ``val`` maps the names in
    ``VAL_COUNTS`` to per-class counts (and ``VAL_AT`` to nc4_min_count x vocab); ``samples`` (vocab x slot x hidden, float32) with ``n_samples`` and
    ``sample_position`` is the reservoir; ``tokens`` adds the decoded ``token`` coordinate. ``embeddings`` (position x
    hidden; numpy or dask, kept lazy) with ``embedding_label`` (the next token) and ``embedding_position`` (the index
    coordinate ``position``: the stream position) are raw features of the first train positions. ``unit_sum``
    (hidden, float64) is the sum of the unit-normalised train features (anisotropy); ``split_count`` (vocab, int64)
    the labels' counts over the whole train split (the debiased metrics' class set, DEBIAS_SHARE)."""
    import xarray as xr

    mean = _np(mean)
    data: dict[str, tuple] = {
        "count": ("vocab", _np(count)),
        "mean": (("vocab", "hidden"), mean),
        "variance": ("vocab", _np(variance)),
        "within_covariance": (("hidden", "hidden2"), _np(within_covariance)),
    }
    if split_count is not None:
        data["split_count"] = ("vocab", _np(split_count).astype(np.int64))
    if unit_sum is not None:
        data["unit_sum"] = ("hidden", _np(unit_sum))
    if classifier is not None:
        data["classifier"] = (("vocab", "hidden"), _np(classifier))
    if classifier_bias is not None:
        data["classifier_bias"] = ("vocab", _np(classifier_bias))
    for name, v in (val or {}).items():  # VAL_AT: one row per NC4_MIN_COUNTS
        data[name] = ((NC4_MIN_COUNT, "vocab") if name in VAL_AT else "vocab", _np(v))
    if samples is not None:
        data |= {"samples": (("vocab", "slot", "hidden"), _np(samples)), "n_samples": ("vocab", _np(n_samples)),
                 "sample_position": (("vocab", "slot"), _np(sample_position))}
    coords: dict[str, Any] = {"vocab": np.arange(mean.shape[0])}
    if any(name in VAL_AT for name in val or {}):
        coords[NC4_MIN_COUNT] = np.asarray(NC4_MIN_COUNTS, dtype=np.int64)
    if embeddings is not None:
        lazy = hasattr(embeddings, "chunks")  # a dask array stays lazy: it is written chunk by chunk
        data |= {"embeddings": (("position", "hidden"), embeddings if lazy else _np(embeddings)),
                 "label": ("position", _np(embedding_label))}
        coords["position"] = _np(embedding_position)
    if tokens is not None:
        coords["token"] = ("vocab", np.array(tokens, dtype=object))
    return xr.Dataset(data, coords=coords, attrs=attrs or {})
