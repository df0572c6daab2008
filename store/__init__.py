"""Checkpoint discovery, extraction of exact per-class statistics, and the Zarr store."""
