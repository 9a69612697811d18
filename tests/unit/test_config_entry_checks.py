"""One validation for every entry point (issue 52): every float option refuses NaN (and infinity
where it means nothing) whichever entry checks it, any spelling of the unspecified address is refused
as launch.channel, and a SparkdlError's text has the credentials of the user's error masked.
Pure checks, no Spark."""
from __future__ import annotations

import math
import pickle
import socket
import subprocess
import sys
from dataclasses import fields, replace

import pytest

from sparkdl.config import LaunchConfig, RunConfig, TrackingConfig
from sparkdl.config.training import check_channel, unspecified_address
from sparkdl.config.values import INFINITY_ALLOWED
from sparkdl.driver import channel_checks
from sparkdl.errors import ConfigError, RankFunctionError, SparkdlError, TrainingError


def _float_options() -> list[tuple[str, str]]:
    """(section, option) of every option annotated as a float."""
    config = RunConfig()
    return [(section.name, f.name) for section in fields(config) for f in fields(getattr(config, section.name))
            if str(f.type).replace(" ", "").split("|")[0] == "float"]


FLOAT_OPTIONS = _float_options()


def test_the_float_options_are_found() -> None:
    found = {f"{s}.{o}" for s, o in FLOAT_OPTIONS}
    assert {"launch.timeout_s", "launch.slot_wait_s", "train.lr", "train.grad_clip", "data.validation_fraction",
            "embeddings.embedding_lr"} <= found


@pytest.mark.parametrize("columns", [True, False], ids=["with-a-dataframe", "without"])
@pytest.mark.parametrize("section, option", FLOAT_OPTIONS, ids=[f"{s}.{o}" for s, o in FLOAT_OPTIONS])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
def test_every_float_option_refuses_non_finite_values(section: str, option: str, value: float,
                                                      columns: bool) -> None:
    config = RunConfig.from_kwargs(feature_cols=["a"]).merged({section: {option: value}})
    if value == math.inf and f"{section}.{option}" in INFINITY_ALLOWED:
        config.validate(columns=columns)  # infinity means something here
        return
    with pytest.raises(ConfigError, match=rf"^{section}\.{option} must be"):
        config.validate(columns=columns)


@pytest.mark.parametrize("options", [{"timeout_s": math.nan}, {"lr": math.inf}, {"grad_clip": math.nan},
                                     {"slot_wait_s": math.inf}])
def test_run_without_a_dataframe_gets_fits_checks(options: dict[str, float]) -> None:
    """The issue's four: sparkdl.run without a DataFrame validates with columns=False."""
    name = next(iter(options))
    with pytest.raises(ConfigError, match=rf"\.{name} must be a finite number") as info:
        RunConfig.from_kwargs(num_workers=2, **options).validate(columns=False)
    assert info.value.hint and name in info.value.hint


def test_without_a_dataframe_the_column_rules_do_not_apply_but_the_rest_do() -> None:
    RunConfig.from_kwargs(num_workers=2).validate(columns=False)  # no feature_cols: fine without a DataFrame
    with pytest.raises(ConfigError, match="data.feature_cols is empty"):
        RunConfig.from_kwargs(num_workers=2).validate()
    with pytest.raises(ConfigError, match="data.batch_size must be at least 1"):
        RunConfig.from_kwargs(batch_size=0).validate(columns=False)
    with pytest.raises(ConfigError, match="train.stages=3 does not divide"):  # the rules across sections too
        RunConfig.from_kwargs(num_workers=2, strategy="hybrid", stages=3).validate(columns=False)


def test_a_section_checked_alone_meets_the_same_rules() -> None:
    """sparkdl.compat checks only its launch and tracking sections: types and finiteness included."""
    with pytest.raises(ConfigError, match="launch.timeout_s must be a finite number"):
        LaunchConfig(timeout_s=math.nan).validate()
    with pytest.raises(ConfigError, match="launch.slot_wait_s must be a finite number"):
        LaunchConfig(slot_wait_s=math.inf).validate()
    with pytest.raises(ConfigError, match="tracking.log_every must be of type int"):
        replace(TrackingConfig(), log_every="20").validate()


@pytest.mark.parametrize("channel", ["0.0", "0", "00", "0x0", "0.0.0", "0.0.0.0", "000.000.000.000", "::", "[::]",
                                     "::0", "0::0", "0:0:0:0:0:0:0:0", "::ffff:0.0.0.0", "*", "[0.0]"])
def test_every_spelling_of_the_unspecified_address_is_refused(channel: str) -> None:
    with pytest.raises(ConfigError, match=r"launch.channel=.* is a wildcard address") as info:
        check_channel(channel)
    assert 'launch.channel="auto"' in (info.value.hint or "")


