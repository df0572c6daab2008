"""Many checkpoints: the local paths (local), Hub suites (hub), a Dask cluster (cluster), shards, the extraction's
result, and the Trainer callback (training, training_ddp). The top floor of ``store``: it may import everything below."""
