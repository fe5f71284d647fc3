"""What every layer uses: the error types, checks of counts, timing on one intra-op thread, a paused
garbage collector.  The bottom of the package: imports nothing from pipelab."""
