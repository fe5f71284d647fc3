"""The runtime: one step driver (`driver.py`) for the local and distributed engines (`local.py`,
`distributed.py`, thin façades over `options.py` and a placement), the loop over a device's
actions (`loop.py`), transports, clocks, observed memory, one trace builder; `launcher/` starts
and watches ranks, `checkpoints/` saves and loads them.  Imports prediction, the model side, the
schedule IR and `pipelab.common`; never the pictures or the course."""
