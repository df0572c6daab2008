"""The Dask distributed client: connecting to a scheduler (its address checked, a silent or foreign port refused in
one line), shared by ``measure`` and the cluster extraction (runs/cluster.py)."""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path

import dask
from ncanalyze.core.errors import UserError

log = logging.getLogger(__name__)

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
