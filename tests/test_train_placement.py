"""FSDP's choice of dimension, as a pure function of a parameter's spec, shape and logical axes."""

from jax.sharding import PartitionSpec as P

from lcx.train.placement import fsdp_spec


def test_fsdp_splits_the_largest_free_divisible_dimension():
    assert fsdp_spec(P(None, None, "model", None), (4, 64, 8, 16), 2) == P(None, "data", "model", None)
    assert fsdp_spec(P(None, None), (30, 7), 4) == P(None, None)  # nothing divisible: stays as it was
    assert fsdp_spec(P("data", None), (8, 8), 2) == P("data", None)  # already over data
    assert fsdp_spec(P(None, None), (8, 8), 1) == P(None, None)  # no data axis to split over


def test_fsdp_never_splits_the_stacked_layer_axis():
    # a norm scale stacked over 64 layers: [layers, norm] with the layer count the largest dimension
    assert fsdp_spec(P(None, None), (64, 32), 2, ("layers", "norm")) == P(None, "data")
    assert fsdp_spec(P(None, None), (64, 3), 2, ("layers", "norm")) == P(None, None)
