"""Lesson 13's functions (pipelab/course/applications.py) beside what they are built on: the memory rule,
plain training, the forward-only schedule's closed forms, the engine's generation and the two-hosts
prediction that benchmarks/slow_link.py prints (docs/two_hosts.md)."""

import copy
import importlib.util
import math
from pathlib import Path

import matplotlib.pyplot as plt
import pytest
import torch
from torch import nn

import pipelab as pl
import pipelab.course.applications as app
from pipelab.common.threads import intra_op_threads
from pipelab.predict.hybrid_costs import Link, predict

ROOT = Path(__file__).resolve().parents[1]


def test_state_by_depth_shares_model_state_and_keeps_stage_0s_activations_under_1f1b():
    model = pl.models.mlp(depth=8, width=32, seed=0)
    x, y = pl.models.sample_batch(model, 8)
    by_depth = app.state_by_depth(model, (1, 2, 4, 8), n_microbatches=8, sample=(x, y), loss_fn=nn.MSELoss())
    whole = sum(p.numel() * 4 for p in model.parameters())
    for p, needs in by_depth.items():
        assert len(needs) == p
        assert sum(n.parameter_bytes for n in needs) == sum(n.gradient_bytes for n in needs) == whole
        assert all(n.optimizer_bytes == 2 * n.parameter_bytes for n in needs)  # Adam: two fp32 moments
        assert all(n.activation_bytes > 0 for n in needs)
    states = [app.fullest(needs).model_state_bytes for needs in by_depth.values()]
    assert states == sorted(states, reverse=True) and states[0] / states[-1] > 6  # about 1/p
    # 1F1B: stage 0 keeps min(p, m) micro-batches of 1/p of the model's activations: about one device's
    stage_0 = [needs[0].activation_bytes for needs in by_depth.values()]
    assert max(stage_0) / min(stage_0) < 1.5
    assert all(p.grad is None for p in model.parameters())


def test_a_model_on_the_meta_device_counts_sixteen_bytes_a_parameter_under_mixed_adam():
    with torch.device("meta"):
        gpt = pl.models.tiny_gpt(n_layers=4, d_model=64, n_heads=4, vocab_size=128, seq_len=16)
    gpt = gpt.to(torch.bfloat16)
    n = sum(p.numel() for p in gpt.parameters())
    by_depth = app.state_by_depth(gpt, (1, 2, 3), n_microbatches=4, optimizer="mixed-adam")
    assert by_depth[1][0].total_bytes == 16 * n and by_depth[1][0].activation_bytes is None
    assert sum(need.total_bytes for need in by_depth[2]) == 16 * n
    assert app.fewest_stages(by_depth, 16 * n) == 1
    assert app.fewest_stages(by_depth, 16 * n - 1) == 2
    assert app.fewest_stages(by_depth, app.fullest(by_depth[3]).total_bytes) == 3
    assert app.fewest_stages(by_depth, 1) is None


def test_plain_losses_are_a_plain_loop_and_the_pipeline_matches_them():
    model = pl.models.mlp(depth=4, width=16, seed=0)
    x, _ = pl.models.sample_batch(model, 32)
    y = pl.models.mlp(depth=4, width=16, seed=1)(x).detach()
    by_hand, copy = pl.models.mlp(depth=4, width=16, seed=0), pl.models.mlp(depth=4, width=16, seed=0)
    sgd = torch.optim.SGD(by_hand.parameters(), lr=0.5)
    expected = []
    with intra_op_threads(1):  # as plain_losses runs: the same reductions, the same bits
        for _ in range(4):
            loss = nn.MSELoss()(by_hand(x), y)
            loss.backward()
            sgd.step()
            sgd.zero_grad()
            expected.append(loss.item())
    found = app.plain_losses(copy, x, y, 4, lambda params: torch.optim.SGD(params, lr=0.5))
    assert found == expected and all(isinstance(v, float) for v in found)
    assert all(torch.equal(a, b) for a, b in zip(copy.parameters(), by_hand.parameters()))
    pipe = pl.Pipeline(model, n_stages=2, n_microbatches=4, loss_fn=nn.MSELoss(), devices="cpu")
    sgd = torch.optim.SGD(pipe.parameters(), lr=0.5)
    piped = []
    for _ in range(4):
        piped.append(pipe.step(x, y).loss)
        sgd.step()
        sgd.zero_grad(set_to_none=True)
    assert piped == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("p,t", [(1, 1.0), (4, 0.01), (3, 2.5)])
