"""ncanalyze command line: ``ncanalyze extract | measure | report``."""
