"""kvlink settings from kv_connector_extra_config and the reference's environment variables."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from conftest import collected, free_port, step_until
from kvsim import FakeTensor

from kvlink_vllm import ConfigError, _native, adapter

ALL_KEYS = {
    "mooncake_protocol": "tcp",
    "num_workers": 3,
    "queue_depth": 7,
    "transfer_timeout": 2.5,
    "connect_timeout": 1,
    "bootstrap_timeout": 12,
    "bootstrap_server_address": "127.0.0.1:8998",
    "lease_renewal": 0,
    "advertised_host": "p.example",
    "bind_host": "127.0.0.1",
    "host_staging": "always",
    "staging_bytes": 1 << 20,
    "staging_wait": 1.5,
    "staging_piece_bytes": 1 << 16,
    "side_channel_max_handshakes": 32,
    "side_channel_max_handshakes_per_host": 32,
    "side_channel_max_connections": 100,
    "data_max_handshakes": 128,
    "data_max_handshakes_per_host": 64,
    "data_max_connections": 0,
    "side_channel_handshake_timeout": 2,
    "data_handshake_timeout": 0.5,
}


def settings(extra: dict, role: str = "kv_producer") -> _native.Settings:
    return adapter.settings_from_transfer_config(
        SimpleNamespace(kv_role=role, engine_id="e", kv_connector_extra_config=extra)
    )


def test_every_documented_key_is_accepted(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("s3cret\n")
    s = settings({**ALL_KEYS, "auth_secret_file": str(secret), "tcp_authenticate_payloads": True})
    assert (s.protocol, s.num_workers, s.advertised_host) == ("tcp", 3, "p.example")
    assert (s.host_staging, s.staging_bytes, s.staging_wait) == ("always", 1 << 20, 1.5)
    assert s.staging_piece_bytes == 1 << 16
    assert (s.bootstrap_timeout, s.bootstrap_server_address) == (12.0, ("127.0.0.1", 8998))
    assert settings({}).bootstrap_server_address is None, "unset: the instance runs its own"
    assert s.auth_secret_file == str(secret)
    assert s.tcp_authenticate_payloads and not settings({}).tcp_authenticate_payloads
    assert dict(s.listener_limits) == {k: v for k, v in ALL_KEYS.items() if "max_" in k}
    assert all(v is None for _, v in settings({}).listener_limits), "unset: the worker's defaults"
    assert dict(s.handshake_timeouts) == {"side_channel_handshake_timeout": 2.0, "data_handshake_timeout": 0.5}
    assert all(v is None for _, v in settings({}).handshake_timeouts), "unset: the worker's defaults"
    secret_keys = {"auth_secret_file", "tcp_authenticate_payloads"}
    assert {k for k, _ in _native.Settings.known_keys()} == set(ALL_KEYS) | secret_keys


def test_other_vllm_connectors_keys_are_accepted_ignored_and_logged(caplog):
    nixl = {"backends": ["UCX"], "num_threads": 4, "enforce_handshake_compat": True, "num_workers": 3}
    with caplog.at_level("INFO", logger="kvlink_vllm"):
        s = settings(nixl)
    assert s.num_workers == 3
    assert sorted(s.ignored_keys) == [
        ("backends", "NixlConnector"),
        ("enforce_handshake_compat", "NixlConnector"),
        ("num_threads", "NixlConnector"),
    ]
    lines = [r.getMessage() for r in caplog.records if "ignores" in r.getMessage()]
    assert len(lines) == 1 and "backends (NixlConnector)" in lines[0], lines
    # A typo of kvlink's own key is still an error, beside foreign ones.
    with pytest.raises(ConfigError, match=r"unknown key kv_connector_extra_config\.transfer_timout\b"):
        settings({"backends": ["UCX"], "transfer_timout": 5})


def test_vllm_0_32_connectors_keys_are_accepted_and_ignored():
    # Keys NIXL, Mooncake and MoRIIO read in vLLM 0.32 (and not in 0.14).
    later = {
        "kv_lease_duration": 30,
        "kv_recompute_threshold": 64,
        "bidirectional_kv_xfer": True,
        "decoder_kv_blocks_ttl": 30.0,
        "push_registration_timeout": 5.0,
        "engine_ttl": 60.0,
        "device_name": "",
        "backend": "rdma",
        "host_ip": "127.0.0.1",
        "defer_timeout": 5,
        "post_batch_size": 8,
        "qp_per_transfer": 1,
        "read_mode": True,
        "recv_abort_timeout": 30,
    }
    s = settings(later)
    assert sorted(name for name, _ in s.ignored_keys) == sorted(later)


def test_unknown_key_is_an_error_naming_it():
    with pytest.raises(ConfigError, match=r"unknown key kv_connector_extra_config\.num_worker\b"):
        settings({"num_worker": 4})


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"mooncake_protocol": "nvlink"}, "mooncake_protocol"),
        ({"num_workers": 0}, "num_workers"),
        ({"queue_depth": "8"}, "queue_depth"),
        ({"transfer_timeout": -1}, "transfer_timeout"),
        ({"connect_timeout": "5s"}, "connect_timeout"),
        ({"lease_renewal": -3}, "lease_renewal"),
        ({"advertised_host": ""}, "advertised_host"),
        ({"bind_host": "not-an-ip"}, "bind_host"),
        ({"auth_secret_file": "/nonexistent/kvlink-secret"}, "/nonexistent/kvlink-secret"),
        ({"host_staging": "sometimes"}, "host_staging"),
        ({"host_staging": True}, "host_staging"),
        ({"staging_bytes": 0}, "staging_bytes"),
        ({"staging_bytes": "4G"}, "staging_bytes"),
        ({"staging_bytes": 4.5e9}, "staging_bytes"),
        ({"staging_bytes": 1 << 51}, "staging_bytes"),
        ({"staging_wait": 0}, "staging_wait"),
        ({"staging_wait": "1s"}, "staging_wait"),
        ({"staging_piece_bytes": -1}, "staging_piece_bytes"),
        ({"staging_piece_bytes": "32M"}, "staging_piece_bytes"),
        ({"staging_piece_bytes": 1 << 51}, "staging_piece_bytes"),
        ({"side_channel_max_handshakes": 0}, r"side_channel_max_handshakes = 0 is invalid"),
        ({"data_max_handshakes_per_host": "16"}, r'data_max_handshakes_per_host = "16" is invalid'),
        ({"data_max_connections": -1}, r"data_max_connections = -1 is invalid"),
        ({"tcp_authenticate_payloads": True}, r"tcp_authenticate_payloads = true needs .*auth_secret_file"),
        ({"tcp_authenticate_payloads": "yes", "auth_secret_file": "/s"}, r'tcp_authenticate_payloads = "yes" is invalid'),
    ],
)
def test_bad_values_name_the_key(extra, named):
    with pytest.raises(ConfigError, match=named):
        settings(extra)


def test_staging_defaults():
    s = settings({})
    # Staging only for a cache outside host memory; 4 GiB; waits as long as
    # a pull; requests copied and sent in pieces of 32 MiB.
    assert (s.host_staging, s.staging_bytes, s.staging_wait) == ("auto", 4 << 30, None)
    assert s.staging_piece_bytes == 32 << 20
    assert settings({"staging_piece_bytes": 0}).staging_piece_bytes == 0


def test_reference_environment_variables_are_honoured(monkeypatch):
    monkeypatch.setenv("VLLM_MOONCAKE_BOOTSTRAP_PORT", "9100")
    monkeypatch.setenv("VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT", "12.5")
    s = settings({})
    assert (s.bootstrap_port, s.abort_request_timeout) == (9100, 12.5)
    monkeypatch.setenv("VLLM_MOONCAKE_BOOTSTRAP_PORT", "0")
    with pytest.raises(ConfigError, match="VLLM_MOONCAKE_BOOTSTRAP_PORT"):
        settings({})


@pytest.mark.parametrize("protocol", ["quic", "rdma"])
def test_protocol_not_in_this_build_fails_at_start(protocol):
    if protocol in _native.compiled_protocols():
        pytest.skip(f"{protocol} is compiled in")
    import ctypes
    import mmap

    mm = mmap.mmap(-1, 2 * 4 * 16 * 16 * 2)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    side = adapter.WorkerSide(settings({"mooncake_protocol": protocol}, "kv_consumer"), "127.0.0.1", block_size=16)
    with pytest.raises(ConfigError, match=f'mooncake_protocol = "{protocol}" is not compiled'):
        side.register_kv_caches({"l": FakeTensor(mm, addr, (2, 4, 1, 16, 16), 2)})


def test_auth_secret_mismatch_fails_the_pull_and_match_succeeds(instances, tmp_path):
    good, bad = tmp_path / "good", tmp_path / "bad"
    good.write_text("the-shared-secret")
    bad.write_text("another-secret")
    port = free_port()
    # P and D1 tag payloads too (TCP): the pull still lands whole.
    tagged = {"auth_secret_file": str(good), "tcp_authenticate_payloads": True}
    p = instances("P", "kv_producer", extra=tagged, env={"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(port)})
    d_ok = instances("D1", "kv_consumer", extra=tagged)
    d_bad = instances("D2", "kv_consumer", extra={"auth_secret_file": str(bad)})
    for rid in ("a", "b"):
        p.call("add", request_id=rid, prompt_len=32, params={"do_remote_decode": True})
    ev = p.call("step")
    params = {rid: ev["finished"][rid]["kv_transfer_params"] for rid in ("a", "b")}
    d_ok.call("add", request_id="a", prompt_len=32, params=params["a"], max_tokens=100)
    d_bad.call("add", request_id="b", prompt_len=32, params=params["b"], max_tokens=100)
    ev = step_until(
        [p, d_ok, d_bad],
        lambda e: "a" in collected(e["D1"], "finished_recving") and "b" in collected(e["D2"], "finished_recving"),
        what="both pulls ended",
    )
    assert collected(ev["D1"], "invalid_block_ids") == []
    assert d_ok.call("verify", request_id="a")["bad"] == []
    # The D without the secret is refused: a failed load, its blocks reported.
    assert sorted(collected(ev["D2"], "invalid_block_ids")) == d_bad.call("verify", request_id="b")["blocks"]
    assert json.dumps(p.call("state")["violations"]) == "[]"


def test_the_model_identity_is_read_from_vllms_config_and_what_is_missing_is_undeclared():
    from types import SimpleNamespace

    from kvlink_vllm.connector import model_identity

    hf = SimpleNamespace(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        to_json_string=lambda use_diff=False: '{"hidden_size": 64, "_name_or_path": "/a"}',
    )
    config = SimpleNamespace(
        model_config=SimpleNamespace(
            model="tiny-llama",
            dtype="torch.bfloat16",
            hf_config=hf,
            hf_text_config=SimpleNamespace(num_hidden_layers=2),
            get_total_num_kv_heads=lambda: 4,
            get_head_size=lambda: 16,
        ),
        cache_config=SimpleNamespace(cache_dtype="auto"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
    )
    identity = model_identity(config)
    assert identity["model"] == "LlamaForCausalLM", "the architecture, not the path or served name"
    assert identity["kv_dtype"] == "bfloat16"
    assert identity["cache_dtype"] == "auto"
    assert (identity["num_layers"], identity["num_kv_heads"], identity["head_size"]) == (2, 4, 16)
    assert (identity["tp_size"], identity["pp_size"]) == (1, 1)
    assert len(identity["config_hash"]) == 16
    # Another architecture config, another hash; nothing readable, nothing declared.
    other = SimpleNamespace(**{**vars(config), "model_config": SimpleNamespace(**{**vars(config.model_config), "hf_config": SimpleNamespace(to_json_string=lambda use_diff=False: '{"hidden_size": 32}')})})
    moved = SimpleNamespace(**{**vars(config), "model_config": SimpleNamespace(**{**vars(config.model_config), "hf_config": SimpleNamespace(to_json_string=lambda use_diff=False: '{"hidden_size": 64, "_name_or_path": "/b"}')})})
    assert model_identity(moved)["config_hash"] == identity["config_hash"], "the same model at another path"
    assert model_identity(other)["config_hash"] != identity["config_hash"]
    typed = SimpleNamespace(**{**vars(config), "model_config": SimpleNamespace(**{**vars(config.model_config), "hf_config": SimpleNamespace(model_type="llama")})})
    assert model_identity(typed)["model"] == "llama", "no architectures: the model type"
    bare = model_identity(SimpleNamespace())
    assert all(v in ("", 0) for v in bare.values()), bare
