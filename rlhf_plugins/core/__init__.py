"""The plugin core: the manager (loading plugins, calling hooks), the component registry and the
per-process plugin spec."""
