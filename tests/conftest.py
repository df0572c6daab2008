"""Session fixtures: a synthetic corpus, a BPE tokenizer and real GPT-Neo checkpoints trained by the Trainer."""
from __future__ import annotations

import contextlib
import importlib.util
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

# The test models are tiny: one thread per process beats two spinning ones, and keeps the suite steady when the
# two cores are shared (subprocesses and dask workers inherit it).
os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parents[1]


# The tests left out of the inner loop `pytest -m "not slow"` (CI's plain `pytest` runs them all): file -> the test
# functions (every parametrization) that took 3 s or more with their fixtures in `pytest --durations=0` on 2 shared
# cores (a load of ~9; about 1 s alone), or that need a fixture only such tests need (test_examples.py's sweep,
# test_trust.py's killed state); ALL marks a whole file. A name that no longer exists is an error: the list keeps up.
ALL = "*"
SLOW: dict[str, str | set[str]] = {
    "test_accessor.py": {"test_one_row_per_checkpoint_and_layer", "test_tree_table_is_the_metrics_table"},
    "test_classifier.py": {"test_an_old_and_a_mixed_store_read_and_measure_identically",
        "test_every_layer_measures_as_with_its_own_copy_of_the_head",
        "test_layer_groups_hold_no_classifier_and_the_checkpoint_group_one",
        "test_plain_xarray_reaches_the_head_from_a_layer_node",
        "test_store_open_gives_every_layer_node_the_checkpoints_head_lazily",
        "test_the_store_shrinks_by_the_copies_of_the_head",
        "test_the_training_callbacks_layer_groups_refer_to_the_checkpoints_head"},
    "test_cli.py": {"test_every_store_command_takes_store_as_option_or_positional",
        "test_the_check_sees_a_heavy_import"},
    "test_cluster.py": {"test_a_bad_checkpoint_fails_alone_and_is_named", "test_a_bad_scheduler_address_is_one_line",
        "test_a_worker_killed_mid_checkpoint_changes_nothing", "test_checkpoints_as_tasks_equal_the_local_run",
        "test_concurrent_writers_keep_the_root_and_every_group", "test_shards_merge_exactly"},
    "test_estimate.py": {"test_a_run_estimates_only_the_checkpoints_left",
        "test_one_line_over_two_runs_of_different_widths"},
    "test_examples.py": ALL,
    "test_extract.py": {"test_every_checkpoint_matches_brute_force",
        "test_every_data_form_gives_the_same_exact_statistics", "test_split_slices_of_one_text_file"},
    "test_kill_resume.py": {"test_kill_and_resume_is_bit_identical"},
    "test_figures.py": {"test_colour_bar_labelled_across_its_range", "test_dynamics_figure_panels_and_lines",
        "test_every_figure_in_png_pdf_and_svg_with_embedded_fonts", "test_many_runs_share_a_marker_and_have_no_legend",
        "test_no_colour_bar_when_all_sizes_are_equal_but_a_legend",
        "test_no_dynamics_figure_without_steps_or_with_one_step", "test_runs_joined_in_step_order_and_told_apart",
        "test_tick_labels_readable_at_any_range"},
    "test_trust_hub.py": {"test_ctrl_c_under_shards_stops_at_a_batch_boundary",
        "test_revisions_sharing_a_group_are_refused_naming_both",
        "test_online_without_network_skips_what_the_store_holds",
        "test_delete_downloads_keeps_a_snapshot_cached_under_another_ref", "test_empty_layers_is_named",
        "test_a_dangling_weights_symlink_fails_its_revision_alone"},
    "test_passes.py": {"test_a_pass_below_the_last_layer_stops_at_its_deepest_block",
        "test_the_cut_is_bit_identical_on_modern_architectures"},
    "test_memory.py": {"test_auto_under_a_small_state_memory_equals_one_pass_bit_for_bit",
        "test_auto_resumes_with_the_passes_it_saved_under_another_memory",
        "test_a_llama_shape_at_the_real_vocabulary_in_auto_passes_equals_one_pass"},
    "test_trust_messages.py": {"test_weights_of_another_shape_than_the_config_say_so"},
    "test_hub.py": {"test_a_missing_relative_path_that_is_no_hub_model_says_so",
        "test_a_pickle_only_revision_is_refused_unless_allowed",
        "test_revisions_from_the_cache_equal_the_local_checkpoints"},
    "test_layers.py": {"test_every_layer_matches_brute_force",
        "test_layers_per_pass_equals_one_pass_and_kill_and_resume_is_bit_identical",
        "test_report_with_layers_keeps_the_last_layers_statistics_and_adds_depth",
        "test_saved_embeddings_through_xarray_and_flox"},
    "test_linebreaks.py": {"test_linebreaks_kept_by_default_and_stripped_on_request"},
    "test_measure_store.py": {"test_distributed_cluster_equals_local",
        "test_recomputes_only_when_statistics_or_min_count_change"},
    "test_metrics.py": {"test_twenty_thousand_classes_in_bounded_memory"},
    "test_report.py": {"test_a_metric_without_values_keeps_its_panel_and_is_explained",
        "test_cli_on_a_metrics_csv_with_where_and_target", "test_csv_files", "test_no_controls_reads_well",
        "test_markdown_tables_and_links", "test_latex_tables", "test_figures_have_their_panels",
        "test_report_md_gives_holm_p_and_how_many_survive",
        "test_report_on_a_real_store", "test_report_with_tokens_uses_each_runs_latest_checkpoint",
        "test_tokens_of_chosen_checkpoints", "test_tokens_resolved_otherwise_or_given_twice_are_said_and_listed_once",
        "test_where_with_a_backticked_column_stays_inline_code"},
    "test_report_honest.py": {"test_whole_run_permutations_hold_alpha_under_a_null_where_rows_do_not",
        "test_stats_per_tag_exact_whole_run_p_and_rho",
        "test_report_md_has_a_section_per_tag_with_its_permutations_and_figures",
        "test_tag_is_a_plain_column_for_where_and_per_run_last_keeps_one_row_per_run",
        "test_depth_only_where_a_checkpoint_has_several_layers_with_gaps_said",
        "test_metrics_csv_says_what_the_numbers_rest_on_and_warns_on_thin_classes",
        "test_a_store_of_1_and_2_block_models_without_layers_draws_no_depth"},
    "test_report_target.py": ALL,
    "test_stats.py": {"test_a_control_nobody_recorded_is_not_used_and_said_so",
        "test_a_metric_without_values_is_a_note", "test_constant_control_is_dropped_and_said_so",
        "test_holm_columns_equal_statsmodels_per_scale", "test_p_values_are_reproducible_for_a_seed",
        "test_partial_r_needs_more_points_than_controls"},
    "test_tag.py": ALL,
    "test_trust_state.py": {"test_an_altered_state_is_refused_and_restart_equals_an_uninterrupted_run",
        "test_the_untouched_state_still_resumes_bit_identical",
        "test_a_damaged_layered_resume_is_one_line_and_restart_or_overwrite_discards_it",
        "test_the_untouched_layered_state_resumes_bit_identical",
        "test_two_d_token_arrays_record_their_width_and_refuse_another_block_size",
        "test_save_embeddings_on_a_full_disk_is_the_full_disk_line_and_releases_the_lock",
        "test_save_embeddings_beyond_the_train_positions_stages_what_there_is"},
    "test_tokens.py": {"test_one_cache_per_text_source_shared_by_every_checkpoint",
        "test_the_key_follows_what_determines_the_blocks"},
    "test_training.py": {"test_each_evaluation_equals_extract_of_the_checkpoint_saved_then",
        "test_the_metrics_are_in_the_trainers_logs_and_measure_reads_the_groups",
        "test_a_measurement_leaves_the_model_and_every_generator_as_it_was",
        "test_training_with_the_callback_is_bit_identical", "test_vocabulary_mismatch_is_one_line_and_training_goes_on",
        "test_a_run_under_other_settings_is_refused_and_kept",
        "test_every_n_steps_through_the_trainers_log_and_the_time_is_said",
        "test_a_full_disk_is_one_line_training_goes_on_and_the_store_is_kept",
        "test_ddp_ranks_share_the_blocks_and_equal_one_process"},
    "test_trust.py": {"test_a_broken_checkpoint_is_one_line_without_the_load_report",
        "test_a_corrupt_resume_state_is_one_line_and_restart_discards_it", "test_a_resume_on_changed_data_is_refused",
        "test_an_inconsistent_resume_state_is_refused", "test_corrupt_metadata_is_one_line",
        "test_ctrl_c_saves_the_state_and_the_resume_is_bit_identical",
        "test_report_goes_on_past_a_corrupt_and_a_degenerate_checkpoint",
        "test_two_writers_on_one_checkpoint_end_with_one_writers_store"},
}


