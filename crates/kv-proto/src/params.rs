//! `KvTransferParams`: the per-request dict the proxy carries between P and D.

use serde::Serialize;

use crate::bounded::MAX_TEXT_LEN;
use crate::ids::{EngineId, ReqId};
use crate::metadata::BootstrapTarget;
use crate::renewal_key::RenewalKey;

/// The per-request transfer parameters, serde-compatible with the dict vLLM
/// keeps in `request.kv_transfer_params` (same field names as the reference).
///
/// Unknown fields are ignored (vLLM and proxies add their own); a field of the
/// wrong type is an error naming it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct KvTransferParams {
    /// Set on D: the KV for this request is computed remotely and must be pulled.
    pub do_remote_prefill: bool,
    /// Set on P: the request is prefilled here and decoded elsewhere.
    pub do_remote_decode: bool,
    /// The P side-channel host D must pull from.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub remote_host: Option<String>,
    /// The P side-channel base port D must pull from (the tensor-parallel rank
    /// is added by each D worker).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub remote_port: Option<u16>,
    /// P's own id of the request (set by P's `request_finished`; vLLM's NIXL
    /// connector uses the same key). Each engine names a request with its
    /// own internal id, so D names the request to P by this one, and by its
    /// own id to its engine.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub remote_request_id: Option<ReqId>,
    /// P's engine id (set by P's `request_finished`). P refuses a pull that
    /// names another engine.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub remote_engine_id: Option<EngineId>,
    /// The request's renewal key (set by P's `request_finished`): D names
    /// it when it renews P's hold on the request, and P counts a renewal
    /// only with it ([`crate::RenewalKey`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub remote_renewal_key: Option<RenewalKey>,
    /// The router-made id that names the request to both instances in the
    /// bootstrap flow (vLLM's Mooncake deployment since 0.16): P is sent
    /// it with `do_remote_decode`, D with `do_remote_prefill`, and D names
    /// the request to P by it. Each engine still has its own request id.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub transfer_id: Option<String>,
    /// P's bootstrap server (`http://host:port`), where D learns P's
    /// workers in the bootstrap flow; with [`Self::transfer_id`] and
    /// [`Self::remote_engine_id`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub remote_bootstrap_addr: Option<String>,
}

/// Transfer params that could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParamsError {
    /// The text is not JSON.
    #[error("kv_transfer_params is not valid JSON: {0}")]
    Json(String),
    /// The JSON is not an object.
    #[error("kv_transfer_params must be a JSON object, got {got}")]
    NotAnObject {
        /// The JSON type found.
        got: &'static str,
    },
    /// A known field has the wrong type or range.
    #[error("kv_transfer_params.{field} must be {expected}, got {got}")]
    WrongType {
        /// The field name.
        field: &'static str,
        /// What is accepted.
        expected: &'static str,
        /// What was found.
        got: String,
    },
}

/// What a text field of the params accepts.
const TEXT_EXPECTED: &str = "a string of at most 1024 bytes";
const _: () = assert!(MAX_TEXT_LEN == 1024, "TEXT_EXPECTED names the bound");

