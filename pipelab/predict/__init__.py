"""Prediction: the cost model (`Costs`, profiled from the engine's own stage work), `simulate` (a
schedule on virtual clocks), the memory rules, and the closed forms of communication and hybrid
layouts.  Imports the schedule IR, the model side and `pipelab.common`; never the runtime."""
