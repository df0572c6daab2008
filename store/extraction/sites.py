"""Sites: where in the model a feature is read (``--sites``, SPEC section 2), the one parser of them.

``resid:L`` is transformers' ``hidden_states[L]`` (``--layers`` is the residual sites' short form: ``--layers 0,2`` is
``--sites resid:0,resid:2``); ``attn:B`` and ``mlp:B`` are the output of block B's attention and MLP sublayer
(0-based), before its residual add, read by forward hooks on the modules that ``anatomy.SUBLAYERS`` names. Indices
count negative from the end, as ``--layers`` does. A site orders as the forward reaches it: ``resid:B`` (block B's
input), ``attn:B``, ``mlp:B``, ``resid:B+1``.

In the store, ``resid:L`` keeps the layer groups' path ``<run>/<checkpoint>/layers/<L>`` (the checkpoint group itself
is the last layer), and a sublayer site is the group ``<run>/<checkpoint>/sites/<kind>_<B>`` (``sites/attn_1``: no
``:`` in a path, which some file systems refuse) with the attribute ``site`` (``attn:1``).
"""
from __future__ import annotations

from dataclasses import dataclass

from ncanalyze.core.errors import UserError
from ncanalyze.store.sources.anatomy import SUBLAYERS

RESID = "resid"


def site_kinds() -> tuple[str, ...]:
    """The site kinds in the order the forward reaches them within one index: ``resid``, then anatomy's
    ``SUBLAYERS`` as it lists them (read when asked: a new hook point is an entry there alone)."""
    return RESID, *SUBLAYERS


SITES_GROUP = "sites"  # a sublayer site's group is <run>/<checkpoint>/sites/<kind>_<B>
EXAMPLE = "resid:2,attn:1,mlp:-1"


@dataclass(frozen=True)
class Site:
    """A point of the forward: ``kind`` (one of :func:`site_kinds`) and its ``index`` (the hidden_states index for
    ``resid``, the block for the sublayers), resolved (never negative once :func:`parse_sites` has read it)."""
    kind: str
    index: int

    def __str__(self) -> str:
        return f"{self.kind}:{self.index}"

    def __lt__(self, other: Site) -> bool:
        return self.order < other.order

    @property
    def order(self) -> tuple[int, int]:
        """Where the forward reaches it: (index, rank of the kind)."""
        return self.index, site_kinds().index(self.kind)

    @property
    def residual(self) -> bool:
        return self.kind == RESID

    @property
    def key(self) -> str:
        """Its name in file names and the resume state: the layer index for ``resid`` (as before sites), else
        ``<kind>_<B>``."""
        return str(self.index) if self.residual else f"{self.kind}_{self.index}"

    @property
    def group(self) -> str:
        """Its group below the checkpoint's: ``layers/<L>``, or ``sites/<kind>_<B>``."""
        return f"layers/{self.index}" if self.residual else f"{SITES_GROUP}/{self.key}"

    @property
    def recorded(self) -> int | str:
        """As the configuration record lists it: the index for ``resid`` (so records without sublayer sites are
        those of ``--layers``), the name for the others."""
        return self.index if self.residual else str(self)

    @property
    def blocks(self) -> int:
        """The blocks the forward runs (some of) to reach it: L for ``resid:L``, B + 1 for a sublayer of block B."""
        return self.index if self.residual else self.index + 1

    @classmethod
    def of(cls, value: Site | int | str) -> Site:
        """A site from itself, a residual index (``3``), or its record or name (``attn:1``), already resolved."""
        if isinstance(value, Site):
            return value
        if isinstance(value, int) or str(value).lstrip("-").isdigit():
            return cls(RESID, int(value))
        kind, _, index = str(value).partition(":")
        return cls(kind, int(index))


def parse_sites(spec: str | None, n: int | None) -> list[Site]:
    """``--sites``: comma-separated ``kind:index`` (:func:`site_kinds`), each index checked against the model's depth
    and made non-negative: ``resid`` 0..n, the sublayers 0..n-1.

    Parameters
    ----------
    spec : the ``--sites`` value (None or empty: no site).
    n : the model's number of blocks (None: not known; then no site can be named).

    Returns
    -------
    list of Site : sorted in forward order, distinct.
    """
    items = [x.strip().lower() for x in str(spec or "").split(",") if x.strip()]
    if items and n is None:
        raise UserError(f"--sites {spec} needs the model's number of layers, which its config does not name; drop "
                        "--sites")
    out = set()
    for item in items:
        kind, sep, index = item.partition(":")
        if kind not in site_kinds() or not sep or not index.strip().lstrip("+-").isdigit():
            raise UserError(f"--sites: {item!r} is not a site; write kind:index with kind one of "
                            f"{', '.join(site_kinds())}, e.g. {EXAMPLE}")
        size = n + 1 if kind == RESID else n
        i = int(index)
        if not -size <= i < size:
            what = f"hidden_states 0..{n}" if kind == RESID else f"blocks 0..{n - 1}"
            raise UserError(f"--sites: {item} is out of range: this model has {n} blocks ({kind} takes {what}, "
                            "negative counting from the end); pass an index in that range")
        out.add(Site(kind, i % size))
    return sorted(out)
