"""The ground floor: what every package shares. Imports no other ncanalyze package (``tests/test_architecture.py``);
imports go ``ncanalyze.cli`` -> ``ncanalyze.store`` -> ``ncanalyze.analyzer`` -> ``ncanalyze.core``.

- ``errors``: the exception types of bad input (``UserError``, ``CheckpointError``) and the clone check each
  subpackage makes on import;
- ``names``: the names of runs and checkpoints, checked, and shown safely;
- ``setting``: the settings mechanism (a setting is a dataclass field), the shared settings and the one device parser;
- ``threads``: the thread policy of torch's CPU kernels (``--threads auto|N``);
- ``sizes``: sizes in bytes written for people.
"""
from ncanalyze.core.errors import refuse_a_shadowing_clone

refuse_a_shadowing_clone()
