"""Public checkpoint suites on the Hugging Face Hub, by revision (SPEC section 2): ``ORG/NAME --revision step1000``.

Each revision is resolved to a local snapshot folder with ``huggingface_hub.snapshot_download`` (so the cache,
``HF_HOME``/``HF_HUB_CACHE``, ``HF_HUB_OFFLINE`` and tokens work as usual) and then extracted as a local model
folder: one checkpoint at ``<NAME>/<revision>``, ``global_step`` from the number in the revision's name, the
tokenizer from the same repository and revision. Revisions are done one at a time; with ``delete_downloads`` a
snapshot this run downloaded is removed after its extraction (never one whose commit was cached before, under any
ref). A revision that cannot be had (or whose cached snapshot lacks a blob) is named in one line and the others go on;
revisions that would share a group are refused before any is fetched; a revision the store holds is skipped from its
record when the Hub cannot be reached. Revision names are parsed and checked in revisions.py.
"""
from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

from ncanalyze.analyzer.errors import UserError
from ncanalyze.store.extraction.checkpoint import Outcome, extract_checkpoint
from ncanalyze.store.extraction.config import (
    config_hash,
    config_record,
    layer_plan,
    val_data,
)
from ncanalyze.store.extraction.settings import ExtractConfig
from ncanalyze.store.resume import DeferredInterrupt
from ncanalyze.store.runs.local import ExtractResult, announcer, check_settings, each_checkpoint, todo
from ncanalyze.store.sources.discover import Checkpoint, looks_local, tagged
from ncanalyze.store.sources.load import quiet_loading, resolve_device
from ncanalyze.store.sources.revisions import COMMIT, check_revision, step_of
from ncanalyze.store.store import Status, Store

log = logging.getLogger(__name__)

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
# what a snapshot needs: config, safetensors weights (and their index), tokenizer files
SAFE_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken"]
PICKLE_PATTERNS = ["*.bin"]


def is_hub_id(path: str) -> bool:
    """Not a local path, and shaped like ``ORG/NAME`` or ``NAME``: a Hub model id.

    Parameters
    ----------
    path
        A PATH of the command.

    Returns
    -------
    bool
        It is a Hub model id.
    """
    return not Path(path).exists() and not looks_local(path) and bool(_HUB_ID.match(path))


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


@dataclass
class Snapshot:
    """A revision resolved to a local folder; ``downloaded``: this run fetched it (it was not in the cache)."""
    repo: str
    revision: str
    path: Path
    downloaded: bool

    @property
    def commit(self) -> str:
        return self.path.name

    def checkpoint(self, run: str | None = None) -> Checkpoint:
        """This revision as a checkpoint.

        Parameters
        ----------
        run
            The run's name [default: the repository's name without the organisation].

        Returns
        -------
        Checkpoint
            At ``<run>/<revision>`` (a ``/`` in the revision becomes ``-``).
        """
        name = self.revision.replace("/", "-")
        return Checkpoint(run or self.repo.split("/")[-1], name, self.path, self.path)

    def attrs(self) -> dict:
        """What the group records of where it came from (``global_step`` only where the name holds a number)."""
        step = step_of(self.revision)
        return {"hub_repo": self.repo, "hub_revision": self.revision, "hub_commit": self.commit,
                "source": f"hf://{self.repo}@{self.commit}", **({"global_step": step} if step is not None else {})}

    def delete(self) -> bool:
        """Remove this snapshot from the cache (blobs that other revisions share stay); whether it was there."""
        from huggingface_hub import scan_cache_dir

        if not self.path.is_dir():
            return False
        cache = self.path.parents[2]  # <cache>/models--ORG--NAME/snapshots/<commit>
        scan_cache_dir(cache).delete_revisions(self.commit).execute()
        return not self.path.exists()


def _has_safetensors(p: Path) -> bool:
    return any(p.glob("*.safetensors"))


def _cached(repo: str) -> set[str]:
    """The commits whose snapshot folders are in the cache now."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    snaps = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo, repo_type="model") / "snapshots"
    return {p.name for p in snaps.iterdir()} if snaps.is_dir() else set()


def _dangling(path: Path) -> list[str]:
    """The snapshot's files whose blob is missing (an interrupted download, a blob deleted by hand)."""
    return sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_symlink() and not p.exists())


def fetch(repo: str, revision: str, allow_pickle: bool = False) -> Snapshot:
    """:func:`_fetch`, with the Hub client's retry chatter unprinted (a failure is one line of ours).

    Parameters
    ----------
    repo, revision
        The Hub model id and revision.
    allow_pickle
        Pickle weights may be fetched (only for a revision without safetensors).

    Returns
    -------
    Snapshot
        The local snapshot.
    """
    with quiet_loading():
        return _fetch(repo, revision, allow_pickle)


