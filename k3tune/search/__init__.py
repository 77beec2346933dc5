"""Search: the sweep driver, optuna samplers, the worker pool and the measurement backends."""
