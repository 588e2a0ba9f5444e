"""Logical axis names are defined once (maxpar.core.axes.Logical); none can silently leave an array unsharded."""

from __future__ import annotations

import jax
import pytest

from helpers import layout_on, micro_config
from maxpar.core import layout as layout_module
from maxpar.core.axes import UNSHARDED_BY_DEFAULT, Logical
from maxpar.core.config import ConfigError, model_config
from maxpar.model import Transformer
from maxpar.training.optimizer import make_optimizer
from maxpar.training.train_step import lower_train_step

CONFIGS = {
    "dense": [],
    "unscanned": ["scan_layers=false"],
    "moe_ep": ["model_name=tiny-moe", "ici_expert_parallelism=2", "ici_fsdp_parallelism=4", "moe_layer_interval=2"],
    "circular_pipeline": ["ici_stage_parallelism=2", "ici_fsdp_parallelism=4", "num_decoder_layers=4",
                          "num_pipeline_repeats=2", "num_pipeline_microbatches=2"],
}


def base_rule_names() -> set[str]:
    return {name for name, _ in micro_config().logical_axis_rules}


def test_every_logical_name_has_a_rule_or_is_declared_unsharded():
    ruled = base_rule_names()
    for name in Logical:
        assert (name in ruled) != (name in UNSHARDED_BY_DEFAULT), name
    assert ruled <= set(Logical)  # base.yml names only known axes


@pytest.mark.parametrize("bad", ["[[embedd,[fsdp]]]", "[[activation_btch,[data]]]"])
def test_a_rule_naming_an_unknown_logical_axis_is_a_config_error(bad):
    with pytest.raises(ConfigError, match="names unknown logical axis .*; logical axes are activation_batch"):
        micro_config(f"logical_axis_rules={bad}")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_name_the_model_uses_is_a_known_logical_axis(name, monkeypatch):
    """Parameters (the traced state) and activation constraints (recorded while the train step is lowered)."""
    config = micro_config("dataset_type=synthetic", "per_device_batch_size=1", *CONFIGS[name])
    layout, mesh = layout_on(config)
    specs = jax.tree.leaves(layout.state.specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    param_names = {n for spec in specs for n in spec if n is not None}
    constrained: set[str] = set()
    original = layout_module.constrain  # what every `ModelLayout.constrain` of the model calls

    def recording(x, names, *args, **kwargs):
        constrained.update(n for n in names if n is not None)
        return original(x, names, *args, **kwargs)

    monkeypatch.setattr(layout_module, "constrain", recording)
    # Lowering traces the whole step (every constraint is applied while tracing); compiling would add nothing here.
    lower_train_step(Transformer(model_config(config), layout.model), make_optimizer(config), layout, mesh)
    assert param_names and constrained
    assert param_names | constrained <= set(Logical), (param_names | constrained) - set(Logical)
