"""Launching: the process plan, local process supervision, and the `prl run` driver."""
