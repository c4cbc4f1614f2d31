"""KvlinkConnector against the released vLLM 0.14.0: method names and
signatures as in ``KVConnectorBase_V1``, and a name the factory's registry
does not shadow. The wheel is fetched from the package registry (pip
download, no install) and read as source text: nothing of vLLM is imported."""

from __future__ import annotations

import ast
import inspect
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from kvlink_vllm.connector import KvlinkConnector

VLLM_VERSION = "0.14.0"
BASE = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"
FACTORY = "vllm/distributed/kv_transfer/kv_connector/factory.py"
#: Not abstract in the base, but a P/D connector must implement them.
NEEDED = {"__init__", "request_finished", "register_kv_caches", "get_finished", "get_block_ids_with_load_errors", "shutdown"}


@pytest.fixture(scope="module")
def vllm_sources(pytestconfig, tmp_path_factory) -> dict[str, str]:
    cache = os.environ.get("KVLINK_VLLM_DIST_DIR")
    if not cache:
        keep = getattr(pytestconfig, "cache", None)  # absent with -p no:cacheprovider
        cache = str(keep.mkdir("vllm-dist") if keep else tmp_path_factory.mktemp("vllm-dist"))
    wheels = sorted(Path(cache).glob(f"vllm-{VLLM_VERSION}-*.whl"))
    if not wheels:
        cmd = [
            sys.executable, "-m", "pip", "download", f"vllm=={VLLM_VERSION}", "--no-deps",
            "--only-binary", ":all:", "--platform", "manylinux_2_31_x86_64", "--python-version", "3.12",
            "--dest", cache, "--quiet",
        ]
        subprocess.run(cmd, check=True, timeout=600)
        wheels = sorted(Path(cache).glob(f"vllm-{VLLM_VERSION}-*.whl"))
    assert wheels, f"pip download left no vllm {VLLM_VERSION} wheel in {cache}"
    with zipfile.ZipFile(wheels[0]) as z:
        return {name: z.read(name).decode() for name in (BASE, FACTORY)}


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


def test_methods_match_vllm_0_14_base_class(vllm_sources):
    base = _class(ast.parse(vllm_sources[BASE]), "KVConnectorBase_V1")
    methods = {n.name: n for n in base.body if isinstance(n, ast.FunctionDef)}
    abstract = {name for name, fn in methods.items() if "abstractmethod" in _decorators(fn)}
    assert abstract == {
        "start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save",
        "get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
    }
    ours = {name: fn for name, fn in vars(KvlinkConnector).items() if callable(fn) or isinstance(fn, (classmethod, property))}
    missing = (abstract | NEEDED) - set(ours)
    assert not missing, f"KvlinkConnector lacks {sorted(missing)}"
    for name, fn in ours.items():
        if name.startswith("_") and name != "__init__":
            continue
        assert name in methods, f"KvlinkConnector.{name} is not a method of vLLM {VLLM_VERSION}'s KVConnectorBase_V1"
        theirs = methods[name]
        assert ("classmethod" in _decorators(theirs)) == isinstance(fn, classmethod), name
        assert ("property" in _decorators(theirs)) == isinstance(fn, property), name
        if isinstance(fn, (classmethod, property)):
            continue
        assert _our_signature(fn) == _ast_signature(theirs), f"signature of {name} differs from vLLM {VLLM_VERSION}"


def test_name_is_not_shadowed_by_the_factory_registry(vllm_sources):
    tree = ast.parse(vllm_sources[FACTORY])
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
