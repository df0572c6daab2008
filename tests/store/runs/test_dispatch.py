"""The dispatch of a command's PATHS is a library function: ``extract_paths`` sends local folders to this process (or
a cluster) and Hub ids to the Hub, with the run control in its Jobs; the command only prints."""
from __future__ import annotations

import pytest

from ncanalyze.core.errors import UserError
from ncanalyze.store.extraction.checkpoint import Outcome
from ncanalyze.store.extraction.settings import ExtractConfig
from ncanalyze.store.runs.dispatch import extract_paths


def _cfg(corpus) -> ExtractConfig:  # EXTRACT_OPTS, as extracted_store was made
    return ExtractConfig(dataset=str(corpus["train"]), max_train_tokens=8192, max_val_tokens=4096, batch_size=8,
                         samples_per_class=4)


def test_local_paths_run_here_and_each_result_is_handed_on(extracted_store, trained_run, corpus):
    seen = []
    results = extract_paths([trained_run / "checkpoint-20", trained_run / "checkpoint-40"], extracted_store,
                            _cfg(corpus), done=seen.append)
    assert seen == results and [r.label for r in results] == [str(trained_run / "checkpoint-20"),
                                                             str(trained_run / "checkpoint-40")]
    assert [list(r.statuses.values()) for r in results] == [[Outcome.SKIPPED], [Outcome.SKIPPED]]


def test_what_cannot_go_together_is_refused_by_the_library(trained_run, corpus, tmp_path):
    with pytest.raises(UserError, match="apply to Hub model ids"):
        extract_paths([trained_run], tmp_path / "s.zarr", _cfg(corpus), revisions=["step1"])
    with pytest.raises(UserError, match="Hub revisions are extracted in this process"):
        extract_paths(["org/model"], tmp_path / "s.zarr", _cfg(corpus), shards=2)
    assert not (tmp_path / "s.zarr").exists()
