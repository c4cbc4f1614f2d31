"""An unsupported vLLM is a start-up error naming it and the supported range."""

from __future__ import annotations

import logging

import pytest

from kvlink_vllm import ConfigError, versions


@pytest.mark.parametrize("version", ["0.14.0", "0.14.1", "0.14.0+cpu", "0.14.2rc1"])
def test_supported_releases_pass(version):
    versions.check(version, allow_unsupported=False)


@pytest.mark.parametrize("version", ["0.13.0", "0.15.0", "0.32.0", "1.0.0", "unknown", ""])
def test_other_releases_are_a_start_up_error_naming_both(version):
    with pytest.raises(ConfigError) as e:
        versions.check(version, allow_unsupported=False)
    assert f"the installed vLLM is {version}" in str(e.value)
    assert "0.14.x" in str(e.value) and versions.ENV_ALLOW in str(e.value)


def test_the_override_only_warns(caplog, monkeypatch):
    monkeypatch.setenv(versions.ENV_ALLOW, "1")
    with caplog.at_level(logging.WARNING, logger="kvlink_vllm"):
        versions.check("0.32.0")
    assert any("0.32.0" in r.getMessage() for r in caplog.records)
