"""The model side: reference models, splitting a model into stages, micro-batches, the
single-device reference, and what one stage computes on one micro-batch (forward, backward,
split backward, checkpointing, fused accumulation, tensor-parallel plans).  Knows nothing of
schedules: imports only `pipelab.common`."""
