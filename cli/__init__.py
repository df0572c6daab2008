"""ncanalyze command line: ``ncanalyze extract | measure | report``."""
from ncanalyze.core.errors import refuse_a_shadowing_clone

refuse_a_shadowing_clone()
