"""The closed forms of every schedule: a step's makespan, bubble and activations, equal stages, free links.

p devices, m micro-batches, v model chunks per device (interleaved), and one micro-batch's seconds on
one stage: t_F (forward), t_B (backward: the whole backward, or its input-gradient half I where the
schedule splits it), t_W (the weight-gradient half W; only zero-bubble schedules run W, the others
ignore t_W as `simulate` does).  The bubble is the share of the step a device idles:
1 − m·(work of one micro-batch)/makespan.  Communication is left out (latency 0, infinite bandwidth).

    GPipe            makespan (m+p-1)(t_F+t_B)         bubble (p-1)/(m+p-1) of the step, (p-1)/m of the
                                                        ideal time m(t_F+t_B): p-1 steps to fill, p-1 to drain
                     Huang et al. 2019, "GPipe", §2.3; Narayanan et al. 2021 (Megatron-LM, SC21) §2.2.1
    1F1B             the same: 1F1B reorders each device's work (memory min(p-s, m) on stage s), the
                     fill and the drain stay.  Narayanan et al. 2021 (SC21) §2.2.1 (PipeDream-Flush);
                     PipeDream-2BW (Narayanan et al., ICML 2021) §3.2
    PipeDream async  the same for one run of m minibatches: PipeDream's 1F1B order fills and drains
                     like 1F1B's.  Narayanan et al. 2019, "PipeDream" (SOSP), §3.2
    interleaved      makespan (vm+p-1)(t_F+t_B), t_F, t_B of one chunk (1/v of a stage): the fill
                     steps are 1/v as long.  Bubble (p-1)/(vm+p-1) of the step, (p-1)/(v·m) of the
                     ideal time; m a multiple of p.  Narayanan et al. 2021 (SC21) §2.2.2
    ZB-H1            makespan m(t_F+t_B+t_W) + (p-1)(t_F+t_B-t_W): the W's nobody waits for fill
                     2(p-1)t_W of 1F1B's (p-1)(t_F+t_B+t_W) idle time, memory as 1F1B's.
                     Qi et al. 2024, "Zero Bubble Pipeline Parallelism" (ICLR 2024), Table 2.
                     Exact for m >= p and t_W <= t_F, t_B (the paper's t_F ≈ t_B ≈ t_W); elsewhere a
                     lower bound on the makespan: the W's no longer fit the gaps.

Peak activations (`microbatches_in_flight`), in whole-stage micro-batches: GPipe m on every stage;
1F1B and ZB-H1 min(p-s, m) on stage s (ZB-H1 keeps a micro-batch until its W; DeepSpeed's
`num_pipe_buffers`); interleaved, in chunk-micro-batches of 1/v of a stage, Megatron's warm-up
2(p-r-1) + (v-1)p plus one: min(vp + p - 1, v·m) on device 0, min((v-1)p + 1, v·m) on device p-1
(Megatron-LM `schedules.py`; CURRICULUM.md).

Every form is checked against `simulate` (an independent interpreter: the dependency loop on virtual
clocks) in tests/test_closed_forms.py and tests/test_planner.py.  The explorer (`show/widgets.py`),
`pipelab simulate` and the planner (`pipeline_seconds`, `microbatches_in_flight`) read them from here.
"""

from __future__ import annotations

from dataclasses import dataclass

from .costs import Costs

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "pipedream-async")
"""The schedules with a closed form (the explorer's menu)."""

_ALIASES = {"gpipe": "gpipe", "1f1b": "1f1b", "onefoneb": "1f1b", "pipedreamflush": "1f1b",
            "interleaved": "interleaved-1f1b", "interleaved1f1b": "interleaved-1f1b",
            "zbh1": "zb-h1", "zerobubbleh1": "zb-h1",
            "pipedreamasync": "pipedream-async", "pipedream": "pipedream-async"}

_SOURCES = {
    "gpipe": "Huang et al. 2019, GPipe §2.3; Megatron-LM SC21 §2.2.1",
    "1f1b": "Narayanan et al. 2021, Megatron-LM SC21 §2.2.1; PipeDream-2BW §3.2",
    "pipedream-async": "PipeDream's 1F1B order, Narayanan et al. 2019 §3.2: one run fills and drains as 1F1B",
    "interleaved-1f1b": "Narayanan et al. 2021, Megatron-LM SC21 §2.2.2",
    "zb-h1": "Qi et al. 2024, Zero Bubble Pipeline Parallelism, Table 2",
}


def schedule_key(name: str) -> str:
    """`name` as one of SCHEDULES ("interleaved" and "pipedream" included, case, "-" and "_" ignored)."""
    if not isinstance(name, str):
        raise TypeError(f"a schedule name must be a string like 'gpipe' or 'zb-h1', got {type(name).__name__}")
    key = _ALIASES.get(name.lower().replace("-", "").replace("_", ""))
    if key is None:
        raise ValueError(f"no closed form for schedule {name!r}; the schedules with one: {', '.join(SCHEDULES)}")
    return key


