"""SmoothQuant smoothing for int8 W8A8 (pagedllm/layers/quantization/smoothquant.py): the
factors' formula, the calibration pass, and that smoothing makes an outlier channel cost
less accuracy (the bundled model's perplexity is in test_quantization.py)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from pagedllm.layers.linear import ReplicatedLinear, UnquantizedLinearMethod
from pagedllm.layers.quantization import smoothquant as sq
from pagedllm.layers.quantization.int8 import Int8W8A8LinearMethod, onednn_int8_available

CPU = torch.device("cpu")


def test_smoothing_factors_formula():
    act = torch.tensor([8.0, 1.0, 0.0])
    w = torch.tensor([[2.0, -0.5, 0.0], [-1.0, 0.25, 0.0]])
    s = sq.smoothing_factors(act, w, 0.5)
    # s_j = max|X_j|^0.5 / max|W_j|^0.5; an all-zero channel is clamped to eps on both sides
    torch.testing.assert_close(s, torch.tensor([2.0, 2.0 ** 0.5, 1.0]), rtol=1e-6, atol=0)
    torch.testing.assert_close(sq.smoothing_factors(act, w, 1.0)[:2], act[:2])
    with pytest.raises(ValueError, match="alpha"):
        sq.smoothing_factors(act, w, 1.5)
    with pytest.raises(ValueError, match="shape"):
        sq.smoothing_factors(act[:2], w, 0.5)


class _Two(nn.Module):
    def __init__(self, method):
        super().__init__()
        self.a = ReplicatedLinear(16, 8, False, torch.float32, CPU, method, prefix="a")
        self.b = ReplicatedLinear(8, 4, False, torch.float32, CPU, method, prefix="b")
        g = torch.Generator().manual_seed(0)
        self.a.weight.data.copy_(torch.randn(8, 16, generator=g))
        self.b.weight.data.copy_(torch.randn(4, 8, generator=g))

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def test_calibration_records_input_maxima_and_restores_methods():
    class Raises(UnquantizedLinearMethod):
        def apply(self, layer, x, bias=None):
            raise AssertionError("the float method must be used during calibration")

    model = _Two(Raises())
    own = model.a.linear_method
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1))
    n = sq.calibrate_input_amax([model.a, model.b], lambda ids: model(x[ids[0]]), [0], UnquantizedLinearMethod)
    assert n == 2 and model.a.linear_method is own
    torch.testing.assert_close(model.a.int8_act_amax, x[0].abs().amax(0))
    h = torch.relu(x[0] @ model.a.weight.t())
    torch.testing.assert_close(model.b.int8_act_amax, h.abs().amax(0))
    sq.calibrate_input_amax([model.a, model.b], lambda ids: model(x[1]), [1], UnquantizedLinearMethod)
    torch.testing.assert_close(model.a.int8_act_amax, x.abs().amax((0, 1)))        # running maximum

    def boom(ids):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        sq.calibrate_input_amax([model.a], boom, [0], UnquantizedLinearMethod)
    assert model.a.linear_method is own and not model.a._forward_pre_hooks


@pytest.mark.skipif(not onednn_int8_available(CPU), reason="oneDNN int8 matmul unavailable")
def test_smoothing_lowers_the_error_of_an_outlier_channel():
    g = torch.Generator().manual_seed(0)
    K, N = 256, 128
    W = torch.randn(N, K, generator=g) * 0.05
    x = torch.randn(64, K, generator=g)
    x[:, [3, 77]] *= 40                     # outlier channels, as in LLM activations
    ref = x.double() @ W.double().t()
    errs = {}
    for alpha in (None, 0.5):
        layer = ReplicatedLinear(K, N, False, torch.float32, CPU, Int8W8A8LinearMethod(CPU, smooth_alpha=alpha))
        layer.weight.data.copy_(W)
        layer.int8_act_amax = x.abs().amax(0)
        assert layer.linear_method.needs_calibration == (alpha is not None)
        layer.linear_method.process_weights_after_loading(layer)
        y = layer(x)
        errs[alpha] = ((y.double() - ref).norm() / ref.norm()).item()
        # rows stay independent of the batch
        assert torch.equal(layer(x[5:6].clone()), y[5:6])
    assert errs[0.5] < 0.5 * errs[None], errs
    assert "SmoothQuant alpha 0.5" in Int8W8A8LinearMethod(CPU, smooth_alpha=0.5).name
    with pytest.raises(ValueError, match="smooth_alpha"):
        Int8W8A8LinearMethod(CPU, smooth_alpha=2.0)


def test_calibration_text_ships():
    text = sq.calibration_text()
    assert len(text) > 2000 and "def moving_average" in text


@pytest.mark.skipif(not onednn_int8_available(CPU), reason="oneDNN int8 matmul unavailable")
def test_build_model_runs_the_calibration_it_is_given(monkeypatch):
    from pagedllm.errors import InvalidParameterError
    from pagedllm.layers.quantization.int8_config import Int8Config
    from pagedllm.models import loader

    class FakeModel(nn.Module):
        def __init__(self, *a, quant_config=None):
            super().__init__()
            self.proj = ReplicatedLinear(16, 8, False, torch.float32, CPU, prefix="proj", quant_config=quant_config)

        def load_weights(self, weights):
            self.proj.weight.data.normal_()

    monkeypatch.setattr(loader, "get_model_class", lambda cfg: FakeModel)
    monkeypatch.setattr(loader, "iter_weights", lambda path, cfg, **kw: [])
    with pytest.raises(InvalidParameterError, match="calibration"):
        loader.build_model("unused", None, torch.float32, CPU, 16, quant_config=Int8Config(CPU))
    seen = []

    def calibrate(model, layers, *rest):
        seen.append([layer.prefix for layer in layers])
        for layer in layers:
            layer.int8_act_amax = torch.full((16,), 4.0)

    model = loader.build_model("unused", None, torch.float32, CPU, 16, quant_config=Int8Config(CPU),
                               calibrate=calibrate)
    assert seen == [["proj"]] and model.proj.int8_smooth.shape == (16,)
    model = loader.build_model("unused", None, torch.float32, CPU, 16,
                               quant_config=Int8Config(CPU, smooth_alpha=None))   # no smoothing: none needed
    assert not hasattr(model.proj, "int8_smooth")


def test_a_channel_silent_in_calibration_is_not_smoothed():
    """A channel never active on the calibration text (max 0) keeps s = 1, so an input that
    turns up there later is not scaled up by a large 1 / s."""
    w = torch.full((4, 3), 0.05)
    s = sq.smoothing_factors(torch.tensor([0.0, 2.0, 3.0]), w, 0.5)
    assert s[0] == 1.0 and s[1] != 1.0
    w[:, 2] = 0
    assert sq.smoothing_factors(torch.tensor([0.0, 2.0, 3.0]), w, 0.5)[2] == 1.0


@pytest.mark.skipif(not onednn_int8_available(CPU), reason="oneDNN int8 matmul unavailable")
def test_an_uncalibrated_layer_says_it_is_not_smoothed():
    layer = ReplicatedLinear(16, 8, False, torch.float32, CPU, Int8W8A8LinearMethod(CPU, smooth_alpha=0.5))
    layer.weight.data.normal_()
    layer.linear_method.process_weights_after_loading(layer)
    assert not hasattr(layer, "int8_smooth") and "not smoothed" in layer.linear_method.name
