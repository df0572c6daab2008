"""Imported by the fork server (cli_process.PRELOAD) after the libraries: numba's CPU target set up and the
accumulators' CPU pass (chan_numba.chan_rows) read from its cache once, in numpy alone (a torch kernel could start
the intra-op threads), so that a forked CLI process does not pay it again: ~0.45 s of a core each (a tiny extract
forked 1.26 s -> 0.77-0.82 s, medians of six in four runs). It starts no thread: numba's set-up imports scipy.linalg, whose BLAS
thread the preloaded scipy.stats has started already."""
import os

import numpy as np
from ncanalyze.analyzer.chan_numba import chan_rows

WARMED_IN = os.getpid()  # the process that ran the warm-up (a forked process: the server's)

for _dtype in (np.float32, np.float64):  # the features' dtypes it is called with
    chan_rows(np.ones((2, 2), _dtype), np.arange(2), np.zeros(1, np.int64), np.full(1, 2), np.zeros(1, np.int64),
              np.zeros((1, 2)), np.zeros(1), np.zeros(2), np.empty((3, 2)))


def warmed_before_the_fork() -> bool:
    """In a process forked from the server: whether the server ran the warm-up (not this process, on import)."""
    return WARMED_IN != os.getpid() and len(chan_rows.signatures) == 2
