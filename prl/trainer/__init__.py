"""The trainer: torchrun entry, FSDP2 parallelization, losses, checkpoints and weight publishing."""
