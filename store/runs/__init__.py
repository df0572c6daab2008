"""Many checkpoints: a command's paths dispatched (dispatch), the local paths (local), Hub suites (hub), a Dask
cluster (cluster), one checkpoint's train pass in shards (shards), and the Trainer callback (callback; callback_ddp
under DDP; cost, what it costs against training). The top floor of ``store``: it may import everything below.
"""
