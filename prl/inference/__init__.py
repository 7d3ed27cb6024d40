"""Inference: the embedded engine core, its thread loop, and its HTTP server (vLLM comes as a backend)."""