def test_inference_points_are_the_closed_forms(p, t):
    ms = (1, 2, 5, 16)
    for point, m in zip(app.inference_points(p, t, ms), ms):
        assert point.n_microbatches == m
        assert point.service_seconds == pytest.approx(p * t)
        assert point.latencies == pytest.approx([(i + p) * t for i in range(m)])  # waiting included
        assert point.one_device_latencies == pytest.approx([(i + 1) * p * t for i in range(m)])
        assert point.last_latency_seconds == pytest.approx((m + p - 1) * t) == pytest.approx(point.step_seconds)
        assert point.throughput == pytest.approx(m / ((m + p - 1) * t))


def test_latency_counts_the_wait_and_service_time_does_not():
    """Of 16 requests that arrive together on 4 stages of 10 ms, the last is answered at 190 ms (640 ms on one
    device) though each spends 40 ms inside: a helper that returned the service time would give 40."""
    point = app.inference_points(4, 0.010, (16,))[0]
    assert point.service_seconds == pytest.approx(0.040)
    assert point.last_latency_seconds == pytest.approx(0.190) and point.one_device_latencies[-1] == pytest.approx(0.640)
    assert point.latencies[0] == pytest.approx(point.service_seconds)  # the first waits for nothing
    assert all(b - a == pytest.approx(0.010) for a, b in zip(point.latencies, point.latencies[1:]))


@pytest.mark.parametrize("p,m,t,link", [(4, 16, 0.010, 0.002), (3, 5, 1.0, 0.5), (2, 1, 0.2, 0.3)])
def test_a_slow_link_adds_p_minus_1_link_times_to_service_and_latency(p, m, t, link):
    point = app.inference_points(p, t, (m,), link_seconds=link)[0]
    assert point.service_seconds == pytest.approx(p * t + (p - 1) * link)
    assert point.latencies == pytest.approx([(i + p) * t + (p - 1) * link for i in range(m)])
    assert point.one_device_latencies == pytest.approx([(i + 1) * p * t for i in range(m)])  # no link to cross


def test_exit_times_are_when_each_microbatch_leaves_the_last_stage_from_the_steps_start():
    trace = pl.simulate(pl.schedules.inference(3, 4), pl.Costs(forward=[1.0, 2.0, 1.0]))
    # stage 1 is the slow one: micro-batch i leaves it at 1 + 2·(i + 1), then the last stage takes 1
    assert app.exit_times(trace) == pytest.approx([4.0, 6.0, 8.0, 10.0])
    assert app.exit_times(trace) != pytest.approx(trace.latencies)  # not the time inside: [4, 5, 6, 7]
    assert trace.latencies == pytest.approx([4.0, 5.0, 6.0, 7.0])
    shifted = trace.__class__(**{**trace.__dict__, "events": [e._replace(start=e.start + 5, end=e.end + 5)
                                                               for e in trace.events]})
    assert app.exit_times(shifted) == pytest.approx(app.exit_times(trace))  # counted from the step's start


def test_greedy_text_is_what_the_pipeline_generates_and_leaves_the_prompts_alone():
    gpt = pl.models.tiny_gpt(n_layers=4, d_model=32, n_heads=4, vocab_size=64, seq_len=16, seed=0).eval()
    prompts = torch.randint(0, 64, (4, 5), generator=torch.Generator().manual_seed(0))
    kept, threads = prompts.clone(), torch.get_num_threads()
    text = app.greedy_text(gpt, prompts, 6)
    assert torch.get_num_threads() == threads  # one thread inside, the caller's setting after
    assert text.shape == (4, 11) and torch.equal(text[:, :5], prompts) and torch.equal(prompts, kept)
    pipe = pl.Pipeline(gpt, n_stages=2, n_microbatches=2, loss_fn=pl.models.default_loss(gpt), devices="cpu")
    assert torch.equal(pipe.generate(prompts, 6).tokens, text)


