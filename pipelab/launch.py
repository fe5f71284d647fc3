"""torchrun's entry point, as users type it: `torchrun --nproc-per-node 4 -m pipelab.launch ...` runs
`pipelab.commands.launch` (every flag of `pipelab run`, docs/distributed.md)."""

from .commands.launch import main

if __name__ == "__main__":
    raise SystemExit(main())
