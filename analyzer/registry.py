"""The settings of measuring and reporting: :class:`MeasureSettings` (``ncanalyze measure``, and report's measuring)
and :class:`ReportSettings` (``ncanalyze report``; :class:`ncanalyze.analyzer.report.report_options.ReportOptions` is
made of them), with the defaults the statistics share (:data:`N_PERM`, :data:`N_BOOT`). Each setting is a dataclass
field that says, once, its default, its validation, its flag, its help and its ``--help`` section (the mechanism,
and the settings several commands share: ncanalyze.core.setting); the commands generate their click options from the
fields (ncanalyze.cli.options.setting_option). Extraction's settings: ncanalyze.store.extraction.settings. Light on
purpose (the schema's names, no pandas): ``--help`` imports it.
"""
from __future__ import annotations

from dataclasses import dataclass

from ncanalyze.analyzer.schema import CONTROLS, SCALARS
from ncanalyze.core.errors import UserError
from ncanalyze.core.setting import THREADS_HELP, check_fields, setting, shared

N_PERM = 10_000  # permutations per p-value (report --permutations, the statistics' default)
N_BOOT = 10_000  # resamples of the paired bootstrap over whole runs behind the R² comparisons (report --bootstrap)
MIN_BOOT = 1000  # the fewest that a 95% percentile interval's 2.5% tails rest on (25 resamples beyond each end)


def enough_resamples(n: int) -> int:
    """0 (no bootstrap) or at least :data:`MIN_BOOT` resamples."""
    if 0 < n < MIN_BOOT:
        raise ValueError(f"must be 0 (none) or at least {MIN_BOOT}: the 2.5% tails of a 95% interval need 25 "
                         "resamples beyond each end")
    return n
MAX_PERM = 10_000_000  # at most (1000 x the default): drawn in chunks, so a bound on time, not memory
MEASURE_SECTIONS = ("Measuring", "Run control")  # ``measure --help``, in order
REPORT_SECTIONS = ("Selection", "Statistics", "Per-token table", "Output", "Measuring")  # ``report --help``
PER_RUN = ("all", "last")
MAX_TILE = 2**16  # classes per tile at most: a tile's pairwise sums are tile x tile float64 (32 GiB here)
ESTIMATES = ("debiased", "plugin")  # report --estimates: which number of a metric with a debiased form is drawn


@dataclass(frozen=True)
class MeasureSettings:
    """How ``ncanalyze measure`` (and ``report``, measuring what is new) measures: every value checked when made."""

    min_count: int = shared("min_count", section="Measuring", help=(
        "Keep only classes with at least this many train tokens."), helps={
        "report": "Keep only classes with at least this many train tokens (when measuring what is new)."})
    tile: int | None = setting(section="Measuring", kind=int, minimum=1, maximum=MAX_TILE, help=(
        "Classes per tile of the pairwise sums [default: from the available memory, at most 2048]."))
    device: str = shared("device", section="Measuring", help=(
        "Where the pairwise sums and the d x d work run: auto (torch float64 on CUDA when present, else the numba "
        "pass on the CPU), cpu, cuda, cuda:N."))
    se: bool = setting(True, section="Measuring", help=(
        "Each metric's delete-one-fold jackknife error <metric>_se (F + 1 measurements per group with F folds; "
        "above 4,096 kept classes the pair metrics' leave-one-out sums come from sampled pairs, each error's own "
        "sampling error recorded beside it); "
        "--no-se leaves them nan (measure --force adds them later)."))
    threads: int | str = shared("threads", section="Measuring", help=THREADS_HELP)

    def __post_init__(self) -> None:
        check_fields(self)


MEASURE = MeasureSettings()  # measuring's defaults, which the library's signatures read (se=MEASURE.se): written once


FIGURE_FORMATS = ("png", "pdf", "svg")  # every format a report's figures can be saved in


def _formats(value: tuple[str, ...]) -> tuple[str, ...]:
    """Figure formats among :data:`FIGURE_FORMATS` (white space around each ignored: ``"png, pdf"``), PNG always
    (report.md shows it), each once, in their order."""
    value = tuple(v.strip().lower() for v in value)
    wrong = [v for v in value if v not in FIGURE_FORMATS]
    if wrong or "png" not in value:
        raise ValueError("must be png and any of pdf, svg, comma-separated")
    return tuple(f for f in FIGURE_FORMATS if f in value)


