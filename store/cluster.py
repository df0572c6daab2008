"""A Dask distributed cluster: connecting to it (shared by measure and extract), and extraction with checkpoints as
tasks (and, with shards, the parts of one checkpoint's train pass as tasks merged on the workers).

Every task writes into the same store, which must be a path every worker sees (a shared file system). Concurrent
writers are safe: each checkpoint has its lock and its staged swap (extract.py, io.py), and creating the root and run
groups tolerates racing writers (``io.ensure_group``). A task whose worker dies is run again by dask and resumes from
the checkpoint's saved state (the lock dies with the process that held it).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import os
import re
import uuid
from collections.abc import Iterator
from pathlib import Path

import dask
from tqdm.auto import tqdm

from ncanalyze.analyzer.errors import CheckpointError, UserError

log = logging.getLogger("ncanalyze")

ENV = "DASK_SCHEDULER_ADDRESS"
CONNECT_S = 10  # seconds for a scheduler to answer
_ADDRESS = re.compile(r"^(?:(?P<scheme>tcp|tls|ucx|ws|wss)://)?(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9][A-Za-z0-9._-]*)"
                      r"(?::(?P<port>\d{1,5}))?/?$")


def check_address(address: str) -> dict:
    """``Client`` keyword arguments for ``address``: ``scheme://host:port`` or ``host:port`` (what ``dask scheduler``
    prints), or a scheduler file (``--scheduler-file`` of ``dask scheduler``, a .json). Anything else is a one-line
    error naming the forms."""
    address = address.strip()
    if address.endswith(".json"):
        if not Path(address).is_file():
            raise UserError(f"the scheduler file {address} does not exist: start `dask scheduler --scheduler-file "
                            f"{address}` first, or pass the scheduler's address (tcp://host:8786)")
        return {"scheduler_file": address}
    m = _ADDRESS.match(address)
    if not m or not (m["scheme"] or m["port"]) or (m["port"] and not 0 < int(m["port"]) < 65536):
        raise UserError(f"--scheduler {address!r} is not a Dask scheduler address: pass one like tcp://host:8786 "
                        f"(as `dask scheduler` prints it) or a scheduler file (.json), or leave --scheduler and "
                        f"${ENV} unset to run locally")
    return {"address": address}


@contextlib.contextmanager
def client(address: str | None, workers: float | None = None) -> Iterator[object | None]:
    """A ``distributed.Client`` on ``address`` (or ``$DASK_SCHEDULER_ADDRESS``), set as dask's default scheduler
    while it is open; None (and dask's local threaded scheduler) without one. The address must answer as a Dask
    scheduler within ``CONNECT_S`` seconds, else a one-line error; with ``workers``, a first worker must join within
    that many seconds, else a one-line error saying how long it waited."""
    address = address or os.environ.get(ENV)
    if not address:
        with dask.config.set(scheduler="threads"):
            yield None
        return
    kwargs = check_address(address)
    _probe(kwargs.get("address") or _file_address(address), address)
    from distributed import Client

    try:
        c = Client(**kwargs, timeout=f"{CONNECT_S}s", set_as_default=True)
    except (OSError, TimeoutError) as e:
        raise UserError(f"cannot reach the dask scheduler at {address} ({e}); start it, or drop --scheduler / "
                        f"{ENV} to run locally") from None
    with c:
        if workers is not None and not c.scheduler_info()["workers"]:
            log.info("waiting up to %g s for a dask worker to join the scheduler at %s", workers, address)
            try:
                c.wait_for_workers(1, timeout=workers)
            except TimeoutError:
                raise UserError(f"the dask scheduler at {address} has no workers (waited {workers:g} s for one): "
                                f"start some (`dask worker {address}`), or drop --scheduler / {ENV} to run "
                                "locally") from None
        yield c


def _file_address(path: str) -> str:
    """The address a scheduler file holds; a one-line error when it holds none."""
    try:
        address = json.loads(Path(path).read_text()).get("address")
    except (OSError, ValueError, AttributeError):
        address = None
    if not isinstance(address, str):
        raise UserError(f"the scheduler file {path} holds no scheduler address (it is not the JSON `dask scheduler "
                        f"--scheduler-file {path}` writes): start the scheduler with it, or pass its address")
    return address


def _probe(address: str | None, shown: str) -> None:
    """A one-line error unless a Dask scheduler answers at tcp ``address`` within ``CONNECT_S`` seconds (a Client
    on a silent port waits for ever; on a port answered by something else it reads a length of exabytes)."""
    if not address or ("://" in address and not address.startswith("tcp://")):
        return  # tls/ucx/ws need the Client's own security settings
    from distributed.comm import connect

    async def identity():
        comm = await connect(address if "://" in address else f"tcp://{address}", timeout=CONNECT_S)
        try:
            await comm.write({"op": "identity", "reply": True})
            return await comm.read()
        finally:
            comm.abort()

    fix = f"pass the address `dask scheduler` prints, or drop --scheduler / {ENV} to run locally"
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:  # its own event loop, even under a running one
            info = pool.submit(asyncio.run, asyncio.wait_for(identity(), CONNECT_S)).result()
    except (TimeoutError, OSError) as e:
        raise UserError(f"no dask scheduler answered at {shown} within {CONNECT_S} s ({type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else 'no answer'}); start it, or {fix}") from None
    except Exception as e:  # noqa: BLE001  (whatever a stranger's bytes make of dask's protocol, MemoryError too)
        raise UserError(f"{shown} answered, but not as a dask scheduler ({type(e).__name__}); {fix}") from None
    if not isinstance(info, dict) or info.get("type") != "Scheduler":
        kind = info.get("type") if isinstance(info, dict) else type(info).__name__
        raise UserError(f"{shown} answered as a dask {kind}, not a scheduler; {fix}")


def _resources(c) -> dict | None:
    """{"GPU": 1} when the workers declare GPU resources (``dask worker --resources GPU=1``): one checkpoint per GPU
    at a time. Waits for the first worker (a batch queue may take a while to start them)."""
    if not c.scheduler_info()["workers"]:
        log.info("waiting for a dask worker to join the scheduler at %s", c.scheduler.address)
        c.wait_for_workers(1)
    workers = c.scheduler_info()["workers"].values()
    return {"GPU": 1} if any("GPU" in (w.get("resources") or {}) for w in workers) else None


def _why(e: BaseException) -> str:
    from distributed import KilledWorker

    if isinstance(e, KilledWorker):
        return ("its worker died every time it ran it (out of memory? see the worker logs); run the same command "
                "again to resume it")
    return str(e)


def extract_on_cluster(paths: list[str | Path], store: str | Path, cfg, address: str | None,
                       overwrite: bool = False, restart: bool = False, shards: int = 1) -> dict[str, str]:
    """Extract every checkpoint under ``paths`` into ``store`` on the cluster at ``address``: one task per
    checkpoint (``shards`` > 1: a plan task, the shards, a merge tree and a final task). Progress is shown as
    checkpoints complete; returns {group: 'done' | 'resumed' | 'skipped' | 'failed: why'}.

    A checkpoint bad in itself (CheckpointError) fails alone; any other error cancels the rest and is raised."""
    # here, not at the top: measure uses this module's client() without loading torch
    from ncanalyze.store import shards as sh
    from ncanalyze.store.discover import discover
    from ncanalyze.store.extract import check_settings, extract_checkpoint, tagged
    from ncanalyze.store.lock import checkpoint_lock
    from ncanalyze.store.resume import drop_state, partial_dir, prune, state_path

    address = address or os.environ.get(ENV)
    if not address:
        raise UserError(f"no dask scheduler given: pass --scheduler ADDRESS or set ${ENV}")
    check_address(address)  # before anything is created
    store = Path(store).absolute()  # the workers may run elsewhere: no relative paths
    ckpts = [c for p in paths for c in tagged(discover(p), cfg.tag)]
    check_settings(cfg, store, shards)
    if restart:  # here, once: a task run again after its worker died must resume, not restart
        for ckpt in ckpts:
            spath = state_path(store, ckpt)
            with checkpoint_lock(spath.with_suffix(".lock"), ckpt.group):
                drop_state(spath)
    from distributed import as_completed

    results: dict[str, str] = {}
    with client(address) as c:
        res = _resources(c)
        tag = uuid.uuid4().hex[:8]
        opts = dict(pure=False, resources=res)
        log.info("%d checkpoint(s) as tasks on %s (%d workers%s)%s", len(ckpts), c.scheduler.address,
                 len(c.scheduler_info()["workers"]), ", one GPU each" if res else "",
                 f", {shards} shards each" if shards > 1 else "")
        what: dict = {}  # future -> (checkpoint, stage)
        for ckpt in ckpts:
            if shards > 1:
                f = c.submit(sh.plan, ckpt, store, cfg, shards, overwrite, False, key=f"plan {ckpt.group} {tag}",
                             **opts)
                what[f] = (ckpt, "plan")
            else:
                f = c.submit(extract_checkpoint, ckpt, store, cfg, overwrite, False,
                             key=f"extract {ckpt.group} {tag}", **opts)
                what[f] = (ckpt, "extract")
        done = as_completed(list(what))
        bar = tqdm(total=len(ckpts), desc="checkpoints", unit="ckpt", disable=None)
        try:
            for f in done:
                ckpt, stage = what.pop(f)
                try:
                    out = f.result()
                except CheckpointError as e:
                    out = f"failed: {e}"
                except UserError:
                    raise
                except Exception as e:  # noqa: BLE001  (a task's own failure, raised again here by distributed)
                    from distributed import KilledWorker

                    if not isinstance(e, KilledWorker):
                        raise
                    out = f"failed: {_why(e)}"
                if stage == "plan" and out == sh.WHOLE:
                    nf = c.submit(extract_checkpoint, ckpt, store, cfg, overwrite, False,
                                  key=f"extract {ckpt.group} {tag}", **opts)
                    what[nf] = (ckpt, "extract")
                    done.add(nf)
                    continue
                if stage == "plan" and isinstance(out, list):
                    nf = _submit_shards(c, sh, ckpt, store, cfg, out, overwrite, tag, opts)
                    what[nf] = (ckpt, "finish")
                    done.add(nf)
                    continue
                results[ckpt.group] = out
                bar.update()
                log.info("%s: %s", ckpt.group, out)
        finally:
            bar.close()
            for f in what:
                f.cancel()
    prune(partial_dir(store))
    return {ckpt.group: results[ckpt.group] for ckpt in ckpts if ckpt.group in results}


def _submit_shards(c, sh, ckpt, store: Path, cfg, parts: list[tuple[int, int]], overwrite: bool, tag: str,
                   opts: dict):
    """The shards of one checkpoint, their merge tree (on any worker: no GPU needed) and the final task; returns the
    final task's future (a shard's error reaches it)."""
    states = [c.submit(sh.train_shard, ckpt, cfg, a, b, key=f"shard {ckpt.group} [{a}:{b}] {tag}", **opts)
              for a, b in parts]
    for depth, level in enumerate(sh.merge_order(len(states))):
        states = [states[i] if j < 0 else
                  c.submit(sh.merge_states, states[i], states[j], cfg.samples_per_class, cfg.seed, pure=False,
                           key=f"merge {ckpt.group} {depth}.{n} {tag}")
                  for n, (i, j) in enumerate(level)]
    return c.submit(sh.finish, ckpt, store, cfg, states[0], overwrite, key=f"finish {ckpt.group} {tag}", **opts)
