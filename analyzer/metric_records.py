"""One record per metric: every fact about a scalar metric other than its arithmetic, written once.

A record names the metric, the function that computes it (``ncanalyze.analyzer.<module>.<name>``: metrics.py or
spectral.py; its docstring is the formula), its Holm family, which way is more collapse, its figure label, the store
variables it reads, and what is said about its scale, its token budget and the published code it equals. The schema's
families (``schema.NC_METRICS``, ``GEOMETRY_METRICS``, ``SCALE_DEPENDENT``), the report's directions
(``report/support.py``) and panel titles (``report/figures.py``, ``report/depth.py``), the columns ``ncanalyze
measure`` prints and the documentation's metric cards all read :data:`RECORDS`. Adding a metric is one record here:
with its function beside it (``compute``, a function of the metrics' ``Geometry``; numpy imported inside it, so that
this module stays light), or with a function of the same name in metrics.py or spectral.py.

Light on purpose (no imports beyond the standard library): the CLI's ``--help`` reads it.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

NC, GEOMETRY = "nc", "geometry"  # the two Holm families (a scale-dependent metric is a family of its own)
DEBIASED = "debiased"  # a budget-stable estimate beside a plug-in metric (each a Holm family of its own)
LOWER, HIGHER = "lower", "higher"
STATS = ("count", "mean", "variance")  # what every metric reads
HEAD = ("classifier",)
NC4_COUNTS = ("val_count", "val_ncc_agree")
TOKEN_MEAN = ("Zhu et al. and nc-toolbox centre on the token mean, not the unweighted mean of the class means: on "
              "Zipfian counts (40 classes of 2 to 1,200 tokens, `python benchmarks/fidelity.py`) theirs gives ")
ERANK = ("Roy & Vetterli 2007's effective rank, weighing sqrt(lambda) (singular values, as RankMe), where LiDAR's "
         "entropy weighs lambda and counts fewer directions (spectra i^-1 at d = 256: 209.0 against 74.6, "
         "`benchmarks/fidelity.py`); eigenvalues below d eps lambda_max count as 0")


@dataclass(frozen=True)
class MetricRecord:
    """One scalar metric, as every surface shows it (a field left empty is said as 'not measured' or omitted)."""

    name: str
    module: str  # the module of ncanalyze.analyzer holding the function of the same name
    family: str  # NC, GEOMETRY or DEBIASED
    direction: str | None  # which way is more collapse; None: it has none (not an NC property, or not scale-free)
    label: str | None = None  # figure panel title; None: the name itself
    needs: tuple[str, ...] = STATS  # the store variables it reads
    scale: str | None = None  # set where the value is not scale-free: said wherever it is printed (own Holm family)
    budget: str | None = None  # how it moves with the train-token budget, where measured
    published: str = ""  # the published definition or code it equals, and where and by how much it departs
    reading: str = ""  # how to read it, beyond the direction
    shown: bool = False  # among the columns `ncanalyze measure` prints
    plugin_of: str | None = None  # a debiased estimate: the paper's plug-in metric it corrects
    companion: str | None = None  # a budget-stable number the token-budget section shows beside it (and its debiased)
    compute: Callable | None = None  # its function, written in this module; None: ``module``'s function ``name``

    @property
    def function(self) -> str:
        """The dotted path of the function that computes it."""
        if self.compute is not None:
            return f"{self.compute.__module__}.{self.compute.__qualname__}"
        return f"ncanalyze.analyzer.{self.module}.{self.name}"

    @property
    def title(self) -> str:
        """The figure panel title (the name where it has no label)."""
        return self.label or self.name

    @property
    def direction_text(self) -> str:
        """The one line saying which way is more collapse (report.md's list, the docs' cards)."""
        if self.scale:
            return self.scale
        return f"{self.direction} is more collapse" if self.direction else "not an NC property (no collapse direction)"


def _nc(name: str, direction: str | None, label: str, **kw) -> MetricRecord:
    """A neural-collapse metric of metrics.py."""
    return MetricRecord(name, "metrics", NC, direction, label, **kw)


def _geo(name: str, **kw) -> MetricRecord:
    """A representation-geometry metric of spectral.py (no collapse direction unless given)."""
    return MetricRecord(name, "spectral", GEOMETRY, kw.pop("direction", None), **kw)


_CDNV_BUDGET = ("the plug-in grows with the train-token budget (bias, not only noise): on a real checkpoint ~95% "
                "between 32k and 524k train tokens (SPEC section 4); compare checkpoints at one `--max-train-tokens`")

RECORDS: tuple[MetricRecord, ...] = (  # SPEC section 4's order: the NC table, the geometry table, the debiased
    _nc("nc1_cdnv", LOWER, "NC1: within-class variability (CDNV)", budget=_CDNV_BUDGET, shown=True,
        companion="nc1_cdnv_pooled_debiased",
        published="Galanti et al. 2022's class-distance normalised variance with population variances, as their "
                  "code; with n_c - 1 variances the same classes give +1.8% (`benchmarks/fidelity.py`)",
        reading="over the kept classes with at least 2 train tokens (a class seen once has no variance)"),
    _nc("nc1_cdnv_p2", None, "NC1: CDNV over distance⁴ (scales as 1/length²)", budget=_CDNV_BUDGET,
        scale="scales as 1/length² (||mu_c - mu_c'||^4 in the denominator, the paper's code's form: doubling the "
              "features divides it by 4), so across widths it mostly follows the feature norm: not read as more or "
              "less collapse, and outside the NC Holm family",
        published="the form in Wu & Papyan's code (2024)"),
    _nc("nc1_trace", LOWER, "NC1: Tr(Σ_W Σ_B⁺)/K", needs=(*STATS, "within_covariance"), shown=True,
        published="Papyan, Han & Donoho 2020; " + TOKEN_MEAN + "-2.6%",
        reading="sums over the model's dimensions and grows with width: compare it within one width (or read its "
                "partial r)"),
    _nc("nc2_norm_cv", LOWER, "NC2: equinorm (CV of norms)",
        published="Papyan, Han & Donoho 2020's equinorm; " + TOKEN_MEAN + "+6.9%",
        reading="NaN, with a warning, where the mean norm is not 3 standard errors above 0"),
    _nc("nc2_lognorm_std", LOWER, "NC2: std of log norms", published="Wu & Papyan 2024"),
    _nc("nc2_cos_mean", "closer to -1/(K-1), i.e. to 0 for many classes", "NC2: mean cosine",
        published="Papyan, Han & Donoho 2020; " + TOKEN_MEAN + "+0.0202 where ours is -0.0252"),
    _nc("nc2_cos_std", LOWER, "NC2: equiangularity (std of cosines)",
        published="Papyan, Han & Donoho 2020's equiangularity; " + TOKEN_MEAN + "+4.0%"),
    _nc("nc2_etf_error", LOWER, "NC2: distance to simplex ETF", shown=True,
        published="Papyan, Han & Donoho 2020; " + TOKEN_MEAN + "+6.6%"),
    _nc("gnc2_log_mean", LOWER, "GNC2: mean log inverse distance", shown=True,
        published="the logarithmic energy of hyperspherical uniformity (Liu et al. 2023; Wu & Papyan 2024)",
        reading="+inf when two class-mean directions coincide"),
    _nc("gnc2_log_std", LOWER, "GNC2: hyperspherical uniformity",
        published="GNC2 as Wu & Papyan 2024 define it", reading="NaN when two class-mean directions coincide"),
    _nc("nc3_cos_mean", HIGHER, "NC3: self-duality (mean cosine)", needs=(*STATS, *HEAD),
        published="Papyan, Han & Donoho 2020's self-duality"),
    _nc("unc3_cos_cv", LOWER, "UNC3: uniform duality (CV of cosines)", needs=(*STATS, *HEAD),
        published="UNC3 as Wu & Papyan 2024 define it",
        reading="NaN, with a warning, where the mean duality cosine is not 3 standard errors above 0 (a random "
                "head's cosines average 0)"),
    _nc("nc3_dual_error", LOWER, "NC3: distance to self-dual ETF", needs=(*STATS, *HEAD), shown=True,
        published="Papyan, Han & Donoho 2020's duality, as nc2_etf_error with the Gram replaced by [m_c . w_c']"),
    _nc("nc4_agreement", HIGHER, "NC4: agreement with nearest class mean", needs=(*STATS, *NC4_COUNTS),
        shown=True, published="Papyan, Han & Donoho 2020's agreement with the nearest-class-mean classifier",
        reading="its decisions (the classifier's argmax against the nearest class mean) are counted in the "
                "extraction's validation pass over the kept set of the extraction's `--min-count` (and of "
                "min_count 1, 2, 5, 20); another min_count gives NaN with a warning rather than mixing sets"),
    _geo("within_erank", needs=(*STATS, "within_covariance"), published=ERANK,
         reading="how many directions the within-class noise spreads over; falls as the noise collapses onto a few"),
    _geo("between_erank", published=ERANK + "; " + TOKEN_MEAN + "-0.4%",
         reading="how many directions the class means use (at most |K| - 1; a simplex ETF uses them evenly); rises "
                 "as classes separate"),
    _geo("total_erank", needs=(*STATS, "within_covariance"), published=ERANK + "; RankMe's formula on centred "
                                                                              "features",
         reading="the effective dimension of the features; a drop is representation collapse"),
    _geo("rankme", needs=(*STATS, "within_covariance"),
         published="RankMe as published (Garrido et al. 2023), without their epsilon",
         reading="as total_erank, counting the mean direction too (LM features' common offset makes it lower)"),
    _geo("eigen_decay", needs=(*STATS, "within_covariance"),
         published="alpha-ReQ (Agrawal et al. 2022) fitted as its authors fit it (Stringer et al. 2019's weighted "
                   "least squares, ranks 4..100)",
         reading="the spectrum's power-law exponent: large is a few dominant directions, near 0 a flat spectrum"),
    _geo("lidar", needs=(*STATS, "within_covariance"),
         published="LiDAR (Thilak et al. 2023) with delta = 1e-4 tr(Sigma_W)/d, where their code adds a fixed "
                   "1e-4 or 1e-6: the same at feature scale 1 (0.02%), +36.7% for theirs at scale 1e-3 "
                   "(`benchmarks/fidelity.py`)",
         reading="the number of class-mean directions that stand out of the within-class noise"),
    _geo("anisotropy", needs=(*STATS, "unit_sum"), published="Ethayarajh 2019's mean cosine between features",
         reading="0 for isotropic features, 1 when all point one way; NaN, with a warning, without `unit_sum`"),
    _geo("head_erank", needs=HEAD, published=ERANK,
         reading="the effective rank of the output layer (every vocabulary row), the head's side of between_erank"),
    _geo("nc1_cdnv_freq", direction=LOWER, published="nc1_cdnv (Galanti et al. 2022) with each pair weighted by "
                                                     "n_c n_c'",
         reading="below nc1_cdnv where frequent tokens are more collapsed than rare ones"),
    MetricRecord("nc1_cdnv_pooled", "metrics", GEOMETRY, LOWER, "NC1: CDNV of the pooled pairs",
                 budget="the plug-in grows with the train-token budget, less than nc1_cdnv (its distances carry the "
                        "means' noise; `benchmarks/results/budget.md`)",
                 published="Galanti et al. 2022's CDNV as a ratio of sums over the pairs (their mean variance over "
                           "their mean squared distance) instead of a mean of ratios: no published counterpart",
                 reading="the typical pair's variability, not ruled by the few pairs of classes that share their "
                         "contexts (whose near-zero distances rule nc1_cdnv); over nc1_cdnv's pairs"),
    _geo("gnc2_log_mean_freq", direction=LOWER,
         published="gnc2_log_mean (Liu et al. 2023; Wu & Papyan 2024) with each pair weighted by n_c n_c'"),
    MetricRecord("nc1_cdnv_debiased", "metrics", DEBIASED, LOWER, "NC1: CDNV, debiased (budget-stable)",
                 needs=(*STATS, "split_count"), shown=True, plugin_of="nc1_cdnv",
                 budget="estimates the CDNV of the whole population of tokens: n_c/(n_c - 1) variances, each squared "
                        "distance less the two means' noise, over a class set fixed by the split's token frequencies "
                        "(share >= 2^-12); within 1% of the population value on planted Gaussian classes where the "
                        "plug-in is 30% low. Pairs of classes that share their contexts (true distance ~0) still "
                        "drift: counted in n_pairs_unresolved, and the report says whether it drifts",
                 published="no published counterpart: the paper's plug-in is nc1_cdnv",
                 reading="compare it with other studies' population CDNV; across token budgets only where "
                         "n_pairs_unresolved is small (else nc1_cdnv_pooled_debiased)"),
    MetricRecord("nc1_cdnv_pooled_debiased", "metrics", DEBIASED, LOWER, "NC1: CDNV of the pooled pairs, debiased",
                 shown=True, needs=(*STATS, "split_count"), plugin_of="nc1_cdnv_pooled",
                 budget="estimates nc1_cdnv_pooled of the whole population of tokens (n_c/(n_c - 1) variances, the "
                        "distances less the means' noise, the fixed class set): a ratio of two unbiased sums, so no "
                        "pair's noise rules it; its move with the budget on a real checkpoint, beside "
                        "nc1_cdnv_debiased's, is in `benchmarks/results/budget.md`",
                 published="no published counterpart",
                 reading="the number to compare across token budgets"),
)
BY_NAME = {r.name: r for r in RECORDS}
