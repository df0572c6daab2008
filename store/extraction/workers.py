"""A train batch's accumulator updates spread over the cores the thread policy gives torch now.

The updates of a batch (each fold's statistics of each layer, each layer's reservoir) touch disjoint arrays, so they
may run at once. Where the thread policy (``ncanalyze.core.threads``) gives torch more than one thread on the CPU,
they run on as many worker threads, each at one intra-op thread: the small per-fold kernels (grouped sums, index
additions, a fold's d x d Gram) keep both cores busy without the intra-op team's barriers, and every update's
arithmetic is the same however many run at once, so the sums' bits do not depend on the load. At one thread (and on
an accelerator) the caller runs them itself, in order.
"""
from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait

import torch


def _one_thread() -> None:
    torch.set_num_threads(1)  # this worker's own OpenMP and MKL settings (thread-local); the caller's stay as they were


def _as_caller(task: Callable[[], None], inference: bool, grad: bool) -> None:
    with torch.inference_mode(inference), torch.set_grad_enabled(grad):
        task()


class Workers:
    """Runs lists of independent calls (:meth:`__call__`) on ``torch.get_num_threads()`` worker threads of one intra-op
    thread each, or in the caller where that is 1 or ``device`` is not the CPU; the pool follows the policy's count
    from call to call. A context manager: the pool's threads end with it."""

    def __init__(self, device: torch.device | str):
        self.cpu = torch.device(device).type == "cpu"
        self._pool: ThreadPoolExecutor | None = None
        self._size = 0

    def __call__(self, tasks: list[Callable[[], None]]) -> None:
        """Run every call of ``tasks`` once (each touching its own arrays), and return when all have run; an error
        of one is raised here after the rest have run."""
        n = torch.get_num_threads() if self.cpu else 1
        if n <= 1:
            for task in tasks:
                task()
            return
        if n != self._size:
            self.close()
            self._pool, self._size = ThreadPoolExecutor(n, "accumulate", initializer=_one_thread), n
        modes = torch.is_inference_mode_enabled(), torch.is_grad_enabled()  # thread-local: the caller's, carried over
        futures = [self._pool.submit(_as_caller, task, *modes) for task in tasks]
        wait(futures)
        for future in futures:
            future.result()

    def close(self) -> None:
        """End the pool's threads (a later call starts a new pool), and give torch's process-wide default for new
        threads back the caller's count (a worker's setting of its own count set that default to 1)."""
        if self._pool is not None:
            self._pool.shutdown()
            torch.set_num_threads(torch.get_num_threads())
        self._pool, self._size = None, 0

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
