import pytest

from collectives import config


def test_env_overrides_are_derived_from_field_names():
    cfg = config.from_env({"COLLECTIVES_RANKS_PER_NODE": "2", "COLLECTIVES_RING_SEGMENT_BYTES": "4096"})
    assert cfg.ranks_per_node == 2 and cfg.ring_segment_bytes == 4096
    assert config.from_env({}).ranks_per_node is None


def test_typos_and_bad_values_fail_loudly():
    with pytest.raises(ValueError, match="COLLECTIVES_RANK_PER_NODE"):
        config.from_env({"COLLECTIVES_RANK_PER_NODE": "2"})
    with pytest.raises(ValueError, match="expected int"):
        config.from_env({"COLLECTIVES_RANKS_PER_NODE": "two"})