def pytest_collection_modifyitems(config, items) -> None:
    """Mark the tests listed in :data:`SLOW` as ``slow``."""
    checked = set()
    for item in items:
        names = SLOW.get(item.path.name, ())
        if item.path.name not in checked and names != ALL:
            checked.add(item.path.name)
            gone = sorted(n for n in names if not hasattr(getattr(item, "module", None), n))
            if gone:
                raise pytest.UsageError(f"tests/conftest.py SLOW lists {item.path.name}::{', '.join(gone)}, which "
                                        "no longer exist: update the list")
        if names == ALL or getattr(item, "originalname", item.name) in names:
            item.add_marker(pytest.mark.slow)


def _load_example(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


train_sweep = _load_example("train_sweep")

NOUNS = "cat dog bird girl boy king queen tree house river ship star sun moon horse fox".split()
ADJS = "small big red old young happy dark bright quiet swift".split()
VERBS = "sees likes finds follows helps calls watches meets loves hears".split()


def make_corpus(path: Path, n_lines: int, seed: int) -> Path:
    """A toy language with structure a small model can learn: 'the ADJ NOUN VERB the ADJ NOUN .'"""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n_lines):
            words = ["the", rng.choice(ADJS), rng.choice(NOUNS), rng.choice(VERBS), "the", rng.choice(ADJS),
                     rng.choice(NOUNS)]
            if rng.random() < 0.3:
                words += ["and", rng.choice(VERBS), "a", rng.choice(NOUNS)]
            f.write(" ".join(words) + " .\n")
    return path


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("corpus")
    train = make_corpus(d / "train.txt", 6000, seed=1)
    val = make_corpus(d / "validation.txt", 600, seed=2)
    tok_dir = d / "tokenizer"
    train_sweep.train_tokenizer([train], vocab_size=300, out_dir=tok_dir)
    return {"dir": d, "train": train, "val": val, "tokenizer": tok_dir}


