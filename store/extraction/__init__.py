"""One checkpoint's extraction: its settings (settings) and configuration record (config), the checkpoint resolved
once (job), its sites (sites) and labels (labels), its plan and memory (layers, memory), the running state (running)
and its resume state on disk (resume), the passes (passes) and the cores a train batch's updates run on (workers),
the model's own loss (loss), the reservoir (reservoir), the estimate and the time left (estimate, progress), the
group's attributes (attributes), and the one checkpoint written into the store (checkpoint). Imports only ``store``
itself, ``store.sources``, ``store.data``, the analyzer and ``ncanalyze.core``.
"""
