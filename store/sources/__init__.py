"""Where checkpoints come from: local folders and runs (discover), Hub revisions (revisions, hub_fetch), loading a
model and its tokenizer (load), its weights' fingerprint (fingerprint), sharded FSDP and DeepSpeed weights (sharded),
PEFT adapters (adapters, adapter_bounds) and a model's anatomy, its layers, blocks and sublayers (anatomy). Imports
only ``ncanalyze.store`` itself, the analyzer and ``ncanalyze.core``.
"""
