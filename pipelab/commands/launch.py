"""`python -m pipelab.launch`: the torchrun entry point, one process per pipeline stage.

    torchrun --nproc-per-node 2 -m pipelab.launch --model mlp --stages 2 --microbatches 8 --schedule 1f1b --steps 20

The flags are those of `pipelab run`.  torchrun sets RANK, WORLD_SIZE, LOCAL_RANK and the
rendezvous; this joins the process group (NCCL when the ranks use GPUs, else gloo), trains,
and rank 0 prints the report and writes the timeline, the Chrome trace and (with --json) the
figures.  A rank that raises is recorded for torchrun (`@record`), which then stops the others;
a rank that loses a rank on another machine (a pulled cable, a dead host) names that machine.
Each rank dies with torchrun's agent (its parent), even an agent killed with SIGKILL, and
Ctrl-C ends a rank at once, without a traceback.

Two machines (GLOO_SOCKET_IFNAME, twice), the timeout and the loopback connections:
docs/distributed.md, "torchrun".
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from ..common.errors import LostRankError
from ..runtime.p2p import use_two_connections
from ..runtime.launcher.processes import end_with_parent
from .run_report import finish
from .training import add_run_arguments, train_rank


@record
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="torchrun ... -m pipelab.launch",
                                     description="One pipeline stage per process (run it under torchrun).")
    add_run_arguments(parser)
    args = parser.parse_args(argv)
    if "RANK" not in os.environ:
        parser.error("start this under torchrun (it sets RANK and WORLD_SIZE), e.g. "
                     "torchrun --nproc-per-node 2 -m pipelab.launch --stages 2; or use "
                     "pipelab run --backend distributed --nproc 2")
    end_with_parent()  # the agent's death (even by SIGKILL) ends this rank
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C ends it at once, even inside a wait; torchrun reports it
    use_cuda = args.device.startswith("cuda") or (args.device == "auto" and torch.cuda.is_available())
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        args.device = "auto"  # cuda:LOCAL_RANK
    elif os.environ.get("LOCAL_WORLD_SIZE") == os.environ.get("WORLD_SIZE"):  # every rank on this machine
        use_two_connections()  # activations and gradients on separate gloo connections (runtime/p2p.py)
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timedelta(seconds=args.timeout_seconds))
    hosts: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())  # which machine each rank runs on, to name a lost one
    try:
        summary = train_rank(args)
        if dist.get_rank() == 0:
            finish(summary, args)
    except LostRankError as error:
        lost = error.lost_rank
        if lost is None or hosts[lost] == hosts[dist.get_rank()]:
            raise
        raise LostRankError(f"lost host {hosts[lost]} (rank {lost}): {error}", lost) from error
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
