"""A benchmark's run recorded (``--record``): what it printed, the command that reproduces it, when, and the machine's
load, written to ``benchmarks/results/<script>.md``. The documentation's performance page includes every such file
verbatim, so a figure quoted there is one a script wrote, not one typed by hand."""
from __future__ import annotations

import contextlib
import io
import os
import shlex
import sys
import time
from collections.abc import Iterator
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


class _Tee(io.TextIOBase):
    """A text stream that writes to several."""

    def __init__(self, *streams):
        self.streams = streams

    def write(self, s: str) -> int:
        for stream in self.streams:
            stream.write(s)
        return len(s)

    def flush(self) -> None:
        for stream in self.streams:
            stream.flush()


@contextlib.contextmanager
def recorded(record: bool) -> Iterator[None]:
    """With ``record``, what the block prints also goes to ``benchmarks/results/<script>.md`` when it ends whole
    (an interrupted or failed run writes nothing); without, nothing changes."""
    if not record:
        yield
        return
    script = Path(sys.argv[0]).name
    printed, before = io.StringIO(), sys.stdout
    start, load = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), os.getloadavg()[0]
    sys.stdout = _Tee(before, printed)
    try:
        yield
    finally:  # the run's own stdout back whatever happened; a run that raised records nothing (below is skipped)
        sys.stdout = before
    command = shlex.join(["python", f"benchmarks/{script}", *(a for a in sys.argv[1:] if a != "--record")])
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{Path(script).stem}.md").write_text(
        f"### `{command}`\n\nRun {start} on {os.cpu_count()} cores, load average {load:.1f} at its start and "
        f"{os.getloadavg()[0]:.1f} at its end (a shared machine: quote ratios, not rates).\n\n"
        f"```\n{printed.getvalue().rstrip()}\n```\n")
