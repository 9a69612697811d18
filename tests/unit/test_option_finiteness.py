"""Issue 44 (part): a NaN or infinite numeric option is refused before any Spark job, the message
naming the option (they used to pass validation and fail deep in the workers, or not at all)."""
from __future__ import annotations

import math

import pytest

from sparkdl.config import RunConfig
from sparkdl.errors import ConfigError


@pytest.mark.parametrize("option, value", [
    ("timeout_s", math.nan), ("slot_wait_s", math.inf), ("lr", math.inf), ("lr", math.nan),
    ("grad_clip", math.nan), ("weight_decay", math.nan), ("momentum", -math.inf), ("outer_lr", math.nan),
    ("min_lr", math.inf), ("validation_fraction", math.nan), ("peer_failure_delay_s", math.inf),
    ("replacement_wait_s", math.nan), ("approximate_min_speedup", math.nan)])
def test_a_non_finite_option_is_refused_by_name(option: str, value: float) -> None:
    with pytest.raises(ConfigError, match=rf"\.{option} must be a finite number, got {value!r}"):
        RunConfig.from_kwargs(feature_cols=["a"], **{option: value}).validate()


def test_infinity_where_it_means_something_stays_allowed() -> None:
    # approximate_min_speedup=inf: never an approximate strategy (conf/defaults.toml)
    assert RunConfig.from_kwargs(feature_cols=["a"], approximate_min_speedup=math.inf).validate()


def test_the_run_secret_is_in_no_repr() -> None:
    """Issue 44 (part): a TrainSpec or channel address printed in a log or an error keeps the secret."""
    from sparkdl.wire.frames import ChannelAddress

    address = ChannelAddress("10.0.0.1", 7000, "s3cr3t-token")
    assert "s3cr3t-token" not in repr(address) and "s3cr3t-token" not in str(address)
    assert address.secret == "s3cr3t-token" and "10.0.0.1" in repr(address)


@pytest.mark.parametrize("option, value, named", [
    ("emulate_network", {"latency_ms": math.nan, "gbps": 1.0}, "launch.emulate_network.latency_ms"),
    ("emulate_network", {"latency_ms": 1.0, "gbps": math.inf}, "launch.emulate_network.gbps"),
    ("early_stopping", {"metric": "val_loss", "min_delta": math.nan}, "train.early_stopping.min_delta"),
    ("emulate_speed", [1.0, math.nan], "launch.emulate_speed[1]")])
def test_non_finite_values_inside_tables_and_lists_are_named(option: str, value: object, named: str) -> None:
    with pytest.raises(ConfigError, match=rf"{named.replace('[', '.').replace(']', '.')} must be a finite number"):
        RunConfig.from_kwargs(feature_cols=["a"], num_workers=2, **{option: value}).validate()
