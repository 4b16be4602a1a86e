"""The quantisation-method seam: one object per weight mode, asked by the loader, the mode
choice and the CLI instead of comparisons of mode names."""

from __future__ import annotations

import pytest
import torch

from loom.engine.mode import HostInfo, choose_mode
from loom.models import quant_method
from loom.models.quant import Int8Linear
from loom.models.quant_method import QUANTIZATIONS, get_quant_method
from loom.models.weight_shard import Shard


def test_every_mode_name_is_one_method_and_the_cli_offers_them_all() -> None:
    from loom.cli import _parser

    assert QUANTIZATIONS == ("int8", "w8a8", "w4a8")
    for name in QUANTIZATIONS:
        assert get_quant_method(name).name == name
    assert get_quant_method(None).name is None
    generate = _parser()._subparsers._group_actions[0].choices["generate"]
    choices = next(a.choices for a in generate._actions if a.dest == "quantization")
    assert list(choices) == ["auto", "none", *QUANTIZATIONS]
    with pytest.raises(ValueError, match=r"'int4'.*known"):
        get_quant_method("int4")


def test_a_method_names_where_it_cannot_run(monkeypatch) -> None:
    w4a8 = get_quant_method("w4a8")

    class Unsharded(quant_method.QuantMethod):
        name = "unsharded"
        shards = False

    with pytest.raises(ValueError, match="'unsharded' does not shard"):
        Unsharded().check(Shard(0, 2))
    Unsharded().check(Shard(0, 1))  # one rank is the whole model
    get_quant_method("w8a8").check(Shard(0, 2))
    w4a8.check(Shard(0, 2))  # each rank keeps its part of the blocks
    monkeypatch.setattr(quant_method, "cpu_kernels_available", lambda: False)
    with pytest.raises(ValueError, match="'w4a8' needs Loom's CPU kernels"):
        w4a8.check(None)
    assert get_quant_method("w8a8").weight_layout() == "rows"
    # The mode choice asks the method too: a CUDA engine cannot run w4a8.
    with pytest.raises(ValueError, match="'w4a8' runs on Loom's CPU kernels"):
        choose_mode("auto", "w4a8", "auto", True, HostInfo("cuda", cuda_bf16=True))


@pytest.mark.parametrize("name", [None, "int8", "w8a8"])
def test_each_method_prepares_a_layer_as_its_mode_says(tiny_model, name) -> None:
    """A float decoder layer prepared by each method: stacked projections, and int8 layers
    with or without int8 activations (w4a8 needs file blocks: tests/models/test_w4a8_llama.py)."""
    import copy

    method = get_quant_method(name)
    layer = copy.deepcopy(tiny_model.loom_model.model.layers[0]).float()
    method.prepare_layer(layer)
    method.prepare_layer(layer)  # idempotent
    linears = [m for m in layer.modules() if isinstance(m, torch.nn.Linear | Int8Linear)]
    assert linears
    if name is None:
        assert not any(isinstance(m, Int8Linear) for m in linears)
    else:
        assert all(isinstance(m, Int8Linear) for m in linears)
        assert all(m.quantize_activations == method.int8_activations for m in linears)
