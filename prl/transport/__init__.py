"""Transports between processes: packed rollout batches (orchestrator -> trainer) and their wire format."""
