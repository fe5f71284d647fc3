"""PP, DP and TP across two hosts joined by one link, at 1 Gbit/s and at 100 Mbit/s: step time, bytes on
the link, and `pl.hybrid_costs.predict` with the link as measured.

    sudo .venv/bin/python benchmarks/slow_link.py [--steps 3]      (root: it makes two network namespaces)

The source text's first advantage of pipeline parallelism: it sends only the activations at a few
stage boundaries, so it needs far less bandwidth than data parallelism (every gradient, every step)
or tensor parallelism (an all-reduce inside every pair of layers).  Here that is measured in time.

The two hosts are `tests/two_hosts.py`'s: two network namespaces, one veth pair, a token bucket
(`tc ... tbf`) on both ends for the rate.  One rank runs on each host (MASTER_ADDR = host A's
address, GLOO_SOCKET_IFNAME = the veth, twice), started as `python benchmarks/slow_link.py
--rank-entry ...`.  On the ranks, for each rate:

- the link, measured: its bandwidth (a one-way `dist.send` of a quarter second's worth of bytes, both
  ways, best of two) and its latency (half the median time of a one-element all-reduce);
- the model, measured on one rank: forward and backward of one micro-batch through the whole model;
- each layout (PP = Layout(dp=1, pp=2, tp=1), DP = (2, 1, 1), TP = (1, 1, 2)), the same model and the
  same global batch, 1F1B with micro-batches of the same size: a warm-up step, then `--steps` steps,
  each timed from a barrier to the slower rank's return (median), and the bytes that crossed the veth
  (its tx + rx counters, headers included) per step.

Three runs, in this order: the veth at full speed (no token bucket: the base of the second prediction
below), 1 Gbit/s, 100 Mbit/s.

The prediction is `predict(layout, ModelCosts(...), {every dimension: Link(latency, bandwidth)}, m)`
with the model's and the link's measured figures (hybrid_costs.py: compute divided by p·t, a message
of A/t per boundary, 2 all-reduces of A per "layer" forward and 2 backward, one ring all-reduce of
Ψ/(p·t) after the drain).  An MLP block pair is Megatron's column + row Linear, one all-reduce each
way, so `n_layers` = depth / 4 (two pairs make a "layer" of two all-reduces).  A second prediction,
"full speed + link": the layout's step measured on the full-speed veth plus what `predict` says the
slower link adds (`predicted_from_full_speed`).  It tests the link model alone: TP's step on a fast link is
about 2.5x `predict`'s compute (DTensor's work on each of its 96 calls, the two ranks waiting for each
other on two shared cores), which the first prediction leaves out on purpose.

The model, an MLP (depth 48, width 512, 12.6 M parameters = 50.4 MB, batch 512, m = 2 micro-batches
of 256; `pipelab.course.applications.TWO_HOSTS_*`, which lesson 13 predicts): the boundary is what
pipeline parallelism sends, the parameters are what data parallelism sends, and every pair of layers is
what tensor parallelism sends.  Few, large all-reduces: each of TP's calls costs milliseconds on a CPU
besides its bytes, and with 1024 small ones (an earlier 128 × 256 model) the calls, not the link, set TP's
step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEPTH, WIDTH, BATCH, MICROBATCHES = 48, 512, 512, 2  # = applications.TWO_HOSTS_* (a test checks)
RATES = {"full": None, "1gbit": 1e9, "100mbit": 1e8}  # None: no token bucket, the veth at full speed (run first)
FULL_SPEED_SIZING = 2e9  # bits per second that size the bandwidth probe where the link has no rate
LAYOUTS = {"PP": (1, 2, 1), "DP": (2, 1, 1), "TP": (1, 1, 2)}  # (dp, pp, tp)


def make_model():
    import pipelab as pl

    return pl.models.mlp(depth=DEPTH, width=WIDTH, seed=0)


# ------------------------------------------------------------------------------------------ on each rank
def link_bytes(interface: str) -> int:
    """Bytes through this host's end of the veth, both directions (the namespace's own /sys)."""
    stats = Path("/sys/class/net") / interface / "statistics"
    return int((stats / "tx_bytes").read_text()) + int((stats / "rx_bytes").read_text())


def measure_link(nominal_bits_per_second: float) -> dict:
    """Bandwidth: one-way sends of a quarter second's worth, both ways, best of two; latency: half a tiny all-reduce."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    payload = torch.zeros(int((nominal_bits_per_second or FULL_SPEED_SIZING) / 8 * 0.25) // 4)
    ack = torch.zeros(1)
    rates = []
    for sender in (0, 1, 0, 1):
        dist.barrier()
        begin = time.perf_counter()
        if rank == sender:
            dist.send(payload, 1 - sender)
            dist.recv(ack, 1 - sender)
        else:
            dist.recv(payload, sender)
            dist.send(ack, sender)
        rates.append(payload.numel() * 4 / (time.perf_counter() - begin))
    tiny, times = torch.zeros(1), []
    for _ in range(40):
        begin = time.perf_counter()
        dist.all_reduce(tiny)
        times.append(time.perf_counter() - begin)
    return {"bandwidth": max(rates), "latency": statistics.median(times[10:]) / 2}


