"""pytest plugin: vLLM's own KV-connector unit tests
(``tests/v1/kv_connector/unit/`` of the release's source distribution),
run against ``KvlinkConnector`` (``cargo xtask vllm-check``).

Those tests build their engine config through their ``utils.py``
(``create_vllm_config``), which names vLLM's NIXL connector and the
``facebook/opt-125m`` model of the hub. This plugin, before any test runs:

* makes every ``KVTransferConfig`` those helpers build for the NIXL
  connector name ``KvlinkConnector`` from ``kvlink_vllm`` instead, in the
  role ``kv_both`` (NIXL's connector prefills for a remote decode and
  decodes a remote prefill whatever the role says; kvlink does both in
  ``kv_both`` only), with the same extra config (kvlink accepts and ignores
  NIXL's keys); tests that choose another connector on purpose keep it;
* points ``ModelConfig`` at a tiny local checkpoint (``$KVLINK_TINY_MODEL``,
  made by ``engine_test/make_model.py``) in place of the hub's model;
* deselects exactly the tests ``unit_manifest.py`` lists for the release,
  and prints each with its reason; a file of the directory that the
  manifest neither runs nor lists is an error, so nothing is skipped
  silently.

Run from the unit directory with ``-p kvlink_unit_plugin`` (``vllm_check/``
on ``PYTHONPATH``) and ``KVLINK_VLLM_RELEASE`` set: only the manifest's
files are collected.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

import unit_manifest

#: The hub models the tests name, all replaced by the tiny local checkpoint.
HUB_MODELS = ("facebook/opt-125m",)
KVLINK = {"kv_connector": "KvlinkConnector", "kv_connector_module_path": "kvlink_vllm", "kv_role": "kv_both"}

_release = os.environ.get("KVLINK_VLLM_RELEASE", "")
_patched: set[str] = set()
_deselected: list[tuple[str, str]] = []
#: The unit directory's files not run, with their reasons (known once collected).
_not_run: dict[str, str] = {}
#: KvlinkConnectors made during the run: none would mean the tests ran
#: some other connector.
_made = [0]


def pytest_configure(config: pytest.Config) -> None:
    from kvlink_vllm.connector import KvlinkConnector

    original = KvlinkConnector.__init__

    def counted(self: Any, *args: Any, **kwargs: Any) -> None:
        _made[0] += 1
        original(self, *args, **kwargs)

    KvlinkConnector.__init__ = counted  # type: ignore[method-assign]


def _manifest() -> unit_manifest.Release:
    if _release not in unit_manifest.RELEASES:
        raise pytest.UsageError(f"KVLINK_VLLM_RELEASE={_release!r}; the manifest knows {sorted(unit_manifest.RELEASES)}")
    return unit_manifest.RELEASES[_release]


def _kvlink_transfer_config(original: Any) -> Any:
    def make(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("kv_connector", "NixlConnector") == "NixlConnector" and not args:
            kwargs.update(KVLINK)
        return original(*args, **kwargs)

    make.__wrapped__ = original  # type: ignore[attr-defined]
    return make


def _local_model_config(original: Any, model_dir: str) -> Any:
    def make(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("model") in HUB_MODELS:
            kwargs["model"] = model_dir
        return original(*args, **kwargs)

    make.__wrapped__ = original  # type: ignore[attr-defined]
    return make


def _patch(module: Any) -> None:
    """Rewires one test ``utils`` module (once)."""
    if module.__name__ in _patched:
        return
    model_dir = os.environ.get("KVLINK_TINY_MODEL", "")
    if not model_dir or not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise pytest.UsageError(f"KVLINK_TINY_MODEL={model_dir!r} is not a model directory")
    module.KVTransferConfig = _kvlink_transfer_config(module.KVTransferConfig)
    module.ModelConfig = _local_model_config(module.ModelConfig, model_dir)
    _patched.add(module.__name__)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Only the manifest's files of the unit directory are collected."""
    if collection_path.parent.name != "unit" or collection_path.name.startswith("__"):
        return None
    manifest = _manifest()
    if collection_path.is_dir():
        return collection_path.name + "/" not in manifest.run
    if collection_path.name.startswith("test_") and collection_path.suffix == ".py":
        return collection_path.name not in manifest.run
    return None


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    manifest = _manifest()
    unit_dir = None
    for item in items:
        module = getattr(item, "module", None)
        utils = sys.modules.get(module.__name__.rsplit(".", 1)[0] + ".utils") if module and "." in module.__name__ else None
        if utils is None and module is not None:
            utils = sys.modules.get("utils")
        if utils is not None and hasattr(utils, "create_vllm_config"):
            _patch(utils)
        unit_dir = unit_dir or Path(str(item.path)).parent
    if not _patched:
        raise pytest.UsageError("no test utils module (create_vllm_config) was found to point at KvlinkConnector")

    # Every file of the directory is run or listed with a reason.
    if unit_dir is not None:
        present = unit_manifest.files(unit_dir)
        _not_run.update(manifest.not_run(present))
        unknown = present - set(manifest.run) - set(_not_run)
        if unknown:
            raise pytest.UsageError(f"vLLM {_release}: files neither run nor listed in unit_manifest.py: {sorted(unknown)}")
        missing = set(manifest.run) - present
        if missing:
            raise pytest.UsageError(f"vLLM {_release}: unit_manifest.py runs files the release lacks: {sorted(missing)}")

    keep, drop = [], []
    seen = set()
    for item in items:
        name = item.nodeid.split("/")[-1]
        base = name.split("[", 1)[0]
        reason = manifest.deselected.get(name) or manifest.deselected.get(base)
        if reason is None:
            keep.append(item)
        else:
            seen.add(name if name in manifest.deselected else base)
            drop.append(item)
            _deselected.append((name, reason))
    stale = set(manifest.deselected) - seen
    if stale:
        raise pytest.UsageError(f"vLLM {_release}: unit_manifest.py deselects tests that do not exist: {sorted(stale)}")
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if session.testscollected and not _made[0]:
        print("kvlink_unit_plugin: no KvlinkConnector was made: the tests did not run against kvlink", file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: Any) -> None:
    manifest = _manifest() if _release in unit_manifest.RELEASES else None
    if manifest is None:
        return
    terminalreporter.section(f"vLLM {_release} connector unit tests and KvlinkConnector")
    terminalreporter.write_line(f"KvlinkConnector instances made: {_made[0]}")
    for name, reason in _deselected:
        terminalreporter.write_line(f"deselected {name}: {reason}")
    for name, reason in sorted(_not_run.items()):
        terminalreporter.write_line(f"not run {name}: {reason}")