@pytest.fixture(scope="session")
def trained_run(corpus, tmp_path_factory) -> Path:
    """A Trainer output folder with checkpoint-20, checkpoint-40, checkpoint-60 and the final model."""
    out = tmp_path_factory.mktemp("runs") / "neo-2x32"
    return train_sweep.train([corpus["train"]], [corpus["val"]], corpus["tokenizer"], out, n_layer=2, width=32,
                             n_head=4, block_size=32, batch_size=8, max_steps=60, save_steps=20, seed=0)


def run_cli(*args: str, ok: bool = True):
    """Run the ``ncanalyze`` CLI in-process; with ``ok`` assert it succeeded, else that it failed cleanly."""
    from click.testing import CliRunner
    from ncanalyze.cli.main import main

    result = CliRunner().invoke(main, [str(a) for a in args])
    if ok:
        assert result.exit_code == 0, result.output + repr(result.exception)
    else:
        assert result.exit_code != 0, result.output
        assert isinstance(result.exception, SystemExit), f"traceback instead of a clean error: {result.exception!r}"
        assert "Traceback" not in result.output
    return result


EXTRACT_OPTS = ("--max-train-tokens", 8192, "--max-val-tokens", 4096, "--batch-size", 8, "--samples-per-class", 4)


@pytest.fixture(scope="session")
def extracted_store(trained_run, corpus, tmp_path_factory) -> Path:
    """The store of ``ncanalyze extract`` over every checkpoint of ``trained_run`` (validation.txt found beside)."""
    store = tmp_path_factory.mktemp("stores") / "study.zarr"
    run_cli("extract", trained_run, "--dataset", corpus["train"], "--store", store, *EXTRACT_OPTS)
    return store