def measure_model() -> dict:
    """Forward and backward seconds of one micro-batch through the whole model, on one thread (median of 5)."""
    import pipelab as pl

    model = make_model()
    x, y = pl.models.sample_batch(model, BATCH // MICROBATCHES, seed=1)
    loss_fn = pl.models.default_loss(model)
    forward, backward = [], []
    for _ in range(7):
        begin = time.perf_counter()
        loss = loss_fn(model(x), y)
        middle = time.perf_counter()
        loss.backward()
        forward.append(middle - begin)
        backward.append(time.perf_counter() - middle)
    parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"forward_seconds": statistics.median(forward[2:]), "backward_seconds": statistics.median(backward[2:]),
            "activation_bytes": x.numel() * x.element_size(), "parameter_bytes": parameter_bytes}


def rank_entry(args) -> None:
    """One rank of one rate's run (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE in the environment)."""
    import torch
    import torch.distributed as dist

    import pipelab as pl

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    found = {"link": measure_link(RATES[args.rate]), "model": measure_model(), "layouts": {}}
    for name, shape in LAYOUTS.items():
        layout = pl.Layout(*shape)
        model = make_model()
        x, y = pl.models.sample_batch(model, BATCH, seed=1)
        pipe = pl.DistributedPipeline(model, n_microbatches=MICROBATCHES // layout.dp, schedule="1f1b",
                                      loss_fn=pl.models.default_loss(model), layout=layout)
        pipe.step(x, y)  # warm-up: lazy initialisation, shape headers
        times, before = [], link_bytes(args.interface)
        for _ in range(args.steps):
            for p in pipe.parameters():
                p.grad = None
            dist.barrier()
            begin = time.perf_counter()
            pipe.step(x, y)
            took = torch.tensor([time.perf_counter() - begin], dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            times.append(took.item())
        found["layouts"][name] = {"step_seconds": times,
                                  "link_bytes_per_step": (link_bytes(args.interface) - before) / args.steps}
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(found))
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------ the caller
def run_rate(hosts, rate: str, port: int, steps: int, folder: Path) -> dict:
    """Both ranks of one rate's run, one per host; their figures (rank 0's JSON)."""
    if RATES[rate] is not None:
        hosts.limit(rate)
    out = folder / f"{rate}.json"
    runs = []
    for rank, side in enumerate("ab"):
        interface = hosts.interface[side]
        env = {"MASTER_ADDR": "10.213.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": "2",
               "GLOO_SOCKET_IFNAME": f"{interface},{interface}", "OMP_NUM_THREADS": "1"}
        command = (f"{sys.executable} {Path(__file__).resolve()} --rank-entry --rate {rate} --steps {steps} "
                   f"--interface {interface} --out {out}")
        runs.append(hosts.start(side, command, cwd=ROOT, log=folder / f"{rate}_{side}.log", env=env))
    codes = hosts.wait_all(runs, timeout_seconds=600)
    if codes != [0, 0]:
        logs = "\n".join((folder / f"{rate}_{side}.log").read_text()[-3000:] for side in "ab")
        raise RuntimeError(f"the ranks at {rate} ended with {codes}:\n{logs}")
    return json.loads(out.read_text())


