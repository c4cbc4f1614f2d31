"""Every minor release 0.14..0.34 has its behaviour; any other vLLM is a
start-up error naming it and the supported range; the README's table is
the changes versions.py applies."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kvlink_vllm import ConfigError, versions

README = Path(__file__).resolve().parent.parent / "README.md"


@pytest.mark.parametrize(
    "version,reported,hit_source",
    [
        ("0.14.0", False, None),
        ("0.14.1", False, None),
        ("0.14.0+cpu", False, None),
        ("0.15.1", False, None),
        ("0.16.0", True, None),
        ("0.24.2rc1", True, None),
        ("0.31.0", True, None),
        ("0.32.0", True, "P2P"),
        ("0.32.1+cpu", True, "P2P"),
        ("0.34.0", True, "P2P"),
    ],
)
def test_supported_releases_pass_with_their_behaviour(version, reported, hit_source):
    behaviour = versions.check(version, allow_unsupported=False)
    assert behaviour.release == versions.release(version)
    # 0.14 and 0.15 free an aborted pull's blocks at once; later releases wait for the report.
    assert behaviour.report_abandoned_pulls is reported
    assert behaviour.cache_hit_source == hit_source


def test_every_minor_release_between_the_oldest_and_newest_is_supported():
    assert versions.SUPPORTED == tuple((0, minor) for minor in range(14, 35))
    assert set(versions.BEHAVIOURS) == set(versions.SUPPORTED)
    assert versions.NEWEST.release == (0, 34)


@pytest.mark.parametrize("version", ["0.13.0", "0.35.0", "1.0.0", "unknown", ""])
def test_other_releases_are_a_start_up_error_naming_both(version):
    with pytest.raises(ConfigError) as e:
        versions.check(version, allow_unsupported=False)
    assert f"the installed vLLM is {version}" in str(e.value)
    assert "0.14.x to 0.34.x" in str(e.value) and versions.ENV_ALLOW in str(e.value)


def test_the_override_only_warns_and_runs_as_the_newest(caplog, monkeypatch):
    monkeypatch.setenv(versions.ENV_ALLOW, "1")
    with caplog.at_level(logging.WARNING, logger="kvlink_vllm"):
        behaviour = versions.check("0.35.0")
    assert any("0.35.0" in r.getMessage() for r in caplog.records)
    assert behaviour is versions.NEWEST and behaviour.release == (0, 34)


def test_changes_are_in_release_order_and_each_field_is_set_by_one():
    fields = set(versions.Behaviour.__dataclass_fields__) - {"release"}
    assert [c.since for c in versions.CHANGES] == sorted(c.since for c in versions.CHANGES)
    assert all(versions.OLDEST < c.since <= versions.NEWEST_RELEASE for c in versions.CHANGES)
    setting = [c.field for c in versions.CHANGES if c.field is not None]
    assert sorted(setting) == sorted(fields), "every field is set by exactly one change"
    for change in versions.CHANGES:
        if change.field is None:
            continue
        # The release that brings it has it, the one before does not.
        before = versions.BEHAVIOURS[(change.since[0], change.since[1] - 1)]
        assert getattr(versions.BEHAVIOURS[change.since], change.field) == change.value
        assert getattr(before, change.field) != change.value, change


def test_the_readme_table_lists_every_change():
    rows = README.read_text().splitlines()
    for change in versions.CHANGES:
        since = f"{change.since[0]}.{change.since[1]}"
        row = f"| {since} | {change.what} | {change.does} |"
        assert row in rows, f"README.md's release table has no row\n{row}"