def _frozen_gpt_pipelines(microbatch_counts):
    gpt = pl.models.tiny_gpt(n_layers=2, d_model=32, n_heads=2, vocab_size=64, seq_len=16, seed=0)
    pipes = {m: pl.Pipeline(gpt, n_stages=3, n_microbatches=m, loss_fn=pl.models.lm_loss, devices="cpu")
             for m in microbatch_counts}
    pipes[microbatch_counts[0]].partition.stages[0].requires_grad_(False)  # the same modules in every pipeline
    x, y = pl.models.sample_batch(gpt, 8)
    return gpt, pipes, x, y


def test_side_by_side_runs_the_same_steps_in_turn_and_one_microbatch_keeps_one_stage_at_work():
    gpt, pipes, x, y = _frozen_gpt_pipelines((1, 4))
    before = [p.detach().clone() for p in gpt.parameters()]
    found = app.side_by_side({"naive, m = 1": pipes[1], "pipeline, m = 4": pipes[4]}, x, y, repeats=3)
    naive, piped = found["naive, m = 1"], found["pipeline, m = 4"]
    assert len(naive.losses) == len(piped.losses) == 3
    assert naive.losses + piped.losses == pytest.approx([naive.losses[0]] * 6, rel=1e-5)  # the same work
    assert all(torch.equal(p, q) for p, q in zip(gpt.parameters(), before))  # no update
    assert all(p.grad is None for p in gpt.parameters())
    for side in found.values():
        assert side.step_seconds == sorted(side.makespans)[1] == side.trace.makespan  # the median of 3
    assert naive.trace.n_microbatches == 1 and naive.trace.speedup <= 1 + 1e-9  # each stage waits for the last
    assert piped.trace.n_microbatches == 4 and piped.trace.speedup > 1
    with pytest.raises(ValueError, match="repeats must be a positive int"):
        app.side_by_side(found, x, y, repeats=0)


def test_held_bytes_counts_a_frozen_stage_s_parameters_and_a_trained_one_s_adamw_state():
    gpt, pipes, x, y = _frozen_gpt_pipelines((2,))
    pipe = pipes[2]
    trace = pipe.step(x, y).trace
    held = app.held_bytes(pipe, trace, "adamw")
    parameter_bytes = [sum(p.numel() * 4 for p in stage.parameters()) for stage in pipe.partition.stages]
    observed = trace.peak_memory_observed
    assert held[0] == parameter_bytes[0] + observed[0]  # frozen: no gradient, no optimizer state
    assert held[1:] == [4 * b + a for b, a in zip(parameter_bytes[1:], observed[1:])]  # + grads + 2 moments
    assert app.held_bytes(pipe, trace, "sgd")[1] == 2 * parameter_bytes[1] + observed[1]


def test_state_by_depth_gives_the_needs_the_pipeline_refuses_before_its_first_step():
    gpt = pl.models.tiny_gpt(n_layers=2, d_model=32, n_heads=2, vocab_size=64, seq_len=16, seed=0)
    gpt[:2].requires_grad_(False)  # the embedding and the first block
    x, y = pl.models.sample_batch(gpt, 8)
    sample = (pl.microbatch.split(x, 2)[0], pl.microbatch.split(y, 2)[0])  # what the engine profiles
    unfrozen = copy.deepcopy(gpt).requires_grad_(True)
    found = {}
    for name, model in (("frozen", gpt), ("not frozen", unfrozen)):
        found[name] = app.state_by_depth(model, (1, 2), 2, sample, pl.models.lm_loss, "adamw", split_method="params")
        for p in (1, 2):
            limit = app.fullest(found[name][p]).total_bytes - 1
            with pytest.raises(pl.MemoryBudgetError) as refused:
                pl.Pipeline(model, n_stages=p, n_microbatches=2, loss_fn=pl.models.lm_loss, devices="cpu",
                            split_method="params", memory_limit_bytes=limit, memory_optimizer="adamw").step(x, y)
            assert [n.total_bytes for n in refused.value.needs] == [n.total_bytes for n in found[name][p]]
        assert all(q.grad is None for q in model.parameters())  # refused before running
    frozen_bytes = sum(q.numel() * 4 for q in gpt[:2].parameters())
    whole = [found[name][1][0] for name in ("frozen", "not frozen")]
    assert whole[1].model_state_bytes - whole[0].model_state_bytes == 3 * frozen_bytes  # a gradient, 2 moments
    assert whole[0].activation_bytes < whole[1].activation_bytes  # nothing kept for a backward in the frozen part


