"""The runtime: the local and distributed engines, the loop over a device's actions, transports,
processes, clocks, observed memory, checkpoints.  Imports prediction, the model side, the schedule
IR and `pipelab.common`; never the pictures or the course."""
