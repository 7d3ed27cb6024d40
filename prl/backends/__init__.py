"""Inference backends as the orchestrator, the trainer and the launcher see them: the client seam
(`base.InferenceBackend`), one spec per backend in the registry (`registry`), the embedded engine's
client (`embedded`) and vLLM (`vllm/`: launcher, client, weight-transfer plugin, auth). The embedded
engine's server side is `prl.inference`."""
