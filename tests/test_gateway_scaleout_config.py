"""``[server] workers`` and ``[state]``: read from the file and the flags, every mistake named
before any I/O, and the Redis URL's password never in a repr or an error."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from trio_hedge.gateway import ConfigError, GatewayConfig, StateConfig, parse_config
from trio_hedge.gateway._config import with_flags

BASE: dict[str, Any] = {"replicas": [{"base_url": "http://10.0.0.1:8000/v1"}]}
SECRET = "s3cret-pass-9876"


def test_defaults_share_nothing_and_run_one_process() -> None:
    config = parse_config(BASE)
    assert config.workers == 1
    assert config.state == StateConfig(None, "trio-hedge", False, 0.25)


def test_the_state_table_is_read() -> None:
    document = {
        **BASE,
        "server": {"workers": 4},
        "state": {"redis_url": "redis://10.0.0.5:6379/2", "prefix": "team-a", "timeout": 0.5},
    }
    config = parse_config(document)
    assert config.workers == 4
    assert config.state == StateConfig("redis://10.0.0.5:6379/2", "team-a", False, 0.5)
    secret = parse_config(
        {**BASE, "state": {"redis_url_env": "R", "fail_closed": True}},
        environ={"R": f"redis://:{SECRET}@h:6379/0"},
    )
    assert secret.state.redis_url == f"redis://:{SECRET}@h:6379/0"
    assert secret.state.fail_closed is True
    assert SECRET not in repr(secret) and "redis://***@h:6379/0" in repr(secret)
    assert parse_config({**BASE, "state": {"redis_url": False}}).state.redis_url is None


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ({"redis_url": f"http://u:{SECRET}@h"}, "state: redis_url must start with redis://"),
        ({"redis_url": f"redis://u:{SECRET}@h:99999"}, "state: redis_url is not a valid URL"),
        ({"redis_url": 5}, "state: redis_url must be a string"),
        ({"redis_url": "redis://h", "redis_url_env": "R"}, "give redis_url or redis_url_env"),
        ({"redis_url_env": "NOT_SET_ANYWHERE"}, "NOT_SET_ANYWHERE is not set"),
        ({"timeout": 0}, "timeout must be seconds in (0, 10]"),
        ({"timeout": 11}, "timeout must be seconds in (0, 10]"),
        ({"prefix": "a b"}, "prefix must be printable, without spaces or braces"),
        ({"prefix": ""}, "prefix must have 1 to 64 characters"),
        ({"fail_closed": "yes"}, "fail_closed"),
        ({"redis": "x"}, "state: unknown field 'redis'"),
    ],
)
def test_state_mistakes_are_named_never_quoting_the_url(
    state: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({**BASE, "state": state}, environ={"R": "redis://h"})
    assert message in str(info.value)
    assert SECRET not in str(info.value)


@pytest.mark.parametrize("workers", [0, 65, True, "2"])
def test_workers_are_bounded(workers: object) -> None:
    with pytest.raises(ConfigError, match=r"workers must be an int in 1\.\.64"):
        parse_config({**BASE, "server": {"workers": workers}})


def test_the_flag_overrides_the_file() -> None:
    config = parse_config({**BASE, "server": {"workers": 4}})
    assert with_flags(config, workers=2).workers == 2
    assert with_flags(config).workers == 4
    with pytest.raises(ConfigError, match="workers"):
        with_flags(config, workers=100)
    assert isinstance(with_flags(None, replicas=["http://h/v1"], workers=3), GatewayConfig)


def test_a_bad_workers_flag_is_one_line_and_exit_2() -> None:
    # A process of its own: `serve` sets up the process's logging (not a test's to change).
    command = [sys.executable, "-m", "trio_hedge", "serve", "--replica", "http://h/v1"]
    done = subprocess.run(
        [*command, "--workers", "0", "--port", "0"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "workers must be an int in 1..64" in done.stderr
