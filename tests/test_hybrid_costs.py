"""The hybrid-layout predictor against closed forms (and the simulator it calls, where said)."""

import math

import pytest

import pipelab as pl
from pipelab.predict.hybrid_costs import Link, ModelCosts, all_reduce_seconds, cluster_links, predict

MODEL = ModelCosts(forward_seconds=8.0, backward_seconds=16.0, activation_bytes=1e6, n_layers=16, parameter_bytes=8e9)
# a GPT layer stack of h=8192 at s=2048, one sequence per micro-batch in bf16: A = 2048·8192·2 bytes
GPT = ModelCosts(forward_seconds=0.8, backward_seconds=1.6, activation_bytes=2048 * 8192 * 2, n_layers=16,
                 parameter_bytes=2 * 16 * 12 * 8192**2)
FREE = {dim: Link(0.0, math.inf) for dim in ("tp", "pp", "dp")}


def test_free_links_give_the_pipeline_of_the_divided_compute():
    # p=1: one stage, m micro-batches one after the other: m·(F + B)/t (closed form)
    assert predict(pl.Layout(tp=4), MODEL, FREE, 4).step_seconds == pytest.approx(4 * 24 / 4)
    # p=4, 1F1B with free links: (m + p − 1)·(F + B) per stage (closed form), F + B = 24 / 4
    assert predict(pl.Layout(pp=4), MODEL, FREE, 8).step_seconds == pytest.approx((8 + 3) * 24 / 4)


def test_tensor_parallel_all_reduces_sit_inside_forward_and_backward():
    link = Link(1e-3, 1e9)
    links = {**FREE, "tp": link}
    one = 2 * (2 - 1) / 2 * 1e6 / 1e9 + 2 * 1e-3  # ring all-reduce of 1 MB on 2 ranks
    assert all_reduce_seconds(1e6, 2, link) == pytest.approx(one)
    # p=1, m=2: each micro-batch: F/2 + 16 layers·2 all-reduces, B/2 + 16·2 all-reduces
    expected = 2 * (24 / 2 + 16 * 4 * one)
    assert predict(pl.Layout(tp=2), MODEL, links, 2).step_seconds == pytest.approx(expected)


def test_data_parallel_all_reduce_after_the_drain():
    links = {**FREE, "dp": Link(0.0, 1e10)}
    found = predict(pl.Layout(dp=4, pp=2), MODEL, links, 4)
    assert found.dp_seconds == pytest.approx(2 * 3 / 4 * (8e9 / 2) / 1e10)
    assert found.step_seconds == pytest.approx(found.pipeline_seconds + found.dp_seconds)
    assert found.parameter_bytes_per_device == 8e9 / 2


def test_links_follow_the_mesh_and_tensor_parallelism_across_nodes_loses():
    inside, between = (2e-6, 300e9), (10e-6, 12.5e9)
    assert cluster_links(pl.Layout(pp=2, tp=8), 8, inside, between) == {
        "tp": Link(*inside), "pp": Link(*between), "dp": Link(*between)}
    steps = {str(layout): predict(layout, GPT, cluster_links(layout, 8, inside, between), 8).step_seconds
             for layout in (pl.Layout(pp=2, tp=8), pl.Layout(tp=16), pl.Layout(pp=16))}
    assert steps["dp=1 pp=2 tp=8"] < steps["dp=1 pp=1 tp=16"]  # TP over the slow link loses
    sent = predict(pl.Layout(dp=2, pp=4, tp=4), MODEL, FREE, 8).bytes_per_device
    assert sent["pp"] == 2 * 8 * 1e6 / 4
    # 8 micro-batches · 16/4 layers · 4 all-reduces of 1 MB, each sending 2·3/4 of it; Ψ/16 all-reduced over 2
    assert sent["tp"] == pytest.approx(8 * 4 * 4 * 1.5 * 1e6)
    assert sent["dp"] == pytest.approx(8e9 / 16)


def test_a_pipeline_message_under_tensor_parallelism_carries_a_over_t():
    """Each of the t ranks of a stage sends its 1/t of the activation on the "pp" link (Megatron's scatter/gather):
    p=2, t=2, m=1 with only the "pp" link slow: F, message, F, B, message, B, each message (A/t)/bandwidth.

    Planted bug it catches: `hybrid_costs.predict` giving the simulator the whole activation
    (`activation_bytes=model.activation_bytes`, not `/ t`): the messages take twice as long."""
    links = {**FREE, "pp": Link(0.0, 1e9)}
    forward, backward = 8.0 / (2 * 2), 16.0 / (2 * 2)  # each stage's share, split over t
    message = (1e6 / 2) / 1e9
    found = predict(pl.Layout(pp=2, tp=2), MODEL, links, 1)
    assert found.step_seconds == pytest.approx(2 * forward + 2 * backward + 2 * message, rel=1e-9)
