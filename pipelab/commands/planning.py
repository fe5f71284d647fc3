"""Decide, then check: `pipelab plan` ranks every (dp, pp, tp) layout of a transformer on a cluster by predicted
step (`pl.plan`); `pipelab search` finds a schedule for a memory limit (`pl.search_schedule`) and sets it beside
the named ones.

    pipelab plan --sc21 145.6B                       # a row of Megatron-LM SC21 Table 1, its cluster and batch
    pipelab plan --layers 24 --hidden 2048 --heads 16 --devices 16 --per-node 8 --memory-gib 40 --batch 512
    pipelab plan --sc21 145.6B --sharding 0                # ZeRO 0..3 over dp are tried unless told otherwise
    pipelab search --stages 4 --microbatches 8 --forward 1 --backward 1 --weight 1 --memory-limit 6
"""

from __future__ import annotations

import argparse
import sys

from ..predict.costs import Costs
from ..predict.planner import plan as make_plan
from ..predict.schedule_search import search_schedule
from ..predict.sharding import ZERO_STAGES, check_sharding
from ..predict.transformer_memory import RECOMPUTE, SC21_CLUSTER, SC21_TABLE_1, SCHEDULES, TransformerSpec

DEFAULTS = {"layers": 24, "hidden": 2048, "heads": 16, "seq": 2048, "vocab": 51200, "devices": 8, "per_node": 8,
            "memory": 80 * 2**30, "inside": (5e-6, 300e9), "between": (10e-6, 25e9), "flops": 312e12, "batch": 512}


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def pair(text: str) -> tuple[float, float]:
    """"5e-6,300e9" -> (latency seconds, bandwidth bytes/s)."""
    try:
        latency, bandwidth = (float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected LATENCY,BANDWIDTH (seconds, bytes/s) like 5e-6,300e9; got {text!r}") from None
    return latency, bandwidth


def positive_ints(text: str) -> tuple[int, ...]:
    """"1,2,4" -> (1, 2, 4)."""
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive ints separated by commas, like 1,2,4; got {text!r}")
    return values


def zero_stages(text: str) -> tuple[int, ...]:
    """"0,1,3" -> (0, 1, 3): ZeRO stages over the data-parallel replicas."""
    try:
        return check_sharding(tuple(int(x) for x in text.split(",")))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ZeRO stages 0..3 separated by commas, like 0,1,3 (0: none, 1: "
                                         f"optimizer states, 2: + gradients, 3: + parameters, FSDP2); got {text!r}") \
            from None


def names(allowed: tuple[str, ...]):
    def parse(text: str) -> tuple[str, ...]:
        chosen = tuple(x.strip() for x in text.split(",") if x.strip())
        if not chosen or any(x not in allowed for x in chosen):
            raise argparse.ArgumentTypeError(f"choose from {','.join(allowed)}; got {text!r}")
        return chosen
    return parse


def add_plan_arguments(planner: argparse.ArgumentParser) -> None:
    planner.add_argument("--sc21", choices=[row[0] for row in SC21_TABLE_1], default=None,
                         help="a model, cluster and batch of Megatron-LM SC21 Table 1 (other options override them)")
    model = planner.add_argument_group("model (an analytic GPT-like transformer)")
    for name in ("layers", "hidden", "heads", "seq", "vocab"):
        model.add_argument(f"--{name}", type=positive, default=None, help=f"(default {DEFAULTS[name]})")
    cluster = planner.add_argument_group("cluster")
    cluster.add_argument("--devices", type=positive, default=None, help="devices in all (default 8)")
    cluster.add_argument("--per-node", type=positive, default=None, help="devices per node (default 8)")
    cluster.add_argument("--memory-gib", type=float, default=None, help="memory per device, GiB (default 80)")
    cluster.add_argument("--inside", type=pair, default=None,
                         help="link inside a node: LATENCY,BYTES_PER_S (default 5e-6,300e9)")
    cluster.add_argument("--between", type=pair, default=None,
                         help="link between nodes, per device (default 10e-6,25e9)")
    cluster.add_argument("--flops", type=float, default=None, help="peak FLOP/s per device (default 312e12)")
    cluster.add_argument("--achieved", type=float, default=0.5, help="fraction of the peak the multiplies reach")
    planner.add_argument("--batch", type=positive, default=None, help="global batch, sequences (default 512)")
    planner.add_argument("--micro-batches", type=positive_ints, default=(1, 2, 4, 8),
                         help="micro-batch sizes to try (default 1,2,4,8)")
    planner.add_argument("--schedules", type=names(SCHEDULES), default=SCHEDULES, help=",".join(SCHEDULES))
    planner.add_argument("--recompute", type=names(RECOMPUTE), default=RECOMPUTE, help=",".join(RECOMPUTE))
    planner.add_argument("--sharding", type=zero_stages, default=ZERO_STAGES,
                         help="ZeRO stages to try over dp (default 0,1,2,3; 0: no sharding, pl.plan's default)")
    planner.add_argument("--rows", type=positive, default=10, help="rows to print")
    planner.add_argument("--all-rows", action="store_true", help="every configuration, not the best per layout")


def plan_command(args: argparse.Namespace) -> int:
    """Print the ranked table; exit 0, 1 when nothing fits, 2 on a bad model or cluster."""
    value = dict(DEFAULTS)
    if args.sc21:
        _, layers, hidden, heads, _, _, gpus, batch = next(r for r in SC21_TABLE_1 if r[0] == args.sc21)
        value.update(layers=layers, hidden=hidden, heads=heads, devices=gpus, batch=batch,
                     per_node=SC21_CLUSTER["devices_per_node"], memory=SC21_CLUSTER["memory_bytes"],
                     inside=SC21_CLUSTER["inside"], between=SC21_CLUSTER["between"],
                     flops=SC21_CLUSTER["peak_flops_per_second"])
    given = {"layers": args.layers, "hidden": args.hidden, "heads": args.heads, "seq": args.seq, "vocab": args.vocab,
             "devices": args.devices, "per_node": args.per_node, "inside": args.inside, "between": args.between,
             "flops": args.flops, "batch": args.batch,
             "memory": None if args.memory_gib is None else args.memory_gib * 2**30}
    value.update({k: v for k, v in given.items() if v is not None})
    try:
        spec = TransformerSpec(value["layers"], value["hidden"], value["heads"], value["seq"], value["vocab"])
        found = make_plan(spec, value["devices"], value["per_node"], value["memory"], value["batch"], value["inside"],
                          value["between"], value["flops"], args.achieved, micro_batch_sizes=args.micro_batches,
                          schedules=args.schedules, recompute=args.recompute, sharding=args.sharding)
    except (ValueError, TypeError) as error:
        print(f"pipelab plan: {error}", file=sys.stderr)
        return 2
    size = f"{spec.parameters / 1e9:.1f}B" if spec.parameters >= 1e9 else f"{spec.parameters / 1e6:.0f}M"
    print(f"{size} parameters (L={spec.layers}, h={spec.hidden}, a={spec.heads}, s={spec.seq}, "
          f"V={spec.vocab}) on {value['devices']} devices, {value['per_node']} per node; global batch {value['batch']}")
    print(found.table(n_rows=args.rows, per_layout=not args.all_rows))
    return 0 if found.rows else 1


def add_search_arguments(search: argparse.ArgumentParser) -> None:
    search.add_argument("--stages", type=positive, default=4)
    search.add_argument("--microbatches", type=positive, default=8)
    search.add_argument("--forward", type=float, default=1.0, help="seconds of a forward (F) per stage")
    search.add_argument("--backward", type=float, default=1.0, help="seconds of the input gradient (I) per stage")
    search.add_argument("--weight", type=float, default=1.0,
                        help="seconds of the weight gradient (W) per stage; 0: whole backwards (B)")
    search.add_argument("--latency", type=float, default=0.0, help="seconds per message between stages")
    search.add_argument("--memory-limit", type=float, default=None,
                        help="micro-batches a device may hold at once (default: no limit)")
    search.add_argument("--chunks", type=positive_ints, default=(1,), help="stages per device to try, e.g. 1,2")


def search_command(args: argparse.Namespace) -> int:
    """Print the found schedule's table, its makespan and memory, and the named schedules' beside it."""
    try:
        costs = Costs(forward=args.forward, backward=args.backward, weight=args.weight, latency=args.latency)
        found = search_schedule(args.stages, args.microbatches, costs, args.memory_limit, n_chunks=args.chunks)
    except (ValueError, TypeError) as error:
        print(f"pipelab search: {error}", file=sys.stderr)
        return 2
    meta = found.meta
    limit = "no memory limit" if args.memory_limit is None else f"at most {args.memory_limit:g} micro-batches a device"
    print(f"p={args.stages}, m={args.microbatches}, t_F={args.forward:g}, t_B={args.backward:g}, "
          f"t_W={args.weight:g}, latency {args.latency:g}; {limit}")
    print(found.to_text())
    print(f"found by {meta['found_by']}{' (proven optimal)' if meta.get('optimal') else ''}: makespan "
          f"{meta['makespan']:g}, peak memory per device {meta['peak_memory']}")
    for name, makespan in meta["candidates"].items():
        print(f"  {name:<24} {'does not fit the limit' if makespan is None else f'makespan {makespan:g}'}")
    return 0
