"""Model-level code: tiny configs, building models from a run's model folder, weight files."""