def predicted(found: dict, name: str, model: dict | None = None) -> float:
    """`predict` of layout `name` with the link measured in `found` and the model measured there (or `model`)."""
    from pipelab.predict.hybrid_costs import Link, ModelCosts, predict
    from pipelab.predict.layout import Layout

    model = found["model"] if model is None else model
    costs = ModelCosts(model["forward_seconds"], model["backward_seconds"], model["activation_bytes"],
                       n_layers=DEPTH // 4, parameter_bytes=model["parameter_bytes"])
    link = Link(found["link"]["latency"], found["link"]["bandwidth"])
    layout = Layout(*LAYOUTS[name])
    return predict(layout, costs, {"pp": link, "tp": link, "dp": link}, MICROBATCHES // layout.dp).step_seconds


def predicted_from_full_speed(by_rate: dict, name: str, rate: str) -> float:
    """The layout's step measured on the full-speed link, plus what `predict` says the slower link adds:
    predict(link at `rate`) - predict(link at full speed), both with the full-speed run's model figures.
    The step on a fast link carries what `predict` leaves out (TP: DTensor's work on every call, the
    two ranks waiting for each other on shared cores); the difference tests the link model alone."""
    full = by_rate["full"]
    base = statistics.median(full["layouts"][name]["step_seconds"])
    return base + predicted(by_rate[rate], name, full["model"]) - predicted(full, name)


def table(by_rate: dict) -> str:
    lines = []
    for rate, found in by_rate.items():
        link, model = found["link"], found["model"]
        lines.append(f"{rate}: link measured {link['bandwidth'] * 8 / 1e6:.0f} Mbit/s, latency "
                     f"{link['latency'] * 1e6:.0f} us; one micro-batch: F {model['forward_seconds'] * 1e3:.1f} ms, "
                     f"B {model['backward_seconds'] * 1e3:.1f} ms")
    header = (f"{'layout':6} {'link':>8} {'step ms':>9} {'MB on link/step':>16} {'predicted ms':>13} {'error':>7}"
              f" {'full speed + link':>18} {'error':>7}")
    lines += ["", header, "-" * len(header)]
    medians, errors = {}, {"predicted": [], "full speed + link": []}
    for name in LAYOUTS:
        for rate, found in by_rate.items():
            measured = statistics.median(found["layouts"][name]["step_seconds"])
            medians[name, rate] = measured
            guess = predicted(found, name)
            line = (f"{name:6} {rate:>8} {measured * 1e3:9.1f} "
                    f"{found['layouts'][name]['link_bytes_per_step'] / 1e6:16.2f} {guess * 1e3:13.1f} "
                    f"{(guess - measured) / measured:+7.0%}")
            if RATES[rate] is None:
                line += f" {'(its base)':>18} {'':>7}"
            else:
                errors["predicted"].append(abs(guess - measured) / measured)
                from_full = predicted_from_full_speed(by_rate, name, rate)
                errors["full speed + link"].append(abs(from_full - measured) / measured)
                line += f" {from_full * 1e3:18.1f} {(from_full - measured) / measured:+7.0%}"
            lines.append(line)
    lines.append("")
    ratios = {name: medians[name, "100mbit"] / medians[name, "1gbit"] for name in LAYOUTS}
    lines.append("step at 100 Mbit/s / step at 1 Gbit/s:  " + "   ".join(
        f"{name} {ratio:.2f}x" for name, ratio in ratios.items())
        + f"  (targets: PP within 1.3x: {'met' if ratios['PP'] <= 1.3 else 'NOT met'}; DP and TP several-fold)")
    for method, found in errors.items():
        lines.append(f"prediction within 20 % at 1 Gbit/s and 100 Mbit/s, {method}: largest error "
                     f"{max(found):.0%} ({'met' if max(found) <= 0.20 else 'NOT met'})")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per layout and rate (after one warm-up)")
    parser.add_argument("--rank-entry", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rate", default="1gbit", help=argparse.SUPPRESS)
    parser.add_argument("--interface", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_entry:
        rank_entry(args)
        return 0
    sys.path.insert(0, str(ROOT / "tests"))
    from two_hosts import TwoHosts, why_not

    reason = why_not()
    if reason is not None:
        print(f"slow_link: {reason}", file=sys.stderr)
        return 2
    import tempfile

    by_rate = {}
    with tempfile.TemporaryDirectory(prefix="slow_link-") as folder, TwoHosts() as hosts:
        for k, rate in enumerate(RATES):
            begin = time.monotonic()
            by_rate[rate] = run_rate(hosts, rate, 29510 + k, args.steps, Path(folder))
            print(f"{rate}: ran in {time.monotonic() - begin:.0f} s", file=sys.stderr)
    print(f"MLP depth {DEPTH}, width {WIDTH} ({by_rate['1gbit']['model']['parameter_bytes'] / 1e6:.1f} MB of "
          f"parameters), batch {BATCH}, 1F1B, micro-batches of {BATCH // MICROBATCHES}; one rank per host, gloo")
    print(table(by_rate))
    return 0


if __name__ == "__main__":
    sys.exit(main())
