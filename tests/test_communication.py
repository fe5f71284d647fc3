"""pipelab.predict.communication: the formulas, and the ring all-reduce's bytes counted on a ring written out here."""

import pytest

from pipelab.predict.communication import (layout_bytes, pipeline_elements_per_device, pipeline_sent,
                                   ring_allreduce_elements_per_device, tensor_parallel_sent,
                                   tensor_parallel_elements_per_device, transformer_layer_parameters)


def ring_allreduce_sent(values_per_device):
    """A ring all-reduce run step by step on lists (reduce-scatter, then all-gather); counts what each device sends."""
    n = len(values_per_device)
    size = len(values_per_device[0])
    chunks = [list(range(c * size // n, (c + 1) * size // n)) for c in range(n)]
    data = [list(v) for v in values_per_device]
    sent = [0] * n
    for phase in ("reduce-scatter", "all-gather"):
        for step in range(n - 1):
            outgoing = []
            for d in range(n):
                c = (d - step + (0 if phase == "reduce-scatter" else 1)) % n
                outgoing.append((d, c, [data[d][i] for i in chunks[c]]))
                sent[d] += len(chunks[c])
            for d, c, values in outgoing:
                receiver = (d + 1) % n
                for i, v in zip(chunks[c], values):
                    data[receiver][i] = data[receiver][i] + v if phase == "reduce-scatter" else v
    return data, sent


@pytest.mark.parametrize("n_devices", [2, 3, 4, 8])
def test_ring_allreduce_formula_matches_a_ring_run(n_devices):
    size = 24
    values = [[float(d * 100 + i) for i in range(size)] for d in range(n_devices)]
    data, sent = ring_allreduce_sent(values)
    total = [sum(v[i] for v in values) for i in range(size)]
    assert all(row == total for row in data)  # it is an all-reduce
    assert sent == [ring_allreduce_elements_per_device(size, n_devices)] * n_devices


def test_pipeline_sends_bsh_each_way_whatever_the_depth():
    assert pipeline_elements_per_device(8, 1024, 4096, 4) == 2 * 8 * 1024 * 4096
    assert pipeline_elements_per_device(8, 1024, 4096, 2) == 8 * 1024 * 4096
    assert pipeline_elements_per_device(8, 1024, 4096, 1) == 0


def test_tensor_parallel_is_eight_bsh_per_layer_times_t_minus_one_over_t():
    b, s, h = 4, 512, 1024
    assert tensor_parallel_elements_per_device(b, s, h, n_layers=1, tp=4) == pytest.approx(8 * b * s * h * 3 / 4)
    assert tensor_parallel_elements_per_device(b, s, h, n_layers=10, tp=4) == pytest.approx(10 * 8 * b * s * h * 3 / 4)
    assert tensor_parallel_elements_per_device(b, s, h, n_layers=10, tp=1) == 0


def test_deep_narrow_against_shallow_wide_at_the_same_size():
    deep = layout_bytes("deep", 64, 1024, 4, batch=1, seq_len=2048)
    wide = layout_bytes("wide", 16, 2048, 4, batch=1, seq_len=2048)
    assert deep.parameters == wide.parameters == 64 * 12 * 1024**2
    assert deep.pipeline_bytes == wide.pipeline_bytes / 2          # b·s·h: the narrow model sends half
    assert deep.tensor_parallel_bytes == 2 * wide.tensor_parallel_bytes  # L·h: the deep model all-reduces twice as much
    assert deep.ratio == pytest.approx(4 * 64 * 3 / 4) and wide.ratio == pytest.approx(4 * 16 * 3 / 4)
    assert transformer_layer_parameters(1024) == 12 * 1024**2


def test_bad_sizes_are_named():
    with pytest.raises(ValueError, match="hidden must be a positive int"):
        layout_bytes("x", 4, 0, 4, 1, 16)
    with pytest.raises(ValueError, match="n_stages"):
        pipeline_elements_per_device(1, 1, 1, 0)


def test_the_activation_forms_take_any_unit():
    # bytes in, bytes out: 4-byte elements give 4 times the elements' formulas
    b, s, h = 2, 16, 8
    assert pipeline_sent(4 * b * s * h, 3) == 4 * pipeline_elements_per_device(b, s, h, 3)
    assert tensor_parallel_sent(4 * b * s * h, 6, 4) == pytest.approx(
        4 * tensor_parallel_elements_per_device(b, s, h, 6, 4))
    assert tensor_parallel_sent(1.0, 1, 2) == 4 * 1.0  # 4 all-reduces, each sending half twice
