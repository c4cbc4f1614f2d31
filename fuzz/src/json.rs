//! `transfer_config_json` and `transfer_params_json`: arbitrary text into
//! the two JSON parsers kvlink exposes to operators and proxies.

use std::time::Duration;

use kv_proto::{
    KvTransferConfig, KvTransferParams, Protocol, DEFAULT_ABORT_REQUEST_TIMEOUT, DEFAULT_BOOTSTRAP_PORT,
    DEFAULT_NUM_WORKERS, ENV_ABORT_REQUEST_TIMEOUT, ENV_BOOTSTRAP_PORT, EXTRA_KEYS, FOREIGN_KEYS,
};
use serde_json::Value;

/// A field of `obj`, with `null` counted as absent (as both parsers do).
fn field<'a>(obj: Option<&'a serde_json::Map<String, Value>>, name: &str) -> Option<&'a Value> {
    obj?.get(name).filter(|v| !v.is_null())
}

/// `KvTransferConfig::from_json` on arbitrary text and environment.
///
/// Input: UTF-8 text of three parts split at the first two newlines: the
/// bootstrap-port variable, the abort-timeout variable (`-` for unset) and
/// the JSON. Checks: no panic, errors display; an accepted config holds
/// exactly what the JSON and the environment say (role, engine id, protocol
/// or none when unset, workers in 1..=4096, non-zero port, positive finite
/// timeout, defaults for what is absent), every key of
/// `kv_connector_extra_config` is kvlink's or another connector's, and
/// exactly the other connectors' are reported ignored; it re-serializes (to
/// the JSON vLLM would pass) and parses back to the same config; parsing is
/// deterministic.
pub fn transfer_config_json(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let mut parts = text.splitn(3, '\n');
    let (Some(port_var), Some(timeout_var), Some(json)) = (parts.next(), parts.next(), parts.next()) else {
        return;
    };
    let var = |s: &str| (s != "-").then(|| s.to_owned());
    let env = |key: &str| match key {
        ENV_BOOTSTRAP_PORT => var(port_var),
        ENV_ABORT_REQUEST_TIMEOUT => var(timeout_var),
        _ => None,
    };
    let parsed = KvTransferConfig::from_json(json, env);
    assert_eq!(parsed, KvTransferConfig::from_json(json, env), "parsing is not deterministic");
    let config = match parsed {
        Ok(config) => config,
        Err(e) => {
            let _ = e.to_string();
            return;
        }
    };

    let Ok(value) = serde_json::from_str::<Value>(json) else { panic!("accepted text that is not JSON: {json:?}") };
    let top = value.as_object();
    assert!(top.is_some(), "accepted a config that is not a JSON object");
    let extra = field(top, "kv_connector_extra_config").and_then(Value::as_object);
    assert_eq!(field(top, "kv_role").and_then(Value::as_str), Some(config.kv_role.as_str()));
    assert_eq!(field(top, "engine_id").and_then(Value::as_str), Some(config.engine_id.as_str()));
    assert!(!config.engine_id.as_str().is_empty(), "accepted an empty engine id");
    // Unset (absent or null) stays unset: the worker, not the parser, picks
    // this build's default.
    match field(extra, "mooncake_protocol") {
        None => assert_eq!(config.protocol, None),
        Some(p) => assert_eq!(p.as_str(), config.protocol.map(Protocol::as_str)),
    }
    let known = |k: &str| EXTRA_KEYS.iter().any(|(key, _)| *key == k);
    let foreign = |k: &str| FOREIGN_KEYS.iter().any(|(key, _)| *key == k);
    let keys: Vec<&String> = extra.map(|m| m.keys().collect()).unwrap_or_default();
    assert!(keys.iter().all(|k| known(k) || foreign(k)), "accepted an unknown key among {keys:?}");
    let ignored: Vec<&str> = config.ignored.iter().map(|(k, _)| k.as_str()).collect();
    let expected: Vec<&str> = keys.iter().map(|k| k.as_str()).filter(|k| foreign(k)).collect();
    assert_eq!(ignored, expected, "the ignored keys are not exactly the other connectors'");
    match field(extra, "num_workers") {
        None => assert_eq!(config.num_workers, DEFAULT_NUM_WORKERS),
        Some(n) => assert_eq!(n.as_u64(), u64::try_from(config.num_workers).ok()),
    }
    assert!((1..=4096).contains(&config.num_workers), "accepted {} workers", config.num_workers);
    match env(ENV_BOOTSTRAP_PORT) {
        None => assert_eq!(config.bootstrap_port, DEFAULT_BOOTSTRAP_PORT),
        Some(p) => assert_eq!(p.trim().parse::<u16>().ok(), Some(config.bootstrap_port)),
    }
    assert_ne!(config.bootstrap_port, 0, "accepted port 0");
    match env(ENV_ABORT_REQUEST_TIMEOUT) {
        None => assert_eq!(config.abort_request_timeout, DEFAULT_ABORT_REQUEST_TIMEOUT),
        Some(_) => assert!(config.abort_request_timeout > Duration::ZERO, "accepted a zero abort timeout"),
    }

    // What vLLM would pass for this config, with the same environment: the
    // extra config as given (its other keys checked above), role and engine
    // id and the two original keys as the config holds them (an unset
    // protocol left out).
    let mut extra_again = extra.cloned().unwrap_or_default();
    extra_again.remove("mooncake_protocol");
    extra_again.insert("num_workers".to_owned(), Value::from(config.num_workers));
    if let Some(protocol) = config.protocol {
        extra_again.insert("mooncake_protocol".to_owned(), Value::from(protocol.as_str()));
    }
    let again = serde_json::json!({
        "kv_connector": "MooncakeConnector",
        "kv_role": config.kv_role.as_str(),
        "engine_id": config.engine_id.as_str(),
        "kv_connector_extra_config": extra_again,
    });
    match KvTransferConfig::from_json(&again.to_string(), env) {
        Ok(back) => assert_eq!(back, config, "a re-serialized config parses differently"),
        Err(e) => panic!("a re-serialized config is refused: {e}"),
    }
}

