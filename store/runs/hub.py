"""Public checkpoint suites on the Hugging Face Hub, by revision (SPEC section 2): ``ORG/NAME --revision step1000``.

Each revision is fetched (store/sources/hub_fetch.py) and extracted as a local model folder: one checkpoint at
``<NAME>/<revision>``, ``global_step`` from the number in the revision's name, the tokenizer from the same repository
and revision. Revisions are done one at a time; with ``delete_downloads`` a snapshot this run downloaded is removed
after its extraction. A revision that cannot be had (or whose cached snapshot lacks a blob) is named in one line and
the others go on; revisions that would share a group are refused before any is fetched; a revision the store holds is
skipped from its record when the Hub cannot be reached (its job resolved from the store, as a fetched one's is from
its files).
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

from ncanalyze.core.errors import UserError
from ncanalyze.store.extraction.checkpoint import Outcome, extract_checkpoint
from ncanalyze.store.extraction.job import Jobs, make_job
from ncanalyze.store.extraction.resume import DeferredInterrupt
from ncanalyze.store.extraction.settings import ExtractConfig
from ncanalyze.store.runs.local import ExtractResult, announcer, check_settings, each_checkpoint, todo
from ncanalyze.store.sources.discover import Checkpoint, tagged
from ncanalyze.store.sources.hub_fetch import Snapshot, explain, fetch, hub_errors, is_hub_id, resolved_commit
from ncanalyze.store.sources.revisions import check_revision
from ncanalyze.store.store import Status, Store

log = logging.getLogger(__name__)

__all__ = ["extract_hub", "is_hub_id", "check_groups", "done_before"]


def check_groups(repo: str, revisions: list[str], groups: dict[str, str], store: Store) -> None:
    """Refuse revisions that would share one group (``feature/x`` and ``feature-x``), among themselves or with a
    group in the store holding another revision or repository; never by replacing the other.

    Parameters
    ----------
    repo, revisions
        The Hub model id and the revisions asked for.
    groups
        Each revision's group.
    store
        The store.
    """
    seen: dict[str, str] = {}
    for rev in revisions:
        other = seen.setdefault(groups[rev], rev)
        if other != rev:
            raise UserError(f"revisions {other!r} and {rev!r} would both be stored as {groups[rev]} ('/' becomes "
                            "'-'): extract one of them in another run with --tag NAME")
        attrs = store.attrs(groups[rev], corrupt_ok=True) or {}
        had = (attrs.get("hub_repo"), attrs.get("hub_revision"))
        if had[1] is not None and had != (repo, rev):
            raise UserError(f"{repo}@{rev} would be stored as {groups[rev]}, which holds {had[0]}@{had[1]} in "
                            f"{store}: extract it with --tag NAME to keep both (or remove the other with "
                            "ncanalyze rm)")


def done_before(store: Store, ckpt: Checkpoint, repo: str, revision: str, jobs: Jobs) -> bool:
    """Whether a revision can be skipped without fetching its snapshot.

    Parameters
    ----------
    store, ckpt
        The store and the revision's checkpoint.
    repo, revision
        The Hub repository and revision.
    jobs
        The run's jobs.

    Returns
    -------
    bool
        Its group is complete, from this repository and revision (and its commit, where that can be known without
        downloading), under the same settings: its job, resolved from the store's record (the commit fixes the
        weights and the model's depth and context), says skip.
    """
    attrs = store.attrs(ckpt.group) or {}
    if jobs.overwrite or not (attrs.get("complete") and attrs.get("hub_repo") == repo
                              and attrs.get("hub_revision") == revision):
        return False
    commit = resolved_commit(repo, revision)
    if commit is not None and commit != attrs.get("hub_commit"):
        return False
    old = json.loads(attrs.get("config", "{}"))
    try:
        job = make_job(None, jobs.cfg, jobs.overwrite, jobs.restart, weights=old.get("weights"),
                       known=(attrs.get("n_layers"), old.get("block_size")))
    except UserError:  # the settings do not apply to it: the fetched revision's own job says why
        return False
    return job.status(store, ckpt.group) is Status.SKIP


def extract_hub(repo: str, revisions: list[str], store: str | Path | Store, settings: ExtractConfig | Jobs,
                delete_downloads: bool = False) -> ExtractResult:
    """Extract ``repo`` at each of ``revisions``, one at a time, into ``store``.

    Parameters
    ----------
    repo
        The Hub model id.
    revisions
        The revisions (:func:`parse_revisions`).
    store
        The store.
    settings
        The configuration (its tag applies), or the run's :class:`~ncanalyze.store.extraction.job.Jobs` (with
        ``overwrite`` and ``restart``).
    delete_downloads
        Remove each snapshot this run downloaded once its extraction is over.

    Returns
    -------
    ExtractResult
        Labelled with ``repo``; a revision that could not be had or extracted is one of its errors.
    """
    store, jobs = Store.at(store), Jobs.of(settings)
    result = ExtractResult(repo, str(store))
    check_settings(jobs.cfg, store)
    name = repo.split("/")[-1]
    ckpts = {r: tagged([Snapshot(repo, check_revision(r), Path("."), False).checkpoint(name)], jobs.cfg.tag,
                       jobs.cfg.base)[0] for r in revisions}
    check_groups(repo, revisions, {r: c.group for r, c in ckpts.items()}, store)
    announce = announcer(todo(store, list(ckpts.values()), jobs), jobs, store)

    def one(rev: str, interrupt: DeferredInterrupt) -> Outcome | None:
        if done_before(store, ckpts[rev], repo, rev, jobs):
            return Outcome.SKIPPED  # already in the store: nothing fetched
        return _revision(repo, rev, name, store, jobs, delete_downloads, announce, interrupt, result.errors)

    return each_checkpoint(store, result, [(ckpts[r].group, r) for r in revisions], one, desc="revisions", unit="rev")


def _revision(repo: str, rev: str, name: str, store: Store, jobs: Jobs, delete_downloads: bool, announce,
              interrupt: DeferredInterrupt, errors: list[str]) -> Outcome | None:
    """One revision fetched, resolved into its job and extracted: its outcome, or None with a line added to
    ``errors``."""
    try:
        snap = fetch(repo, rev, jobs.cfg.allow_pickle)
    except hub_errors() as e:
        errors.append(explain(repo, rev, e))
        log.error("%s", errors[-1])
        return None
    except UserError as e:
        errors.append(f"{repo}@{rev}: {e}")
        log.error("%s", errors[-1])
        return None
    try:
        job = jobs(tagged([snap.checkpoint(name)], jobs.cfg.tag, jobs.cfg.base)[0])
        return extract_checkpoint(job, store, announce, interrupt, extra_attrs=snap.attrs())
    except UserError as e:
        errors.append(f"{repo}@{rev}: {e}")
        log.error("%s", errors[-1])
        return None
    finally:
        if delete_downloads and snap.downloaded:
            if snap.delete():
                log.info("%s@%s: deleted its downloaded snapshot %s", repo, rev, snap.path)
            else:
                log.warning("%s@%s: its downloaded snapshot %s was gone already; nothing deleted", repo, rev,
                            snap.path)
