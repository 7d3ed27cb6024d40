"""vLLM as prl's inference backend: the launcher (`launch`), the orchestrator's client (`client`),
the weight-transfer engine plugin (`plugin`) and the all-routes bearer check (`auth`)."""