def test_the_refusal_says_what_the_spelling_means() -> None:
    with pytest.raises(ConfigError, match=r"'0\.0' is a wildcard address \(it resolves to 0\.0\.0\.0, every interface\)"):
        check_channel("0.0")
    assert unspecified_address("0.0") == "0.0.0.0" and unspecified_address("[::]") == "::"
    assert unspecified_address("10.1.2.3") == "" and unspecified_address("client.example.com") == ""


@pytest.mark.parametrize("channel", ["auto", "off", "10.1.2.3", "1.2", "fe80::1", "fe80::1%lo", "::1",
                                     "client.example.com", "host-0"])
def test_specific_addresses_and_names_pass(channel: str) -> None:
    check_channel(channel)


def test_an_ipv6_address_in_brackets_is_refused_with_the_fix() -> None:
    # The channel cannot bind "[fe80::1]": it fell back to listening everywhere.
    with pytest.raises(ConfigError, match=r"launch.channel='\[fe80::1\]' is an IPv6 address in brackets") as info:
        check_channel("[fe80::1]")
    assert "launch.channel='fe80::1'" in (info.value.hint or "")


def test_a_host_name_that_resolves_to_the_unspecified_address_is_refused_on_the_driver(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # An /etc/hosts line "0.0.0.0 blocked.example" (as ad blockers write): the resolver's answer decides.
    answers = {"blocked.example": "0.0.0.0", "good.example": "10.0.0.5"}

    def resolver(host: str, *args: object, flags: int = 0, **kwargs: object) -> list[tuple]:  # type: ignore[type-arg]
        if host not in answers or flags & socket.AI_NUMERICHOST:  # as the real one: no name lookup then
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (answers[host], 0))]

    monkeypatch.setattr(channel_checks.socket, "getaddrinfo", resolver)
    check_channel("blocked.example")  # a name: the options' check does no lookup
    with pytest.raises(ConfigError, match=r"'blocked.example' is a wildcard address \(it resolves to 0.0.0.0"):
        channel_checks.check_channel_reachable("spark://10.1.2.3:7077", "blocked.example")
    channel_checks.check_channel_reachable("spark://10.1.2.3:7077", "good.example")
    channel_checks.check_channel_reachable("spark://10.1.2.3:7077", "unknown.example")  # the bind says so later


SECRETS = ("hunter2", "wJalrXUtnFEMI/K7MDENG", "AKIAIOSFODNN7EXAMPLE", "ghp_abcdefghijklmnopqrstuvwxyz0123456789",
           "eyJhbGciOiJIUzI1NiJ9.e30.sig")
USER_ERROR = ("OSError: cannot open s3://AKIAIOSFODNN7EXAMPLE:wJalrXUtnFEMI/K7MDENG@bucket/data "
              "(password=hunter2, token ghp_abcdefghijklmnopqrstuvwxyz0123456789, "
              "header Bearer eyJhbGciOiJIUzI1NiJ9.e30.sig)")


@pytest.mark.parametrize("kind", [TrainingError, ConfigError, SparkdlError])
def test_an_errors_text_masks_credentials(kind: type[SparkdlError]) -> None:
    error = kind(f"training failed on rank 1: {USER_ERROR}", hint="retry with password: hunter2")
    for text in (str(error), error.message, error.hint or ""):
        assert not any(secret in text for secret in SECRETS), text
    assert "s3://***:***@bucket/data" in error.message and "rank 1: OSError: cannot open" in error.message
    assert str(pickle.loads(pickle.dumps(error))) == str(error)


def test_a_rank_function_error_masks_its_message_and_traceback() -> None:
    error = RankFunctionError(f"f failed on rank 0: {USER_ERROR}", rank=0, exception_type="OSError",
                              exception_message=USER_ERROR, rank_traceback=f'  File "x.py", line 3\n{USER_ERROR}\n')
    for text in (str(error), error.exception_message, error.rank_traceback):
        assert not any(secret in text for secret in SECRETS), text
    assert error.exception_type == "OSError" and error.rank == 0


def test_texts_without_credentials_are_unchanged() -> None:
    text = ("train.lr must be a finite number, got nan; KeyError: 'label'; override 'x' is not of the form "
            "section.option=value; hdfs://user@nn:8020/p; http://host:8080/a/b@c.com")
    assert str(ConfigError(text)) == text


def test_masking_holds_whatever_module_is_imported_first() -> None:
    """The rule is installed by sparkdl/__init__, which any `import sparkdl.x` runs first."""
    code = "from sparkdl.errors import TrainingError; print(TrainingError('https://u:hunter2@h/x token=abc'))"
    shown = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert shown.strip() == "https://u:***@h/x token=***"
