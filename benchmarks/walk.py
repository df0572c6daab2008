"""The walk of a value through the house: every call of one of ncanalyze's functions that receives the value (a stop),
the modules in the order they are entered, and the returns (entering a module already left). Run in-process on one
extraction; prints stops, visits, returns and the modules visited most.

    python benchmarks/walk.py CHECKPOINT DATA [--shards 2] [--block-size 128]
    python benchmarks/walk.py CHECKPOINT DATA --measure [--min-count 2]

``--measure`` follows ``min_count`` instead, from ``measure_store`` to the metrics (on the checkpoint extracted first,
unfollowed, into a scratch store, with the jackknife's standard errors as by default): a stop is a call that receives it
(a parameter ``min_count``, or an object with that attribute) or the kept classes it selects (the array
``geometry.kept_classes`` returns, or an object holding it as ``K``): how often the metric path goes back to a module
it already left (issue 50 counted 29 returns).

A profile, not a timing: the stops count every call that receives the settings, a layer plan or an object holding
one (a Job included), so it measures how far the setting travels, not how often it is resolved (test_job.py counts
that). The dynamic walk counts every call (a per-batch loop repeats its stops); the static walk counts each function
once, at its first call, the way a reader follows the value through the code.
"""
from __future__ import annotations

import argparse
import collections
import sys
import tempfile


def carries(value, cfg_type, plan_type) -> bool:
    """Whether a call argument carries the ``layers`` setting: the settings, a layer plan, or an object holding one."""
    if isinstance(value, (cfg_type, plan_type)):
        return True
    return any(isinstance(getattr(value, a, None), (cfg_type, plan_type)) for a in ("cfg", "plan", "run", "job"))


def walk_min_count(store: str, min_count: int) -> list[tuple[str, str]]:
    """The stops of ``min_count`` and its kept classes through ``measure_store(store, min_count, force=True)``."""
    from ncanalyze.store.measure import measure_store
    kept: list = []  # the kept-class arrays kept_classes returned (followed by identity)
    stops: list[tuple[str, str]] = []

    def carries(name: str, value) -> bool:
        if name == "min_count" or getattr(value, "min_count", None) is not None:
            return True
        return any(value is k or getattr(value, "K", None) is k for k in kept)

    def profile(frame, event, arg):
        module = frame.f_globals.get("__name__", "")
        if not module.startswith("ncanalyze."):
            return
        code = frame.f_code
        if event == "return" and code.co_name == "kept_classes":
            kept.append(arg)
        if event != "call":
            return
        names = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
        if any(carries(n, frame.f_locals.get(n)) for n in names):
            stops.append((module.removeprefix("ncanalyze."), code.co_qualname))

    sys.setprofile(profile)
    try:
        measure_store(store, min_count=min_count, force=True)
    finally:
        sys.setprofile(None)
    return stops


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint"), ap.add_argument("data"), ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--measure", action="store_true", help="follow min_count through measure_store instead")
    ap.add_argument("--min-count", type=int, default=2)
    a = ap.parse_args()
    opts = ["--max-train-tokens", "8192", "--max-val-tokens", "4096", "--batch-size", "8", "--block-size",
            str(a.block_size)]
    if a.measure:
        from ncanalyze.cli.main import main as cli
        with tempfile.TemporaryDirectory() as tmp:
            cli(["-q", "extract", a.checkpoint, "--dataset", a.data, "--store", f"{tmp}/s.zarr", *opts],
                standalone_mode=False)
            stops = walk_min_count(f"{tmp}/s.zarr", a.min_count)
        what = f"min_count {a.min_count} from measure_store"
        report("dynamic", [m for m, _ in stops], what)
        report("static", [m for m, _ in dict.fromkeys(stops)], what)
        return
    from ncanalyze.cli.main import main as cli
    from ncanalyze.store.extraction import layers, settings
    plan_type = next(getattr(layers, n) for n in ("LayerPlan", "Plan") if hasattr(layers, n))
    stops: list[str] = []

    def profile(frame, event, arg):
        if event != "call" or not frame.f_globals.get("__name__", "").startswith("ncanalyze."):
            return
        code = frame.f_code
        args = [frame.f_locals.get(n) for n in code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]]
        if any(carries(v, settings.ExtractConfig, plan_type) for v in args):
            stops.append((frame.f_globals["__name__"].removeprefix("ncanalyze."), code.co_qualname))

    with tempfile.TemporaryDirectory() as tmp:
        sys.setprofile(profile)
        try:
            cli(["-q", "extract", a.checkpoint, "--dataset", a.data, "--store", f"{tmp}/s.zarr", "--shards",
                 str(a.shards), *opts], standalone_mode=False)
        finally:
            sys.setprofile(None)
    report("dynamic", [m for m, _ in stops], f"layers under --shards {a.shards}")
    derive = [f for m, f in stops if m == "store.extraction.config"]
    print(f"  the settings derived again (calls into store.extraction.config): {len(derive)}, resolve() "
          f"{derive.count('resolve')} times")
    report("static", [m for m, _ in dict.fromkeys(stops)], f"layers under --shards {a.shards}")


def report(kind: str, stops: list[str], what: str) -> None:
    """Print the stops, the module visits (runs of consecutive stops in one module) and the returns to a module
    already left, with the modules entered most."""
    visits = [m for i, m in enumerate(stops) if i == 0 or stops[i - 1] != m]
    returns = sum(m in visits[:i] for i, m in enumerate(visits))
    print(f"{kind} walk of {what}: {len(stops)} stops, {len(visits)} module visits in {len(set(visits))} modules, "
          f"{returns} returns to a module already left")
    for m, n in collections.Counter(visits).most_common(4):
        print(f"  {m}: entered {n} times")


if __name__ == "__main__":
    main()