def test_median_seconds_takes_each_stages_median_of_one_kind():
    trace = pl.simulate(pl.schedules.one_f_one_b(3, 4), pl.Costs(forward=[1.0, 2.0, 3.0], backward=[0.5, 4.0, 6.0]))
    assert app.median_seconds(trace, "F") == pytest.approx([1.0, 2.0, 3.0])
    assert app.median_seconds(trace, "B") == pytest.approx([0.5, 4.0, 6.0])
    assert app.median_seconds(trace, "W") == [0.0, 0.0, 0.0]  # 1F1B runs no W
    gpt, pipes, x, y = _frozen_gpt_pipelines((2,))
    steps = [app.median_seconds(pipes[2].step(x, y).trace, "B") for _ in range(3)]
    measured = [min(column) for column in zip(*steps)]  # a busy CPU only ever adds time
    assert measured[0] < 0.2 * min(measured[1:])  # the frozen first stage's backward does no work


def test_time_one_microbatch_times_on_one_thread_and_leaves_no_gradient():
    model = pl.models.mlp(depth=4, width=16, seed=0)
    x, y = pl.models.sample_batch(model, 8)
    threads = torch.get_num_threads()
    forward, backward = app.time_one_microbatch(model, x, y, repeats=3)
    assert 0 < forward < 1 and 0 < backward < 1
    assert torch.get_num_threads() == threads and all(p.grad is None for p in model.parameters())


def test_the_two_hosts_model_is_the_benchmarks():
    costs = app.two_hosts_model(0.05, 0.08)
    model = pl.models.mlp(depth=app.TWO_HOSTS_DEPTH, width=app.TWO_HOSTS_WIDTH, seed=0)
    assert costs.parameter_bytes == sum(p.numel() * 4 for p in model.parameters()) == 50_429_952  # "50.4 MB"
    assert costs.activation_bytes == 256 * 512 * 4 and costs.n_layers == 12
    benchmark = _slow_link_benchmark()
    assert (benchmark.DEPTH, benchmark.WIDTH, benchmark.BATCH, benchmark.MICROBATCHES) == (
        app.TWO_HOSTS_DEPTH, app.TWO_HOSTS_WIDTH, app.TWO_HOSTS_BATCH, app.TWO_HOSTS_MICROBATCHES)


def test_the_benchmarks_full_speed_prediction_adds_what_predict_says_the_slower_link_costs():
    """A consistency check of the benchmark's arithmetic (the same `predict` on both sides): the full-speed step
    plus predict's difference between the two links; the prediction itself is checked against measured steps
    by the benchmark (docs/two_hosts.md)."""
    benchmark = _slow_link_benchmark()
    model = {"forward_seconds": 0.08, "backward_seconds": 0.16, "activation_bytes": 256 * 512 * 4,
             "parameter_bytes": 50_429_952}
    by_rate = {rate: {"model": model, "link": {"latency": 1e-4, "bandwidth": bits / 8},
                      "layouts": {name: {"step_seconds": [0.5, 0.7, 0.6]} for name in benchmark.LAYOUTS}}
               for rate, bits in (("full", 20e9), ("1gbit", 1e9), ("100mbit", 1e8))}
    link = {rate: Link(1e-4, bits / 8) for rate, bits in (("full", 20e9), ("100mbit", 1e8))}
    costs = app.two_hosts_model(0.08, 0.16)
    tp = pl.Layout(1, 1, 2)
    added = (predict(tp, costs, dict.fromkeys(("pp", "tp", "dp"), link["100mbit"]), 2).step_seconds
             - predict(tp, costs, dict.fromkeys(("pp", "tp", "dp"), link["full"]), 2).step_seconds)
    assert added > 1.0  # 96 all-reduces of 512 KiB at 100 Mbit/s: about 4 s
    assert benchmark.predicted_from_full_speed(by_rate, "TP", "100mbit") == pytest.approx(0.6 + added, rel=1e-12)
    assert benchmark.predicted_from_full_speed(by_rate, "TP", "full") == pytest.approx(0.6, rel=1e-12)


