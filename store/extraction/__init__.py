"""One checkpoint's extraction: its settings (config), plan and memory, running state, passes, loss, layers and
reservoir, the estimate, and the one checkpoint written into the store (checkpoint). Imports only ``store`` itself,
``store.sources``, ``store.data`` and the analyzer."""