fn json_type(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

impl KvTransferParams {
    /// Parses the JSON form of vLLM's dict. Unknown fields are ignored;
    /// `null` counts as absent; a known field of the wrong type is an error
    /// naming it.
    pub fn from_json(text: &str) -> Result<Self, ParamsError> {
        let value: serde_json::Value = serde_json::from_str(text).map_err(|e| ParamsError::Json(e.to_string()))?;
        Self::from_value(&value)
    }

    /// Parses an already-decoded JSON value of vLLM's dict.
    pub fn from_value(value: &serde_json::Value) -> Result<Self, ParamsError> {
        let obj = value.as_object().ok_or(ParamsError::NotAnObject { got: json_type(value) })?;
        let field = |name: &'static str| obj.get(name).filter(|v| !v.is_null());
        let wrong = |name: &'static str, expected: &'static str, v: &serde_json::Value| ParamsError::WrongType {
            field: name,
            expected,
            got: v.to_string(),
        };
        let flag = |name: &'static str| -> Result<bool, ParamsError> {
            match field(name) {
                None => Ok(false),
                Some(v) => v.as_bool().ok_or_else(|| wrong(name, "a boolean", v)),
            }
        };
        // Ids travel in side-channel frames, which bound every text.
        let text = |name: &'static str| -> Result<Option<String>, ParamsError> {
            match field(name) {
                None => Ok(None),
                Some(v) => match v.as_str() {
                    Some(s) if s.len() <= MAX_TEXT_LEN => Ok(Some(s.to_owned())),
                    Some(s) => Err(ParamsError::WrongType {
                        field: name,
                        expected: TEXT_EXPECTED,
                        got: format!("a string of {} bytes", s.len()),
                    }),
                    None => Err(wrong(name, TEXT_EXPECTED, v)),
                },
            }
        };
        let remote_host = text("remote_host")?;
        let remote_port = match field("remote_port") {
            None => None,
            Some(v) => Some(
                v.as_u64()
                    .and_then(|p| u16::try_from(p).ok())
                    .ok_or_else(|| wrong("remote_port", "an integer port in 0..=65535", v))?,
            ),
        };
        Ok(Self {
            do_remote_prefill: flag("do_remote_prefill")?,
            do_remote_decode: flag("do_remote_decode")?,
            remote_host,
            remote_port,
            remote_request_id: text("remote_request_id")?.map(ReqId::new),
            remote_engine_id: text("remote_engine_id")?.map(EngineId::new),
            remote_renewal_key: match field("remote_renewal_key") {
                None => None,
                Some(v) => Some(v.as_str().and_then(RenewalKey::from_hex).ok_or_else(|| match v.as_str() {
                    // A key is never echoed, even a malformed one.
                    Some(s) => ParamsError::WrongType {
                        field: "remote_renewal_key",
                        expected: "32 hex digits",
                        got: format!("a string of {} bytes", s.len()),
                    },
                    None => wrong("remote_renewal_key", "32 hex digits", v),
                })?),
            },
            transfer_id: text("transfer_id")?,
            remote_bootstrap_addr: text("remote_bootstrap_addr")?,
        })
    }

    /// The JSON form of vLLM's dict.
    pub fn to_json(&self) -> String {
        // Serializing plain bools, strings and integers cannot fail.
        serde_json::to_string(self).unwrap_or_default()
    }

    /// The id to name the request by to P: the transfer id in the
    /// bootstrap flow, P's own id when P returned it, else `own` (D's id;
    /// right only when both engines name requests alike, as clients that
    /// set no `remote_request_id` assume).
    pub fn prefill_request_id(&self, own: &ReqId) -> ReqId {
        if self.bootstrap().is_some() {
            if let Some(transfer) = &self.transfer_id {
                return ReqId::new(transfer.clone());
            }
        }
        self.remote_request_id.clone().unwrap_or_else(|| own.clone())
    }

    /// Where D learns P's workers in the bootstrap flow: present when the
    /// params carry all three of `transfer_id`, `remote_bootstrap_addr` and
    /// `remote_engine_id` (as vLLM's Mooncake connector requires).
    pub fn bootstrap(&self) -> Option<BootstrapTarget> {
        self.transfer_id.as_ref()?;
        Some(BootstrapTarget { url: self.remote_bootstrap_addr.clone()?, engine_id: self.remote_engine_id.clone()? })
    }

    /// The name P's worker knows a request by, as P's scheduler decides it
    /// from the params P was sent: its transfer id where the router made
    /// one, else P's own id `own`.
    pub fn send_name(&self, own: &ReqId) -> ReqId {
        match &self.transfer_id {
            Some(transfer) => ReqId::new(transfer.clone()),
            None => own.clone(),
        }
    }

    /// The remote side channel, when both host and port are present.
    pub fn remote(&self) -> Option<(&str, u16)> {
        Some((self.remote_host.as_deref()?, self.remote_port?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_vllm_dict_and_ignores_unknown_fields() {
        let p = KvTransferParams::from_json(
            r#"{"do_remote_prefill": true, "do_remote_decode": false,
                "remote_host": "10.0.0.1", "remote_port": 8998,
                "remote_engine_id": "abc", "remote_block_ids": [1,2]}"#,
        )
        .unwrap();
        assert!(p.do_remote_prefill);
        assert_eq!(p.remote(), Some(("10.0.0.1", 8998)));
    }

    #[test]
    fn parses_the_routers_bootstrap_legs() {
        let d = KvTransferParams::from_json(
            r#"{"do_remote_decode": false, "do_remote_prefill": true, "transfer_id": "xfer-1",
                "remote_bootstrap_addr": "http://10.0.0.2:8998", "remote_engine_id": "e-1"}"#,
        )
        .unwrap();
        let target = d.bootstrap().unwrap();
        assert_eq!((target.url.as_str(), target.engine_id.as_str()), ("http://10.0.0.2:8998", "e-1"));
        assert_eq!(d.prefill_request_id(&ReqId::new("own")), ReqId::new("xfer-1"));
        assert_eq!(d.remote(), None);
        let p = KvTransferParams::from_json(
            r#"{"do_remote_decode": true, "do_remote_prefill": false, "transfer_id": "xfer-1"}"#,
        )
        .unwrap();
        assert_eq!(p.bootstrap(), None, "P's leg names no bootstrap server");
        assert_eq!(p.send_name(&ReqId::new("cmpl-1")), ReqId::new("xfer-1"));
        assert_eq!(KvTransferParams::default().send_name(&ReqId::new("cmpl-1")), ReqId::new("cmpl-1"));
    }

    #[test]
    fn a_transfer_id_is_bounded_text() {
        let long = "x".repeat(MAX_TEXT_LEN + 1);
        let err = KvTransferParams::from_json(&format!(r#"{{"transfer_id": "{long}"}}"#)).unwrap_err();
        assert!(err.to_string().contains("transfer_id"), "{err}");
        assert!(KvTransferParams::from_json(r#"{"remote_bootstrap_addr": 8998}"#).is_err());
    }

    #[test]
    fn missing_fields_default() {
        let p = KvTransferParams::from_json(r#"{"do_remote_decode": true}"#).unwrap();
        assert!(p.do_remote_decode);
        assert!(!p.do_remote_prefill);
        assert_eq!(p.remote(), None);
    }

    #[test]
    fn wrong_type_is_an_error_naming_the_field() {
        let err = KvTransferParams::from_json(r#"{"remote_port": "8998"}"#).unwrap_err();
        assert_eq!(
            err.to_string(),
            r#"kv_transfer_params.remote_port must be an integer port in 0..=65535, got "8998""#
        );
        let err = KvTransferParams::from_json(r#"{"do_remote_prefill": 1}"#).unwrap_err();
        assert_eq!(err.to_string(), "kv_transfer_params.do_remote_prefill must be a boolean, got 1");
        let err = KvTransferParams::from_json(r#"{"remote_port": 70000}"#).unwrap_err();
        assert!(matches!(err, ParamsError::WrongType { field: "remote_port", .. }));
        let err = KvTransferParams::from_json("[1]").unwrap_err();
        assert_eq!(err, ParamsError::NotAnObject { got: "an array" });
    }

    #[test]
    fn reads_prefill_identity() {
        let p = KvTransferParams::from_json(
            r#"{"do_remote_prefill": true, "remote_host": "h", "remote_port": 1,
                "remote_request_id": "cmpl-9-0-b00fff6e", "remote_engine_id": "p0"}"#,
        )
        .unwrap();
        assert_eq!(p.remote_request_id, Some(ReqId::new("cmpl-9-0-b00fff6e")));
        assert_eq!(p.remote_engine_id, Some(EngineId::new("p0")));
        assert_eq!(p.prefill_request_id(&ReqId::new("cmpl-9-0-9760c8b8")), ReqId::new("cmpl-9-0-b00fff6e"));
        let older = KvTransferParams::from_json(r#"{"do_remote_prefill": true}"#).unwrap();
        assert_eq!(older.prefill_request_id(&ReqId::new("mine")), ReqId::new("mine"));
    }

    #[test]
    fn ids_must_be_bounded_strings() {
        let err = KvTransferParams::from_json(r#"{"remote_request_id": 7}"#).unwrap_err();
        assert!(matches!(err, ParamsError::WrongType { field: "remote_request_id", .. }), "{err}");
        let long = format!(r#"{{"remote_engine_id": "{}"}}"#, "x".repeat(MAX_TEXT_LEN + 1));
        let err = KvTransferParams::from_json(&long).unwrap_err();
        assert_eq!(
            err.to_string(),
            "kv_transfer_params.remote_engine_id must be a string of at most 1024 bytes, got a string of 1025 bytes"
        );
        let err = KvTransferParams::from_json(r#"{"remote_engine_id": ["p0"]}"#).unwrap_err();
        assert!(matches!(err, ParamsError::WrongType { field: "remote_engine_id", .. }), "{err}");
    }

    #[test]
    fn a_renewal_key_is_32_hex_digits_and_a_bad_one_is_never_echoed() {
        let key = "0123456789abcdef".repeat(2);
        let p = KvTransferParams::from_json(&format!(r#"{{"remote_renewal_key": "{key}"}}"#)).unwrap();
        assert_eq!(p.remote_renewal_key.map(|k| k.to_hex()), Some(key));
        let err = KvTransferParams::from_json(r#"{"remote_renewal_key": "secret-ish"}"#).unwrap_err();
        assert_eq!(
            err.to_string(),
            "kv_transfer_params.remote_renewal_key must be 32 hex digits, got a string of 10 bytes"
        );
        let err = KvTransferParams::from_json(r#"{"remote_renewal_key": 12}"#).unwrap_err();
        assert!(matches!(err, ParamsError::WrongType { field: "remote_renewal_key", .. }), "{err}");
    }

    #[test]
    fn round_trips_through_json() {
        let p = KvTransferParams {
            do_remote_prefill: true,
            do_remote_decode: false,
            remote_host: Some("h".into()),
            remote_port: Some(1),
            remote_request_id: Some(ReqId::new("cmpl-1-0-abcd1234")),
            remote_engine_id: Some(EngineId::new("prefill-0")),
            remote_renewal_key: Some(RenewalKey::from_bytes([0x5a; 16])),
            remote_bootstrap_addr: None,
            transfer_id: None,
        };
        assert!(p.to_json().contains(&format!(r#""remote_renewal_key":"{}""#, "5a".repeat(16))), "{}", p.to_json());
        assert_eq!(KvTransferParams::from_json(&p.to_json()).unwrap(), p);
    }
}
