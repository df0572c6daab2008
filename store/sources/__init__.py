"""Where checkpoints come from: local folders and runs (discover), Hub revisions (revisions), and loading a model and
its tokenizer (load). Imports only ``ncanalyze.store`` itself and the analyzer."""