@dataclass(frozen=True)
class ClosedForm:
    """One schedule's closed form at (p, m, costs): the numbers, the formulas as text, the source.

    `exact`: the numbers are what `simulate` gives on these costs with free links.  Otherwise they
    hold only under `condition`, and outside it are lower bounds (`lower_bound`: ZB-H1's W's no
    longer fit the gaps) or describe no schedule (interleaved 1F1B needs m a multiple of p)."""

    schedule: str  # one of SCHEDULES
    makespan: float
    bubble_fraction: float  # of the step: idle / makespan
    makespan_text: str
    bubble_text: str
    source: str
    exact: bool = True
    condition: str = ""  # where the numbers are exact, in words ("": everywhere)
    lower_bound: bool = False  # outside `condition`, the makespan and the bubble are lower bounds

    @property
    def caveat(self) -> str:
        """"" when exact, else where the form holds and what its numbers are here."""
        if self.exact:
            return ""
        return f"exact only for {self.condition}" + ("; here a lower bound" if self.lower_bound else "")

    def describe(self) -> str:
        """One line: the makespan and the bubble, each as its formula and its value ("≥" for a lower bound)."""
        sign = "≥" if not self.exact and self.lower_bound else "="
        text = (f"makespan {sign} {self.makespan_text} = {self.makespan:.4g}, "
                f"bubble {sign} {self.bubble_text} = {self.bubble_fraction:.2%}")
        return text + (f" ({self.caveat})" if self.caveat else "")


def closed_form(schedule: str, n_stages: int, n_microbatches: int, costs: Costs | None = None,
                n_chunks: int = 1) -> ClosedForm:
    """The closed form of `schedule` for p = `n_stages` devices, m = `n_microbatches` and equal stages
    timed by `costs` (default t_F = 1, t_B = 2; its latency and bandwidth are left out).  Interleaved:
    `n_chunks` = v chunks per device, `costs` per chunk, as `simulate` takes them (module docstring)."""
    key = schedule_key(schedule)
    p, m = _positive("n_stages", n_stages), _positive("n_microbatches", n_microbatches)
    v = _positive("n_chunks", n_chunks)
    costs = Costs() if costs is None else costs
    if not isinstance(costs, Costs):
        raise TypeError(f"costs must be a pl.Costs, got {type(costs).__name__}")
    t_f, t_b, t_w = (_uniform(costs, name, p * (v if key == "interleaved-1f1b" else 1))
                     for name in ("forward", "backward", "weight"))
    source = _SOURCES[key]
    if key == "interleaved-1f1b":
        makespan = pipeline_seconds(key, p, m, v * t_f, v * t_b, 0.0, v)
        return ClosedForm(key, makespan, (p - 1) / (v * m + p - 1), "(vm+p-1)(t_F+t_B), t per chunk",
                          "(p-1)/(vm+p-1)", source, m % p == 0, "m a multiple of p")
    if key == "zb-h1":
        makespan = pipeline_seconds(key, p, m, t_f, t_b, t_w)
        idle = (p - 1) * (t_f + t_b - t_w)
        return ClosedForm(key, makespan, idle / makespan if makespan else 0.0, "m(t_F+t_B+t_W) + (p-1)(t_F+t_B-t_W)",
                          "(p-1)(t_F+t_B-t_W) / makespan", source, p == 1 or (m >= p and t_w <= min(t_f, t_b)),
                          "m ≥ p and t_W ≤ t_F, t_B", lower_bound=True)
    return ClosedForm(key, pipeline_seconds(key, p, m, t_f, t_b), (p - 1) / (m + p - 1), "(m+p-1)(t_F+t_B)",
                      "(p-1)/(m+p-1)", source)


def pipeline_seconds(schedule: str, n_stages: int, n_microbatches: int, forward: float, backward: float,
                     weight: float = 0.0, chunks: int = 1) -> float:
    """A step's pipeline part, every stage alike (forward, backward, weight: one micro-batch's T_F, T_B, T_W on
    one device, all its chunks together; T_B without T_W for "zb-h1", which needs m >= p and T_W <= T_F, T_B;
    the other schedules run T_B + T_W as one backward):

        gpipe, 1f1b   (m + p − 1)·(T_F + T_B)                  GPipe §2.3; SC21 §2.2.1
        interleaved   m·(T_F + T_B) + (p − 1)·(T_F + T_B)/v     SC21 §2.2.2
        zb-h1         m·(T_F + T_B + T_W) + (p − 1)·(T_F + T_B − T_W)   Zero Bubble PP, Table 2
    """
    key, p, m = schedule_key(schedule), n_stages, n_microbatches
    if key == "interleaved-1f1b":
        return (m + (p - 1) / chunks) * (forward + backward + weight)
    if key == "zb-h1":
        return m * (forward + backward + weight) + (p - 1) * (forward + backward - weight)
    return (m + p - 1) * (forward + backward + weight)  # gpipe, 1f1b, pipedream-async


def microbatches_in_flight(schedule: str, n_stages: int, n_microbatches: int, chunks: int = 1) -> tuple[float, float]:
    """(first stage, last stage): whole-stage micro-batches whose activations a device holds at its peak.

    GPipe m on every stage; 1F1B and ZB-H1 min(p − s, m) on stage s (ZB-H1 keeps a micro-batch until its W);
    interleaved, in chunk-micro-batches of 1/v of a stage, Megatron's warm-up plus one: min(v·p + p − 1, v·m)
    on device 0, min((v − 1)·p + 1, v·m) on device p − 1 (CURRICULUM.md; tested against `simulate`)."""
    key, p, m, v = schedule_key(schedule), n_stages, n_microbatches, chunks
    if key == "gpipe":
        return m, m
    if key == "interleaved-1f1b":
        return min(v * p + p - 1, v * m) / v, min((v - 1) * p + 1, v * m) / v
    return min(p, m), min(1, m)


def _positive(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def _uniform(costs: Costs, name: str, n_stages: int) -> float:
    """The one value of `costs.<name>` on every stage: a closed form assumes equal stages."""
    values = {costs.per_stage(name, s, n_stages) for s in range(n_stages)}
    if len(values) > 1:
        raise ValueError(f"a closed form assumes equal stages, but Costs.{name} differs per stage "
                         f"({getattr(costs, name)!r}): simulate such a schedule with pl.simulate instead")
    return values.pop()