/// `KvTransferParams::from_json` on arbitrary text.
///
/// Checks: no panic, errors display; accepted params hold exactly what the
/// JSON says (flags default to false, `null` is absent, ports fit `u16`),
/// `remote()` is present exactly when host and port both are, `to_json`
/// round-trips, and `from_value` agrees with `from_json`.
pub fn transfer_params_json(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let params = match KvTransferParams::from_json(text) {
        Ok(params) => params,
        Err(e) => {
            let _ = e.to_string();
            if let Ok(value) = serde_json::from_str::<Value>(text) {
                assert!(KvTransferParams::from_value(&value).is_err(), "from_value accepts what from_json refuses");
            }
            return;
        }
    };
    let Ok(value) = serde_json::from_str::<Value>(text) else { panic!("accepted text that is not JSON: {text:?}") };
    assert_eq!(KvTransferParams::from_value(&value).as_ref(), Ok(&params), "from_value disagrees with from_json");
    let obj = value.as_object();
    assert!(obj.is_some(), "accepted params that are not a JSON object");
    let flag = |name: &str| field(obj, name).and_then(Value::as_bool).unwrap_or(false);
    assert_eq!(params.do_remote_prefill, flag("do_remote_prefill"));
    assert_eq!(params.do_remote_decode, flag("do_remote_decode"));
    assert_eq!(params.remote_host.as_deref(), field(obj, "remote_host").and_then(Value::as_str));
    assert_eq!(params.remote_port.map(u64::from), field(obj, "remote_port").and_then(Value::as_u64));
    assert_eq!(params.remote().is_some(), params.remote_host.is_some() && params.remote_port.is_some());
    match KvTransferParams::from_json(&params.to_json()) {
        Ok(back) => assert_eq!(back, params, "params changed through to_json"),
        Err(e) => panic!("to_json produced unparsable params: {e}"),
    }
}