def _per_run(value: str | None) -> str:
    """``all`` (None too, as the library once said it) or ``last``."""
    if value is None or value == "all":
        return "all"
    if value == "last":
        return value
    raise ValueError(f"must be one of {', '.join(PER_RUN)}")


_WHERE = ("Condition over the table's columns selecting the checkpoints the report covers, in pandas query syntax, "
          "e.g. \"n_layers == 4 and hidden_size == 256\" (the seed replicas of one architecture); columns, literals, "
          "comparisons, and/or/not, in [...], log/log10/log1p/exp/sqrt/abs, .str.contains/startswith/endswith and "
          ".isna()/.notna() only: never run as code. One tag: \"tag == 'NAME'\"; the untagged checkpoints: "
          "\"tag.isna()\" or \"tag == ''\".")


@dataclass(frozen=True)
class ReportSettings:
    """What ``ncanalyze report`` is asked for, each flag once (its fields are
    :class:`~ncanalyze.analyzer.report.report_options.ReportOptions`'s, which documents them): every value checked when
    made."""

    metrics: tuple[str, ...] = setting(SCALARS, kind=tuple, section="Selection", shown="all the table has",
                                           help="Comma-separated metric columns.")
    target: str | None = setting(section="Selection", help=(
        "Column to correlate the metrics with [default: val_loss where every selected checkpoint has it, else "
        "eval_loss]."))
    controls: tuple[str, ...] = setting(CONTROLS, kind=tuple, section="Statistics", help=(
        "Comma-separated expressions over the columns held fixed by the partial correlation (the same allowed syntax "
        "as --where; \"\" for none)."))
    where: str | None = setting(section="Selection", help=_WHERE)
    n_perm: int = setting(N_PERM, section="Statistics", flag="--permutations", minimum=0,
                         maximum=MAX_PERM, help=(
        "Permutations per p-value (0: none). Runs with several checkpoints are permuted whole; all permutations, and "
        "an exact p, where there are no more than this."))
    n_boot: int = setting(N_BOOT, section="Statistics", flag="--bootstrap", minimum=0, maximum=10 ** 6,
                          check=enough_resamples, help=(
        "Resamples of the paired bootstrap over whole runs behind the comparisons \"A relates more than B\" (R²'s "
        f"difference; its interval's Monte-Carlo error is said); 0: none, else at least {MIN_BOOT}. The intervals of "
        "r, R², rho and the partial r need no resamples: Fisher's z, or the jackknife over runs."))
    seed: int = shared("seed", section="Statistics", help="Seed of the permutations and the bootstrap.")
    tokens: tuple[str, ...] = setting((), kind=tuple, section="Per-token table", help=(
        "Comma-separated tokens (strings as decoded, or ids) for the per-token table."))
    checkpoints: tuple[str, ...] = setting((), kind=tuple, multiple=True, flag="--checkpoint",
                                           section="Per-token table", metavar="RUN/CHECKPOINT", help=(
        "Checkpoint(s) of the per-token table (default: each selected run's latest). Repeatable."))
    per_run: str = setting("all", section="Selection", check=_per_run, metavar="[all|last]", help=(
        "'last': each run's latest checkpoint only (one row per run, per tag)."))
    html: bool = setting(True, section="Output", help=(
        "Also write report.html, one self-contained interactive page (see above); --no-html: not."))
    estimates: str = setting("debiased", section="Statistics", choices=ESTIMATES, metavar="[debiased|plugin]", help=(
        "Which number of a metric that has a budget-stable form (nc1_cdnv_debiased beside nc1_cdnv) the figures and "
        "Figure 1's claims use: 'debiased' (the one to compare across token budgets or with the paper), or 'plugin' "
        "(the paper's own estimator at this sample). stats.csv and metrics.csv keep both."))
    formats: tuple[str, ...] = setting(FIGURE_FORMATS, kind=tuple, section="Output", check=_formats, help=(
        "Comma-separated formats of the figures: png (always: report.md shows it), pdf (fonts embedded), svg. "
        "Leaving pdf and svg out halves the figures' time; a figure's files of a format left out, from an earlier "
        "report in --out, are removed, never left stale beside the new PNG."))

    def __post_init__(self) -> None:
        check_fields(self)
        if self.checkpoints and not self.tokens:
            raise UserError("--checkpoint (ReportOptions.checkpoints) picks the checkpoints of the per-token table, "
                            "and without --tokens there is none: pass --tokens too, or leave --checkpoint out")


REPORT = ReportSettings()  # the report's defaults, which the library's signatures read: written once
