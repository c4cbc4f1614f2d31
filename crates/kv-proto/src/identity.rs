//! What must agree between a prefill and a decode instance for KV to mean
//! the same on both: the model, how its KV is stored, the topology and the
//! software. Carried by D's hello and compared by P field by field, so a
//! mismatch fails at connect, naming both values, never per request.
//!
//! A field the engine does not know (empty text, zero) is not compared: the
//! CLI's bench has no model, and an embedder may not know every one.

use serde::{Deserialize, Serialize};

use crate::bounded;

/// An instance's model, KV storage, topology and versions.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ModelIdentity {
    /// What the model is (vLLM's connector sends the architecture's class
    /// names, e.g. `Qwen2ForCausalLM`): not a path or a served name, which
    /// differ between hosts that run one model.
    #[serde(deserialize_with = "bounded::text")]
    pub model: String,
    /// A hash of the model's architecture config (what determines the KV
    /// of a prompt), so two checkpoints under one name are told apart.
    #[serde(deserialize_with = "bounded::text")]
    pub config_hash: String,
    /// The model's KV dtype (e.g. `bfloat16`).
    #[serde(deserialize_with = "bounded::text")]
    pub kv_dtype: String,
    /// The cache's storage dtype (vLLM's `cache_dtype`: `auto`, `fp8_e4m3`, ...).
    #[serde(deserialize_with = "bounded::text")]
    pub cache_dtype: String,
    /// Attention layers with KV.
    pub num_layers: u32,
    /// KV heads of the whole model (before tensor-parallel splitting).
    pub num_kv_heads: u32,
    /// Elements per head.
    pub head_size: u32,
    /// How heads and tokens are ordered inside a block (`NHD`, `HND`).
    #[serde(deserialize_with = "bounded::text")]
    pub attention_layout: String,
    /// Tensor-parallel size (not compared here: the hello's
    /// [`crate::RankTopology`] carries it, and P and D may differ in it).
    pub tp_size: u32,
    /// Pipeline-parallel size (compared through the hello's
    /// [`crate::RankTopology`]).
    pub pp_size: u32,
    /// The engine's version (e.g. vLLM's).
    #[serde(deserialize_with = "bounded::text")]
    pub engine_version: String,
    /// kvlink's version.
    #[serde(deserialize_with = "bounded::text")]
    pub kvlink_version: String,
}

impl ModelIdentity {
    /// Only kvlink's own version known (what a bare worker declares).
    pub fn this_kvlink() -> Self {
        Self { kvlink_version: env!("CARGO_PKG_VERSION").to_owned(), ..Self::default() }
    }

    /// What differs between this identity (`ours`, named `our_name`) and a
    /// peer's, each difference naming both values; fields either side left
    /// undeclared are not compared.
    pub fn mismatches(&self, our_name: &str, theirs: &ModelIdentity, their_name: &str) -> Vec<String> {
        let mut out = Vec::new();
        let mut text = |what: &str, ours: &str, other: &str| {
            if !ours.is_empty() && !other.is_empty() && ours != other {
                out.push(format!("{what}: {our_name} has {ours}, {their_name} has {other}"));
            }
        };
        text("model", &self.model, &theirs.model);
        text("model config hash", &self.config_hash, &theirs.config_hash);
        text("KV dtype", &self.kv_dtype, &theirs.kv_dtype);
        text("cache dtype", &self.cache_dtype, &theirs.cache_dtype);
        text("attention layout", &self.attention_layout, &theirs.attention_layout);
        text("engine version", &self.engine_version, &theirs.engine_version);
        text("kvlink version", &self.kvlink_version, &theirs.kvlink_version);
        let mut number = |what: &str, ours: u32, other: u32| {
            if ours != 0 && other != 0 && ours != other {
                out.push(format!("{what}: {our_name} has {ours}, {their_name} has {other}"));
            }
        };
        number("layers", self.num_layers, theirs.num_layers);
        number("KV heads", self.num_kv_heads, theirs.num_kv_heads);
        number("head size", self.head_size, theirs.head_size);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn full() -> ModelIdentity {
        ModelIdentity {
            model: "m".into(),
            config_hash: "h".into(),
            kv_dtype: "bfloat16".into(),
            cache_dtype: "auto".into(),
            num_layers: 32,
            num_kv_heads: 8,
            head_size: 128,
            attention_layout: "NHD".into(),
            tp_size: 1,
            pp_size: 1,
            engine_version: "0.14.0".into(),
            kvlink_version: "0.1.0".into(),
        }
    }

    #[test]
    fn equal_or_undeclared_fields_agree() {
        assert!(full().mismatches("p", &full(), "d").is_empty());
        assert!(full().mismatches("p", &ModelIdentity::default(), "d").is_empty());
        let partial = ModelIdentity { model: "m".into(), num_layers: 32, ..ModelIdentity::default() };
        assert!(full().mismatches("p", &partial, "d").is_empty());
    }

    #[test]
    fn each_difference_names_both_values() {
        let other = ModelIdentity { kv_dtype: "float16".into(), num_kv_heads: 4, ..full() };
        assert_eq!(
            full().mismatches("prefill p", &other, "decode d"),
            ["KV dtype: prefill p has bfloat16, decode d has float16", "KV heads: prefill p has 8, decode d has 4",]
        );
    }
}
