"""ncanalyze command line: the console script (main), ``ncanalyze extract | measure | report | ls | rm`` (one module
each, named as its command), the options made from the settings registries (options) and what the commands share
(common).
"""
from ncanalyze.core.errors import refuse_a_shadowing_clone

refuse_a_shadowing_clone()