@pytest.fixture(scope="session")
def kept_store(trained_run, corpus, tmp_path_factory) -> Path:
    """A store with one finished checkpoint, which no failing command may change (see :func:`fails_cleanly`)."""
    store = tmp_path_factory.mktemp("kept") / "kept.zarr"
    run_cli("extract", trained_run / "checkpoint-20", "--dataset", corpus["train"], "--store", store,
            "--max-train-tokens", 1024, "--max-val-tokens", 512, "--samples-per-class", 1)
    return store


def fails_cleanly(args, store: Path, words) -> str:
    """Run the CLI with ``args --store store``: it must fail with one ``Error:`` line holding every one of ``words``,
    leave every group of ``store`` identical and no resume state beside it. Returns the error line."""
    import ncanalyze.store

    before = ncanalyze.store.open(store).to_dict()
    r = run_cli(*args, "--store", store, ok=False)
    error = [line.split("Error:", 1)[1] for line in r.output.splitlines() if "Error:" in line]
    assert len(error) == 1 and all(str(w) in error[0] for w in words), r.output
    after = ncanalyze.store.open(store).to_dict()
    assert list(after) == list(before)
    for g, node in before.items():
        assert node.identical(after[g]), g
    assert not store.with_name(store.name + ".partial").exists()
    return error[0]


def assert_same_group(a: Path, b: Path, group: str) -> None:
    """``group`` of stores ``a`` and ``b``: the same variables, bit for bit, and the same attributes."""
    import ncanalyze.store
    import numpy as np

    da, db = (ncanalyze.store.open(s)[group].to_dataset() for s in (a, b))
    assert set(da.variables) == set(db.variables)
    for name in da.variables:  # the classifier, stored once per checkpoint, is a coordinate
        np.testing.assert_array_equal(da[name].values, db[name].values, err_msg=name)  # bit for bit
    assert dict(da.attrs) == dict(db.attrs)


def lone_model(trained_run: Path, dest: Path) -> Path:
    """A copy of ``trained_run``'s last checkpoint at ``dest``, with the run's tokenizer beside its weights."""
    shutil.copytree(trained_run / "checkpoint-60", dest)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(trained_run / f, dest / f)
    return dest


CLI = [sys.executable, "-c", "from ncanalyze.cli.main import main; main()"]


def kill_when(args, state: Path, batches: int = 5, at: dict[str, int] | None = None) -> None:
    """Run the CLI with ``args`` in a process and SIGKILL it once its resume state ``state`` holds ``batches`` batches
    and the values ``at`` (e.g. {"phase": 1}): a real crash at a known point."""
    import numpy as np

    proc = subprocess.Popen(CLI + [str(a) for a in args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with np.load(state) as s:
                if int(s["batches"]) >= batches and all(int(s[k]) == v for k, v in (at or {}).items()):
                    break
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.02)
    assert proc.poll() is None, "the run finished before it could be killed"
    proc.kill()
    proc.wait()


@contextlib.contextmanager
def tmpfs(path: Path, options: str):
    """A real small (or read-only) file system mounted at ``path`` for the test; skips where mounting needs root."""
    path.mkdir(exist_ok=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)])
