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


def test_get_reads_the_environment_once_and_set_replaces_it(monkeypatch):
    monkeypatch.setattr(config, "_current", None)
    monkeypatch.setenv("COLLECTIVES_RING_SEGMENT_BYTES", "8192")
    first = config.get()
    assert first.ring_segment_bytes == 8192
    monkeypatch.setenv("COLLECTIVES_RING_SEGMENT_BYTES", "16384")
    assert config.get() is first  # read once, not per call
    mine = config.Config(stall_timeout_s=5.0)
    config.set(mine)
    assert config.get() is mine


def test_set_takes_only_a_config(monkeypatch):
    monkeypatch.setattr(config, "_current", None)
    with pytest.raises(TypeError, match="cfg: expected a Config, got dict"):
        config.set({"stall_timeout_s": 5.0})
