"""The CLI in a process of its own, forked from a server that imported its libraries once.

A new Python spends ~5 s of a core importing torch and transformers before the CLI does anything; the suite starts
the CLI in a process dozens of times (to SIGKILL it at a known batch, interrupt it, or run two writers at once). Here
multiprocessing's forkserver, started once per test process, imports them once, and each CLI process (and each
dask worker of a LocalCluster, :func:`forked_workers`) is forked from it: a real process (its own pid, signals, exit status, file descriptors), started in ~0.1 s. The server holds no
Python thread when it forks (only imports ran in it, and numba's set-up, forkserver_warmup.py), so nothing is forked
mid-lock, unlike a fork of the test process; the BLAS libraries' idle thread servers start again in a child.

A library may read the environment when imported (huggingface_hub's HF_* variables): a process is forked only while
the environment is the one the server started with (pytest's own variables aside), else it is a new Python, as
before.
"""
from __future__ import annotations

import contextlib
import multiprocessing
import os
import subprocess
import sys
import threading
import time
from multiprocessing import reduction

# what a CLI extraction imports, but datasets (pyarrow starts a thread of its own when imported: a fork must not)
PRELOAD = ["torch", "transformers.modeling_utils", "transformers.models.auto.modeling_auto",
           "transformers.models.auto.tokenization_auto", "transformers.models.gpt_neo.modeling_gpt_neo", "scipy.stats",
           "zarr", "xarray", "dask.array", "numba", "ncanalyze.cli.main", "ncanalyze.cli.extract", "ncanalyze.cli.measure",
           "ncanalyze.store.extraction.passes", "ncanalyze.store.extraction.checkpoint", "ncanalyze.analyzer.metrics",
           "distributed", "forkserver_warmup"]
HERE = os.path.dirname(os.path.abspath(__file__))
NEW_PYTHON = [sys.executable, "-c", "from ncanalyze.cli.main import main; main()"]

_context = multiprocessing.get_context("forkserver")
_context.set_forkserver_preload(PRELOAD)


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}


SERVER_ENV = _env()  # the environment the suite started with (conftest's settings made): the server's


def ensure_server() -> None:
    """Start this process's fork server, once, under :data:`SERVER_ENV` (whatever a test changed meanwhile)."""
    from multiprocessing import forkserver

    now = dict(os.environ)
    try:
        os.environ.clear()
        os.environ.update(SERVER_ENV)
        # tests/ on the server's path for forkserver_warmup (the server does not take this process's sys.path)
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [HERE, SERVER_ENV.get("PYTHONPATH")]))
        forkserver.ensure_running()
    finally:
        os.environ.clear()
        os.environ.update(now)


@contextlib.contextmanager
def forked_workers():
    """dask's worker processes (a LocalCluster's, started in the block) forked from the fork server too (distributed's
    ``forkserver`` method, which it supports): real processes, without each importing torch again. Their
    environment is the server's (:data:`SERVER_ENV`)."""
    import dask

    ensure_server()  # before distributed's first worker: it would start the server with a preload list of its own
    with dask.config.set({"distributed.worker.multiprocessing-method": "forkserver"}):
        yield


class _Fd:
    """A file descriptor passed to the forked process (multiprocessing sends it over the server's socket)."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return _detach, (reduction.DupFd(self.fd),)


def _detach(dup) -> int:
    return dup.detach()


def _child(argv: list[str], fds: dict[int, _Fd | int], cwd: str, env: dict[str, str]) -> None:
    """In the forked process: its standard streams, folder and environment as a new Python would have them, then the
    CLI (its SystemExit is the process's exit status; an uncaught exception is printed with its traceback)."""
    for target, fd in fds.items():
        if fd != target:
            os.dup2(fd, target)
    for fd in set(fds.values()) - set(fds):
        os.close(fd)
    # the process's own streams for its life (never closed here): multiprocessing put /dev/null on stdin
    sys.stdin = open(0, closefd=False) if 0 in fds else sys.stdin  # noqa: SIM115
    sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = ["ncanalyze", *argv]
    from ncanalyze.cli.main import main
    main()


class ForkedCLI:
    """``subprocess.Popen(NEW_PYTHON + args, ...)`` for the CLI, forked from the server: ``stdin`` (a file descriptor
    or None), ``stdout`` (PIPE, DEVNULL or None), ``stderr`` (STDOUT, PIPE, DEVNULL or None) and ``text``; ``pid``,
    ``stdout``, ``stderr``, ``returncode`` (negative: the signal that ended it), :meth:`poll`, :meth:`wait`,
    :meth:`communicate`, :meth:`send_signal`, :meth:`kill`."""

    def __init__(self, args, stdin=None, stdout=None, stderr=None, text: bool = False):
        fds, mine, theirs = {}, {}, []
        if stdin is not None:
            fds[0] = stdin
        for target, how in ((1, stdout), (2, stderr)):
            if how == subprocess.PIPE:
                r, w = os.pipe()
                mine[target], fds[target] = r, w
                theirs.append(w)
            elif how == subprocess.DEVNULL:
                fds[target] = os.open(os.devnull, os.O_WRONLY)
                theirs.append(fds[target])
            elif how == subprocess.STDOUT and target == 2:
                fds[2] = fds.get(1, 1)
        self._proc = _context.Process(target=_child, args=([str(a) for a in args],
                                                            {t: _Fd(fd) for t, fd in fds.items()}, os.getcwd(),
                                                            dict(os.environ)))
        ensure_server()
        self._proc.start()
        for fd in theirs:
            os.close(fd)
        self.pid, self.returncode = self._proc.pid, None
        self.stdin = None
        self.stdout, self.stderr = (self._reader(mine[t], text) if t in mine else None for t in (1, 2))

    @staticmethod
    def _reader(fd: int, text: bool):
        return open(fd, "r" if text else "rb")

    def poll(self) -> int | None:
        if self.returncode is None and not self._proc.is_alive():
            self._proc.join()
            self.returncode = self._proc.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(NEW_PYTHON, timeout)
        return self.returncode

    def communicate(self, timeout: float | None = None):
        """Read stdout and stderr to their ends (each in a thread of its own, so that neither pipe fills; what a
        ``readline`` read ahead included), then wait; TimeoutExpired where the process outlives ``timeout`` (a hung
        child fails its test, never hangs the suite)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        out: dict = {}
        readers = [threading.Thread(target=lambda s=s: out.__setitem__(s, s.read()), daemon=True)
                   for s in (self.stdout, self.stderr) if s is not None]
        for t in readers:
            t.start()
        for t in readers:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                raise subprocess.TimeoutExpired(NEW_PYTHON, timeout)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        for s in out:
            s.close()
        return tuple(None if s is None else out[s] for s in (self.stdout, self.stderr))

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self._proc.kill()


def cli_process(args, **popen):
    """The CLI with ``args`` in a process: forked (:class:`ForkedCLI`) where the environment is the server's, else a
    new Python (``subprocess.Popen``); ``popen``: stdin, stdout, stderr, text."""
    if _env() == SERVER_ENV and set(popen) <= {"stdin", "stdout", "stderr", "text"}:
        return ForkedCLI(args, **popen)
    return subprocess.Popen(NEW_PYTHON + [str(a) for a in args], **popen)


def cli_run(args, timeout: float | None = None) -> subprocess.CompletedProcess:
    """``subprocess.run(NEW_PYTHON + args, capture_output=True, text=True, timeout=timeout)`` through
    :func:`cli_process`."""
    proc = cli_process(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    return subprocess.CompletedProcess(args, proc.returncode, out, err)