def _fetch(repo: str, revision: str, allow_pickle: bool = False) -> Snapshot:
    """The local snapshot of ``repo`` at ``revision``: from the cache when it is there, else downloaded (safetensors,
    config and tokenizer files; pickle ``.bin`` weights only with ``allow_pickle`` and only when the revision has no
    safetensors). Raises huggingface_hub's errors (see :data:`HUB_ERRORS`) or a UserError."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    patterns = SAFE_PATTERNS + (PICKLE_PATTERNS if allow_pickle else [])
    before = _cached(repo)  # a snapshot cached before (under any ref) is never this run's download
    try:
        path = Path(snapshot_download(repo, revision=revision, allow_patterns=SAFE_PATTERNS, local_files_only=True))
    except LocalEntryNotFoundError:  # not cached (offline, this raises again below, naming HF_HUB_OFFLINE)
        path = Path(snapshot_download(repo, revision=revision, allow_patterns=SAFE_PATTERNS))
    online = not constants.HF_HUB_OFFLINE
    if online and (_dangling(path) or not _has_safetensors(path)):
        if _dangling(path) or allow_pickle or not any(path.glob("*.bin")):  # a partial cache, or pickle allowed
            path = Path(snapshot_download(repo, revision=revision, allow_patterns=patterns))
    snap = Snapshot(repo, revision, path, downloaded=path.name not in before)
    if _dangling(path):
        raise UserError(f"its cached snapshot {path} lacks the file(s) {', '.join(_dangling(path))} (a blob missing "
                        "after an interrupted download): fetch it again online, or delete that snapshot folder")
    if not _has_safetensors(path) and not (allow_pickle and any(path.glob("*.bin"))):
        if not any(path.glob("*.bin")):
            raise UserError(f"its snapshot {path} holds no weights (no .safetensors, no .bin): not a model "
                            "repository at this revision, or an incomplete download; check the repository's files")
        raise UserError("no .safetensors weights, only pickle weights (.bin)"
                        + ("" if allow_pickle else "; if you trust them, pass --allow-pickle"))
    return snap


def hub_errors() -> tuple[type[Exception], ...]:
    """What resolving a revision raises when it cannot be had (missing revision or repository, not cached while
    offline, gated, the Hub unreachable).

    Returns
    -------
    tuple of type
        huggingface_hub's exception types.
    """
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    return (RevisionNotFoundError, RepositoryNotFoundError, GatedRepoError, LocalEntryNotFoundError,
            OfflineModeIsEnabled, HfHubHTTPError, HFValidationError)


def explain(repo: str, revision: str, e: Exception) -> str:
    """One line naming the revision, what went wrong and the fix.

    Parameters
    ----------
    repo, revision
        The Hub model id and revision.
    e
        What resolving it raised.

    Returns
    -------
    str
        The line.
    """
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    what = f"{repo}@{revision}"
    if isinstance(e, RevisionNotFoundError):
        return f"{what}: no such revision on the Hub; check the name (branches and tags of the repository)"
    if isinstance(e, GatedRepoError):
        return f"{what}: the repository is gated; accept its terms on the Hub and log in (hf auth login or HF_TOKEN)"
    if isinstance(e, RepositoryNotFoundError):
        return (f"{what}: no such repository on the Hub, or it is private (log in with hf auth login or HF_TOKEN); "
                f"if {repo} was meant as a local folder, it does not exist")
    if isinstance(e, IncompleteSnapshotError):
        return f"{what}: its cached snapshot is incomplete and the Hub cannot be reached; download it again online"
    if isinstance(e, LocalEntryNotFoundError):
        local = f" (nor is {repo} a local folder)" if revision == "main" else ""
        return (f"{what}: not in the Hugging Face cache{local}, and the Hub is not reachable (HF_HUB_OFFLINE set, "
                "or no network); fetch it once online, or point HF_HUB_CACHE/HF_HOME at a cache that has it")
    if isinstance(e, HFValidationError):
        return f"{what}: not a valid Hub model id or revision, and no such local folder"
    return f"{what}: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"


def resolved_commit(repo: str, revision: str) -> str | None:
    """The commit ``revision`` points at, without downloading: itself if a commit hash; online, the Hub's answer;
    offline, the cache's ref; None where neither knows.

    Parameters
    ----------
    repo, revision
        The Hub model id and revision.

    Returns
    -------
    str or None
        The commit's hash.
    """
    from huggingface_hub import HfApi, constants, errors
    from huggingface_hub.file_download import repo_folder_name

    if COMMIT.match(revision):
        return revision
    if not constants.HF_HUB_OFFLINE:
        try:
            return HfApi().model_info(repo, revision=revision).sha
        except (*hub_errors(), OSError, getattr(errors, "HTTPError", OSError)) as e:  # no network (the client's
            # transport error): the cache's ref, else unknown
            log.debug("%s@%s: the Hub did not answer (%s)", repo, revision, e)
    ref = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo, repo_type="model") / "refs" / revision
    return ref.read_text().strip() if ref.is_file() else None


def done_before(store: Store, ckpt: Checkpoint, repo: str, revision: str, cfg: ExtractConfig) -> bool:
    """Whether a revision can be skipped without fetching its snapshot.

    Parameters
    ----------
    store, ckpt
        The store and the revision's checkpoint.
    repo, revision
        The Hub repository and revision.
    cfg
        The configuration.

    Returns
    -------
    bool
        Its group is complete, from this repository and revision (and its commit, where that can be known without
        downloading), under the same settings (:meth:`Store.status` says skip).
    """
    attrs = store.attrs(ckpt.group) or {}
    if not (attrs.get("complete") and attrs.get("hub_repo") == repo and attrs.get("hub_revision") == revision):
        return False
    commit = resolved_commit(repo, revision)
    if commit is not None and commit != attrs.get("hub_commit"):
        return False
    old = json.loads(attrs.get("config", "{}"))  # the commit fixes the weights and the model's context
    val = val_data(cfg)
    want = config_record(None, cfg, resolve_device(cfg.device), cfg.block_size or old.get("block_size"), val.spec,
                         val.split, layer_plan(cfg, attrs.get("n_layers")), weights=old.get("weights"),
                         held_out=val.held_out)
    return store.status(ckpt.group, config_hash(want)) is Status.SKIP


def extract_hub(repo: str, revisions: list[str], store: str | Path | Store, cfg: ExtractConfig, overwrite: bool = False,
                delete_downloads: bool = False, restart: bool = False) -> ExtractResult:
    """Extract ``repo`` at each of ``revisions``, one at a time, into ``store``.

    Parameters
    ----------
    repo
        The Hub model id.
    revisions
        The revisions (:func:`parse_revisions`).
    store, cfg
        The store and the configuration (its tag applies).
    overwrite, restart
        As for :func:`~ncanalyze.store.extraction.checkpoint.extract_checkpoint`.
    delete_downloads
        Remove each snapshot this run downloaded once its extraction is over.

    Returns
    -------
    ExtractResult
        Labelled with ``repo``; a revision that could not be had or extracted is one of its errors.
    """
    store = Store.at(store)
    result = ExtractResult(repo, str(store))
    check_settings(cfg, store)
    name = repo.split("/")[-1]
    ckpts = {r: tagged([Snapshot(repo, check_revision(r), Path("."), False).checkpoint(name)], cfg.tag)[0]
             for r in revisions}
    check_groups(repo, revisions, {r: c.group for r, c in ckpts.items()}, store)
    announce = announcer(todo(store, list(ckpts.values()), overwrite), cfg, store, restart)

    def one(rev: str, interrupt: DeferredInterrupt) -> Outcome | None:
        if not overwrite and done_before(store, ckpts[rev], repo, rev, cfg):
            return Outcome.SKIPPED  # already in the store: nothing fetched
        return _revision(repo, rev, name, store, cfg, overwrite, delete_downloads, restart, announce, interrupt,
                         result.errors)

    return each_checkpoint(store, result, [(ckpts[r].group, r) for r in revisions], one, desc="revisions", unit="rev")


def _revision(repo: str, rev: str, name: str, store: Store, cfg: ExtractConfig, overwrite: bool,
              delete_downloads: bool, restart: bool, announce, interrupt: DeferredInterrupt,
              errors: list[str]) -> Outcome | None:
    """One revision fetched and extracted: its outcome, or None with a line added to ``errors``."""
    try:
        snap = fetch(repo, rev, cfg.allow_pickle)
    except hub_errors() as e:
        errors.append(explain(repo, rev, e))
        log.error("%s", errors[-1])
        return None
    except UserError as e:
        errors.append(f"{repo}@{rev}: {e}")
        log.error("%s", errors[-1])
        return None
    try:
        ckpt = tagged([snap.checkpoint(name)], cfg.tag)[0]
        return extract_checkpoint(ckpt, store, cfg, overwrite=overwrite, restart=restart, announce=announce,
                                  interrupt=interrupt, extra_attrs=snap.attrs())
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
