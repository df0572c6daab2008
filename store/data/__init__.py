"""Data as token blocks: every form of SPEC section 2 (blocks), the token cache beside the store (token_cache),
data identified by its content (identity) and the train split's label counts (split_counts). Imports only ``store``
itself, ``store.sources``, the analyzer and ``ncanalyze.core``.
"""
