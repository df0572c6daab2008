"""ncanalyze: neural collapse in causal language models, measured post hoc over training checkpoints.

The code lives in ``ncanalyze.core`` (the ground floor: errors, names, the settings mechanism, the thread policy),
``ncanalyze.analyzer`` (the maths), ``ncanalyze.store`` (checkpoints in, the Zarr store out) and ``ncanalyze.cli``
(the commands), mapped from the repository's top-level folders in setup.cfg; this folder holds the package itself
and ``training`` (the public path of the Trainer callback, ``from ncanalyze.training import
NeuralCollapseCallback``). Importing it (or any of its subpackages) registers the xarray accessor ``nc``
(``ncanalyze.analyzer.accessor``): at once when xarray is already loaded, else the moment xarray is, so that the
command line (``ncanalyze --help``) never loads xarray for nothing.
"""
from __future__ import annotations

import importlib.util
import sys
from importlib import import_module
from importlib.abc import MetaPathFinder
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("ncanalyze")  # from the installed metadata: nothing heavy is imported for it
except PackageNotFoundError:
    __version__ = "0+unknown"

ACCESSOR = "ncanalyze.analyzer.accessor"


class _AfterXarray(MetaPathFinder):
    """Finds ``xarray`` as the other finders do, and registers the accessor once its module has run. It stays on
    ``sys.meta_path`` until then: a library that only probes for xarray (``importlib.util.find_spec("xarray")``, as
    transformers and peft do) imports nothing, and the import that follows must still register the accessor."""

    def find_spec(self, name, path=None, target=None):
        if name != "xarray":
            return None
        at = sys.meta_path.index(self)
        sys.meta_path.remove(self)  # the other finders, not this one again
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(at, self)
        if spec is not None and spec.loader is not None:
            run = spec.loader.exec_module

            def exec_module(module):
                if self in sys.meta_path:
                    sys.meta_path.remove(self)
                run(module)
                import_module(ACCESSOR)

            spec.loader.exec_module = exec_module
        return spec


if "xarray" in sys.modules:
    import_module(ACCESSOR)
elif not any(isinstance(f, _AfterXarray) for f in sys.meta_path):
    sys.meta_path.insert(0, _AfterXarray())
