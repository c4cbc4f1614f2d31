"""An unsupported vLLM is a start-up error naming it and the supported range."""

from __future__ import annotations

import logging

import pytest

from kvlink_vllm import ConfigError, versions


@pytest.mark.parametrize(
    "version,reported",
    [("0.14.0", False), ("0.14.1", False), ("0.14.0+cpu", False), ("0.14.2rc1", False), ("0.32.0", True), ("0.32.1+cpu", True)],
)
def test_supported_releases_pass_with_their_behaviour(version, reported):
    behaviour = versions.check(version, allow_unsupported=False)
    assert behaviour.release == versions.release(version)
    # 0.14 frees an aborted pull's blocks at once; 0.32 waits for the report.
    assert behaviour.report_abandoned_pulls is reported
    assert (behaviour.cache_hit_source is None) is (not reported)


@pytest.mark.parametrize("version", ["0.13.0", "0.15.0", "0.31.2", "0.33.0", "1.0.0", "unknown", ""])
def test_other_releases_are_a_start_up_error_naming_both(version):
    with pytest.raises(ConfigError) as e:
        versions.check(version, allow_unsupported=False)
    assert f"the installed vLLM is {version}" in str(e.value)
    assert "0.14.x, 0.32.x" in str(e.value) and versions.ENV_ALLOW in str(e.value)


def test_the_override_only_warns_and_runs_as_the_newest(caplog, monkeypatch):
    monkeypatch.setenv(versions.ENV_ALLOW, "1")
    with caplog.at_level(logging.WARNING, logger="kvlink_vllm"):
        behaviour = versions.check("0.33.0")
    assert any("0.33.0" in r.getMessage() for r in caplog.records)
    assert behaviour is versions.NEWEST and behaviour.release == (0, 32)
