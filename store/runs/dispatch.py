"""The extraction of a command's PATHS, whatever they are: :func:`extract_paths` sends Hub model ids to hub.py, local
folders to a Dask cluster (cluster.py) when a scheduler is given, else to this process (local.py), the run's settings
and run control travelling as its :class:`~ncanalyze.store.extraction.job.Jobs`."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from ncanalyze.core.errors import UserError
from ncanalyze.store.extraction import progress as time_left
from ncanalyze.store.extraction.job import Jobs
from ncanalyze.store.extraction.settings import ExtractConfig
from ncanalyze.store.runs.hub import extract_hub
from ncanalyze.store.runs.local import ExtractResult, announcer_over, extract
from ncanalyze.store.sources.hub_fetch import is_hub_id
from ncanalyze.store.sources.revisions import parse_revisions
from ncanalyze.store.store import Store


def extract_paths(paths: Sequence[str | Path], store: str | Path | Store, cfg: ExtractConfig, *,
                  overwrite: bool = False, restart: bool = False, revisions: Sequence[str] = (),
                  revision_ranges: Sequence[str] = (), delete_downloads: bool = False, scheduler: str | None = None,
                  shards: int = 1, done: Callable[[ExtractResult], None] | None = None) -> list[ExtractResult]:
    """Extract every checkpoint under ``paths`` into ``store``: Hub model ids revision by revision, then the local
    folders, on a cluster with ``scheduler``, else here with one estimate over all of them.

    Parameters
    ----------
    paths
        Trainer output folders, model folders, folders of runs, or Hub model ids (a PATH that is not a local folder).
    store
        The store.
    cfg
        The configuration.
    overwrite, restart
        Replace groups extracted under another configuration; discard saved resume states.
    revisions, revision_ranges
        The Hub revisions (``--revision``, ``--revisions``; :func:`parse_revisions`) [default: main].
    delete_downloads
        Remove each Hub snapshot this run downloaded after its extraction.
    scheduler
        A Dask scheduler's address for the local folders (None: this process).
    shards
        Parts of each local checkpoint's train pass, merged exactly.
    done
        Called with each result as it comes (a later one may raise).

    Returns
    -------
    list of ExtractResult
        One per Hub model id, then one per local PATH (one for all of them on a cluster).
    """
    store, jobs = Store.at(store), Jobs(cfg, overwrite, restart)
    hub = [str(p) for p in paths if is_hub_id(str(p))]
    local = [p for p in paths if str(p) not in hub]
    if (revisions or revision_ranges) and not hub:
        raise UserError("--revision/--revisions apply to Hub model ids; none of PATHS is one (local folders are "
                        "extracted with their checkpoints)")
    if hub and (scheduler or shards > 1):
        raise UserError("Hub revisions are extracted in this process: pass --scheduler/--shards only with local "
                        "checkpoint folders (or fetch the revisions first)")
    revs = parse_revisions(revisions, revision_ranges) if hub else []
    results: list[ExtractResult] = []

    def add(result: ExtractResult) -> None:
        results.append(result)
        if done is not None:
            done(result)

    for path in hub:
        add(extract_hub(path, revs, store, jobs, delete_downloads=delete_downloads))
    if scheduler and local:
        from ncanalyze.store.runs.cluster import extract_on_cluster

        add(extract_on_cluster(local, store, jobs, scheduler, shards))
    elif local:
        announce = announcer_over(local, store, jobs)  # one estimate over every PATH, its time left followed to the end
        try:
            for path in local:
                add(extract(path, store, jobs, shards=shards, announce=announce))
        finally:
            time_left.track(None)
    return results
