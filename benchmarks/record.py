"""A benchmark's run recorded: what it printed, the command that reproduces it, when, and the machine's load, written
to ``benchmarks/results/<script>.md``; then ``benchmarks/RESULTS.md``, every recorded run in name order, is written
again from those files. The documentation's performance page includes them verbatim, so a figure quoted there or in
RESULTS.md is one a script wrote, not one typed by hand.

    python benchmarks/record.py extract.py --repeats 3       # any benchmark, its own arguments after its name
    python benchmarks/record.py --as extract-validation extract.py --validation   # recorded under another name
    python benchmarks/record.py --index                      # RESULTS.md again from benchmarks/results/
"""
from __future__ import annotations

import contextlib
import io
import os
import runpy
import shlex
import subprocess
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
def recorded(record: bool, name: str | None = None) -> Iterator[None]:
    """With ``record``, what the block prints also goes to ``benchmarks/results/<name>.md`` (default: the script's,
    ``sys.argv[0]``) when it ends whole (an interrupted or failed run writes nothing); without, nothing changes."""
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
    command = shlex.join(["python", f"benchmarks/{script}", *sys.argv[1:]])
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name or Path(script).stem}.md").write_text(
        f"### `{command}`\n\nRun {start}{commit()} on {os.cpu_count()} cores, load average {load:.1f} at its start "
        f"and {os.getloadavg()[0]:.1f} at its end (a shared machine: quote ratios, not rates).\n\n"
        f"```\n{printed.getvalue().rstrip()}\n```\n")
    index()


def commit() -> str:
    """`` at commit <short hash>`` of the repository the benchmarks live in (``+ changes`` where files differ from it),
    or nothing outside a git checkout: which code a recorded figure measured."""
    try:
        where = ["git", "-C", str(RESULTS.parent)]
        head = subprocess.run([*where, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run([*where, "status", "--porcelain", "--untracked-files=no", "--", ":(top)",
                                ":(top,exclude)benchmarks/results", ":(top,exclude)benchmarks/RESULTS.md"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""
    return f" at commit {head.stdout.strip()}" + (" + changes" if dirty else "")


HEADER = ("# Benchmark results\n\nWritten by `benchmarks/record.py` from `benchmarks/results/` (do not edit): each "
          "benchmark's latest recorded run, its command first. Ratios are measured within one run; these machines are "
          "shared, so absolute rates vary. Figures from before the scripts recorded their runs are in "
          "`benchmarks/EARLIER.md`.\n\n")


def index() -> Path:
    """benchmarks/RESULTS.md from every recorded run (benchmarks/results/*.md), in name order."""
    runs = sorted(RESULTS.glob("*.md"))
    out = RESULTS.parent / "RESULTS.md"
    out.write_text(HEADER + ("\n".join(p.read_text() for p in runs) if runs else "No run recorded yet.\n"))
    return out


def main(argv: list[str]) -> None:
    """``[--as NAME] SCRIPT [ARGS...]``: run benchmarks/SCRIPT with ARGS as its command line, recorded (as NAME: a
    second mode of one script kept beside the first); ``--index``: RESULTS.md."""
    if argv[:1] == ["--index"] or not argv:
        print(index())
        return
    name = None
    if argv[:1] == ["--as"] and len(argv) > 2 and argv[1].replace("-", "").replace("_", "").isalnum():
        name, argv = argv[1], argv[2:]
    script = Path(__file__).resolve().parent / Path(argv[0]).name
    if not script.is_file() or script.suffix != ".py" or script.name == "record.py":
        raise SystemExit(f"record.py: no benchmark {argv[0]!r} in benchmarks/ (e.g. extract.py)")
    sys.argv = [str(script), *argv[1:]]
    sys.path.insert(0, str(script.parent))
    with recorded(True, name):
        runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
