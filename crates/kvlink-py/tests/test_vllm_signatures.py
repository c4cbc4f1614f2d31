"""KvlinkConnector against each supported vLLM release's connector base
class: method names and signatures as in that release's
``KVConnectorBase_V1``, and a name the factory's registry does not shadow.
The releases' source distributions are fetched from the package index
(``vllm_check/vllm_sdist.py``, sha256-pinned) and read as source text:
nothing of vLLM is imported."""

from __future__ import annotations

import ast
import inspect
import os
import sys
from pathlib import Path

import pytest

from kvlink_vllm import versions
from kvlink_vllm.connector import KvlinkConnector

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "vllm_check"))
import vllm_sdist  # noqa: E402

BASE = vllm_sdist.BASE
FACTORY = vllm_sdist.FACTORY
#: Not abstract in the base, but a P/D connector must implement them.
NEEDED = {"__init__", "request_finished", "register_kv_caches", "get_finished", "get_block_ids_with_load_errors", "shutdown"}
#: kvlink's metrics reach vLLM's log line and /metrics through these.
NEEDED |= {"get_kv_connector_stats", "build_kv_connector_stats", "build_prom_metrics"}
#: The abstract methods of each release's base class.
ABSTRACT = {
    "start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save",
    "get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
}  # fmt: skip
#: Methods of KvlinkConnector that only later releases' base classes have
#: (an earlier release never calls them).
LATER_ONLY = {
    "get_loaded_kv_cache_group_ids": "0.32.0",
    "supports_sleep_mode": "0.33.0",
    "kv_cache_access": "0.34.0",
}


def _cache() -> Path:
    cache = os.environ.get("KVLINK_VLLM_DIST_DIR")
    return Path(cache) if cache else vllm_sdist.cache_dir()


@pytest.fixture(scope="module", params=sorted(vllm_sdist.SHA256, key=versions.release))
def vllm_sources(request) -> tuple[str, dict[str, str]]:
    release = request.param
    return release, vllm_sdist.read(release, _cache(), BASE, FACTORY)


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise AssertionError(f"class {name} not found")


def _decorators(fn: ast.FunctionDef) -> set[str]:
    return {d.id if isinstance(d, ast.Name) else getattr(d, "attr", "") for d in fn.decorator_list}


def _ast_signature(fn: ast.FunctionDef) -> list[tuple]:
    """[(name, kind, default)] as inspect names them."""
    a = fn.args
    positional = a.posonlyargs + a.args
    defaults = [None] * (len(positional) - len(a.defaults)) + [ast.literal_eval(d) for d in a.defaults]
    has_default = [False] * (len(positional) - len(a.defaults)) + [True] * len(a.defaults)
    out = []
    for i, arg in enumerate(positional):
        kind = "POSITIONAL_ONLY" if arg in a.posonlyargs else "POSITIONAL_OR_KEYWORD"
        out.append((arg.arg, kind, defaults[i] if has_default[i] else "<required>"))
    if a.vararg:
        out.append((a.vararg.arg, "VAR_POSITIONAL", "<required>"))
    for arg, d in zip(a.kwonlyargs, a.kw_defaults):
        out.append((arg.arg, "KEYWORD_ONLY", ast.literal_eval(d) if d is not None else "<required>"))
    if a.kwarg:
        out.append((a.kwarg.arg, "VAR_KEYWORD", "<required>"))
    return out


def _our_signature(fn) -> list[tuple]:
    sig = inspect.signature(fn)
    return [
        (p.name, p.kind.name, "<required>" if p.default is inspect.Parameter.empty else p.default)
        for p in sig.parameters.values()
    ]


def _accepts(ours: list[tuple], theirs: list[tuple]) -> bool:
    """Same parameters (names, kinds) and defaults, except that ours may
    default one theirs requires (``kv_cache_config``: optional in 0.14,
    required in 0.32): every call valid for theirs is valid for ours."""
    return len(ours) == len(theirs) and all(
        o[:2] == t[:2] and (o[2] == t[2] or t[2] == "<required>") for o, t in zip(ours, theirs)
    )


def test_methods_match_each_releases_base_class(vllm_sources):
    release, sources = vllm_sources
    base = _class(ast.parse(sources[BASE]), "KVConnectorBase_V1")
    methods = {n.name: n for n in base.body if isinstance(n, ast.FunctionDef)}
    abstract = {name for name, fn in methods.items() if "abstractmethod" in _decorators(fn)}
    assert abstract == ABSTRACT, release
    ours = {name: fn for name, fn in vars(KvlinkConnector).items() if callable(fn) or isinstance(fn, (classmethod, property))}
    missing = (abstract | NEEDED) - set(ours)
    assert not missing, f"KvlinkConnector lacks {sorted(missing)}"
    for name, fn in ours.items():
        if name.startswith("_") and name != "__init__":
            continue
        if name not in methods and name in LATER_ONLY and versions.release(release) < versions.release(LATER_ONLY[name]):
            continue
        assert name in methods, f"KvlinkConnector.{name} is not a method of vLLM {release}'s KVConnectorBase_V1"
        theirs = methods[name]
        assert ("classmethod" in _decorators(theirs)) == isinstance(fn, classmethod), name
        assert ("property" in _decorators(theirs)) == isinstance(fn, property), name
        if isinstance(fn, property):
            continue
        if isinstance(fn, classmethod):  # build_kv_connector_stats, build_prom_metrics: `cls` first
            fn = fn.__func__
        assert _accepts(_our_signature(fn), _ast_signature(theirs)), f"signature of {name} differs from vLLM {release}"


def test_every_later_only_method_is_in_the_newest_base_class(vllm_sources):
    release, sources = vllm_sources
    base = _class(ast.parse(sources[BASE]), "KVConnectorBase_V1")
    methods = {n.name for n in base.body if isinstance(n, ast.FunctionDef)}
    for name, since in LATER_ONLY.items():
        assert (name in methods) == (versions.release(release) >= versions.release(since)), (name, release)


def test_name_is_not_shadowed_by_the_factory_registry(vllm_sources):
    _, sources = vllm_sources
    tree = ast.parse(sources[FACTORY])
    registered = {
        node.args[0].value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and getattr(node.func, "attr", "") == "register_connector"
        and node.args
        and isinstance(node.args[0], ast.Constant)
    }
    assert "MooncakeConnector" in registered and "NixlConnector" in registered
    assert KvlinkConnector.__name__ not in registered
    # The class loads through kv_connector_module_path exactly as the factory does it.
    import importlib

    assert getattr(importlib.import_module("kvlink_vllm"), "KvlinkConnector") is KvlinkConnector