def _slow_link_benchmark():
    spec = importlib.util.spec_from_file_location("slow_link", ROOT / "benchmarks" / "slow_link.py")
    benchmark = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(benchmark)  # definitions only: it runs under `if __name__ == "__main__"`
    return benchmark


def test_predict_two_hosts_gives_the_benchmarks_predictions_and_pp_keeps_its_pace():
    # docs/two_hosts.md, run 1 at 1 Gbit/s: link 954 Mbit/s, 124 us; F 82.3 ms, B 159.4 ms -> 371.6, 664.7, 687.4 ms
    # (printed from unrounded figures: the same to 0.1 %)
    model = app.two_hosts_model(0.0823, 0.1594)
    found = app.predict_two_hosts(model, 954e6, latency_seconds=124e-6)
    recorded = {"PP": 0.3716, "DP": 0.6647, "TP": 0.6874}
    assert {k: v.step_seconds for k, v in found.items()} == pytest.approx(recorded, rel=1e-3)
    link = Link(124e-6, 954e6 / 8)
    assert found["PP"] == predict(pl.Layout(1, 2, 1), model, {"pp": link, "tp": link, "dp": link}, 2)
    assert found["DP"] == predict(pl.Layout(2, 1, 1), model, {"pp": link, "tp": link, "dp": link}, 1)
    assert app.link_bytes("PP", found["PP"]) == 2 * 2 * 524288  # each micro-batch's activation and its gradient
    assert app.link_bytes("DP", found["DP"]) == 2 * model.parameter_bytes  # each rank sends 2·(n−1)/n·Ψ = Ψ
    assert app.link_bytes("TP", found["TP"]) == 2 * 4 * 2 * 12 * 524288  # 4 all-reduces a layer, 2 micro-batches
    slow = app.predict_two_hosts(model, 1e8, latency_seconds=99e-6)
    grew = {k: slow[k].step_seconds / found[k].step_seconds for k in found}
    assert grew["PP"] < 1.3 and grew["DP"] > 4 and grew["TP"] > 4
    for bad in (0, -1e9, math.inf, "1gbit"):
        with pytest.raises(ValueError, match="bits_per_second"):
            app.predict_two_hosts(model, bad)


def test_the_pictures_draw_what_they_are_given():
    model = pl.models.mlp(depth=4, width=16, seed=0)
    x, y = pl.models.sample_batch(model, 4)
    by_depth = app.state_by_depth(model, (1, 2), 4, (x, y), nn.MSELoss())
    fig, axes = plt.subplots(1, 4, figsize=(16, 3))
    app.plot_state_by_depth(by_depth, ax=axes[0], limit_bytes=2**14, unit=2**10, unit_name="KiB")
    assert len(axes[0].patches) == len(app.PARTS) * 2
    tops = [sum(b.get_height() for b in axes[0].patches if b.get_x() < 0.5)]
    assert tops[0] == pytest.approx(app.fullest(by_depth[1]).total_bytes / 2**10)
    app.plot_losses({"one device": [3, 2, 1, 0.5], "pipeline": [3, 2, 1, 0.5]}, ax=axes[1], depths=[4, 4, 2, 2])
    assert len(axes[1].lines) == 2 and {t.get_text() for t in axes[1].texts} == {"p = 4", "p = 2"}
    app.plot_inference(app.inference_points(4, 0.01, (1, 4, 16)), 4, 0.01, axes=axes[2:])
    assert len(axes[2].lines) == 3 and len(axes[3].lines) == 3
    plt.close(fig)
    by_rate = {r: app.predict_two_hosts(app.two_hosts_model(0.05, 0.08), b) for r, b in (("1 Gbit/s", 1e9),
                                                                                        ("100 Mbit/s", 1e8))}
    ax = app.plot_two_hosts(by_rate)
    assert len(ax.patches) == 6
    plt.close("all")


def test_median_replay_takes_each_actions_median_over_the_passes():
    schedule = pl.schedules.inference(2, 3)
    passes = [pl.simulate(schedule, pl.Costs(forward=t)) for t in (1.0, 9.0, 2.0)]  # one pass preempted
    replayed = app.median_replay(passes, schedule)
    assert replayed.durations() == {a: 2.0 for a in schedule.all_actions()}
    assert replayed.makespan == pytest.approx((3 + 2 - 1) * 2.0) and replayed.latencies == pytest.approx([4.0] * 3)
