"""Starting and watching the ranks of a distributed run: `pl.distributed.launch` (torchrun's agent
in this process, each rank's error and place when one fails) and each rank's heartbeat and
current action, readable by the launcher (`progress.py`)."""
