"""Mixture-of-Experts models split by names (`pipelab/model/experts.py`): experts run as an eager Python loop are
refused before the trace, naming the module and the switch; switched, the pipelined step is the single device's
(that of the model still eager) in loss and gradients.  A forward that loops on a tensor's values otherwise is
explained in the trace's error."""

import copy

import pytest
import torch
from torch import nn

import pipelab as pl
from your_model_cases import make_batch, reference_gradients, gradients_of

hf = pytest.importorskip("transformers")

TINY = dict(num_hidden_layers=2, vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=32, num_experts_per_tok=2)


def moe(kind: str, experts_implementation: str | None = None):
    torch.manual_seed(0)
    chosen = {} if experts_implementation is None else {"experts_implementation": experts_implementation}
    if kind == "mixtral":
        return hf.MixtralForCausalLM(hf.MixtralConfig(num_local_experts=4, **TINY, **chosen)).eval()
    return hf.Qwen2MoeForCausalLM(hf.Qwen2MoeConfig(num_experts=4, moe_intermediate_size=16,
                                                   shared_expert_intermediate_size=32, **TINY, **chosen)).eval()


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_eager_experts_are_refused_before_the_trace_naming_the_switch(kind, monkeypatch):
    model = moe(kind, "eager")
    traced = []
    monkeypatch.setattr(torch.export, "export", lambda *a, **k: traced.append(1))
    with pytest.raises(ValueError) as caught:
        pl.Pipeline(model, n_stages=2, n_microbatches=2, split_points=["model.layers.1"], sample=make_batch("llama"),
                    devices="cpu")
    said = str(caught.value)
    assert said.startswith("model.layers.0.mlp.experts (and 1 more) runs its experts as a Python loop")
    assert "model.set_experts_implementation('grouped_mm')" in said and "experts_implementation=grouped_mm" in said
    assert not traced  # refused before torch.export was asked


def test_switched_to_grouped_mm_the_step_equals_the_eager_single_device():
    """transformers' default where it can dispatch (the CPU included), and the fix the refusal names."""
    eager = moe("mixtral", "eager")
    model = copy.deepcopy(eager)
    model.set_experts_implementation("grouped_mm")
    batch = make_batch("llama", padded=True)
    pipe = pl.Pipeline(model, n_stages=2, n_microbatches=3, split_points=["model.layers.1"], sample=batch,
                       devices="cpu")
    loss = pipe.step(batch).loss
    expected_loss, expected = reference_gradients(eager, batch)
    assert loss == pytest.approx(expected_loss, rel=1e-5)
    found = gradients_of(model)
    assert found.keys() == expected.keys()
    for name, grad in expected.items():
        torch.testing.assert_close(found[name], grad, rtol=1e-5, atol=1e-6, msg=lambda e: f"{name}: {e}")


class PickedRows(nn.Module):
    """A loop over the rows a mask picks: its length is a tensor's value."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        h = self.first(x)
        for row in (h[:, 0] > 0).nonzero():
            h = h + self.second(h[row])
        return self.second(h)


def test_a_forward_that_loops_on_a_tensors_values_is_explained():
    with pytest.raises(pl.PipelineError, match="data-dependent control flow"):
        pl.Pipeline(PickedRows(), n_stages=2, n_microbatches=2, split_points=["second"], loss_fn=nn.MSELoss(),
                    sample={"x": torch.randn(4, 4)}, devices="cpu")
