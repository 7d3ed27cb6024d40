"""The orchestrator: rollout scheduling, staleness control, advantages, packing, weight relay."""
