"""Data as token blocks: every form of SPEC section 2 (blocks) and the token cache beside the store (tokens). Imports
only ``store`` itself, ``store.sources`` and the analyzer."""
