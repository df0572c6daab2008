"""Hub revisions fetched (SPEC section 2): ``ORG/NAME --revision step1000`` resolved to a local snapshot folder with
``huggingface_hub.snapshot_download`` (so the cache, ``HF_HOME``/``HF_HUB_CACHE``, ``HF_HUB_OFFLINE`` and tokens work
as usual), a :class:`Snapshot` that is then extracted as a local model folder (store/runs/hub.py): one checkpoint at
``<NAME>/<revision>``, ``global_step`` from the number in the revision's name. A snapshot this run downloaded can be
removed after (never one whose commit was cached before, under any ref); what cannot be had is explained in one line
(:func:`explain`). Revision names are parsed and checked in revisions.py.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

from ncanalyze.core.errors import UserError
from ncanalyze.store.sources.discover import Checkpoint, looks_local
from ncanalyze.store.sources.load import quiet_loading
from ncanalyze.store.sources.revisions import COMMIT, step_of

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
