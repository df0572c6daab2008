"""The one result of an extraction, local (extract.py), Hub (hub.py) or cluster (cluster.py)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ExtractResult:
    """What one extraction did (local, Hub or cluster).

    Parameters
    ----------
    label
        What was extracted: the path, the Hub repository, or the paths sent to a cluster.
    store
        The store, as given.
    statuses
        Each checkpoint group's status: 'done', 'resumed', 'skipped' or 'failed: why'.
    errors
        One line for each thing that failed before it had a group (a Hub revision that could not be fetched).
    """
    label: str
    store: str
    statuses: dict[str, str] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    def count(self, status: str) -> int:
        """How many groups have ``status``."""
        return sum(v == status for v in self.statuses.values())

    @property
    def failures(self) -> list[str]:
        """One line for each failure: the errors, then each failed group with why."""
        return self.errors + [f"{g} {v}" for g, v in self.statuses.items() if v.startswith("failed")]

    def summary(self) -> str:
        """``LABEL: N extracted, N resumed, N already in STORE[, N failed]``, the line the command prints."""
        failed = len(self.failures)
        return (f"{self.label}: {self.count('done')} extracted, {self.count('resumed')} resumed, "
                f"{self.count('skipped')} already in {self.store}" + (f", {failed} failed" if failed else ""))
