"""The marker prl's weight-transfer engine puts in every refusal raised before a tensor is touched
(vLLM answers any worker error with the same 500; the client tells the two kinds apart by it)."""

REJECTED = "prl-weights-rejected"
