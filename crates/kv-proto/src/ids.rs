//! Identifiers and roles.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Index of a block in every layer region of a KV cache (vLLM's block id).
pub type BlockId = u32;

/// A request id as the engine names it (vLLM's `request_id`).
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct ReqId(#[serde(deserialize_with = "crate::bounded::text")] String);

impl ReqId {
    /// Wraps an engine request id.
    pub fn new(id: impl Into<String>) -> Self {
        Self(id.into())
    }

    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for ReqId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

impl fmt::Display for ReqId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<&str> for ReqId {
    fn from(s: &str) -> Self {
        Self::new(s)
    }
}

impl From<String> for ReqId {
    fn from(s: String) -> Self {
        Self(s)
    }
}

/// The id of one engine instance (vLLM's `kv_transfer_config.engine_id`).
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct EngineId(#[serde(deserialize_with = "crate::bounded::text")] String);

impl EngineId {
    /// Wraps an engine id.
    pub fn new(id: impl Into<String>) -> Self {
        Self(id.into())
    }

    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for EngineId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

impl fmt::Display for EngineId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// What an instance does with KV caches (vLLM's `kv_role`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum KvRole {
    /// Prefill only: computes KV and sends it (`kv_producer`).
    #[serde(rename = "kv_producer")]
    Producer,
    /// Decode only: receives KV (`kv_consumer`).
    #[serde(rename = "kv_consumer")]
    Consumer,
    /// Both sends and receives (`kv_both`).
    #[serde(rename = "kv_both")]
    Both,
}

impl KvRole {
    /// The spelling vLLM uses in `kv_role`.
    pub fn as_str(self) -> &'static str {
        match self {
            KvRole::Producer => "kv_producer",
            KvRole::Consumer => "kv_consumer",
            KvRole::Both => "kv_both",
        }
    }

    /// Whether this role sends KV to decode instances.
    pub fn sends(self) -> bool {
        self != KvRole::Consumer
    }

    /// Whether this role receives KV from prefill instances.
    pub fn receives(self) -> bool {
        self != KvRole::Producer
    }
}

impl fmt::Display for KvRole {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A `kv_role` value that is not one of the accepted spellings.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid kv_role {given:?}: expected one of \"kv_producer\", \"kv_consumer\", \"kv_both\"")]
pub struct ParseRoleError {
    /// What was given.
    pub given: String,
}

impl FromStr for KvRole {
    type Err = ParseRoleError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "kv_producer" => Ok(KvRole::Producer),
            "kv_consumer" => Ok(KvRole::Consumer),
            "kv_both" => Ok(KvRole::Both),
            other => Err(ParseRoleError { given: other.to_owned() }),
        }
    }
}
