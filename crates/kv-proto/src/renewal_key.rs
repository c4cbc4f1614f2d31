//! Renewal keys: what lets a decode instance renew P's hold on one request,
//! and nothing else.
//!
//! P's scheduler mints one key per request it prefills for a remote decode
//! ([`RenewalSecret::key_for`]), returns it in the request's
//! `kv_transfer_params` (which go only to the proxy and, through it, to the
//! decode instance it chose) and hands it to its workers with the request's
//! send update. A renewal ([`crate::KeepAlive`]) counts only when it names
//! the request's key: a decode instance that was never given a request's
//! params cannot renew it, so it cannot move the request's hold either way.
//! A key is no secret of the engine's: it names one request, and a leaked
//! key costs at most that request's hold.

use std::fmt;

use serde::de::{self, Deserializer, Visitor};
use serde::{Deserialize, Serialize, Serializer};

use crate::ids::ReqId;

/// Bytes of a [`RenewalKey`] (128 bits).
pub const RENEWAL_KEY_LEN: usize = 16;

/// One request's renewal key. Compared in constant time; never printed
/// (its `Debug` says only that it is there). In JSON (vLLM's
/// `kv_transfer_params`) it is 32 lowercase hex digits; on the wire, its
/// 16 bytes.
#[derive(Clone, Copy)]
pub struct RenewalKey([u8; RENEWAL_KEY_LEN]);

impl RenewalKey {
    /// The renewal key of a request named by a router-made transfer id
    /// (the bootstrap flow, where P returns no params to hand D a minted
    /// key): derived from the transfer id alone, so P and D both know it.
    /// It proves what the minted key proves, that the renewer was given the
    /// request's params, since the router gives the transfer id only to
    /// the P and D it chose.
    pub fn for_transfer(transfer_id: &str) -> RenewalKey {
        let mut hasher = blake3::Hasher::new_derive_key("kvlink renewal key of a transfer id v1");
        hasher.update(transfer_id.as_bytes());
        let mut key = [0u8; RENEWAL_KEY_LEN];
        key.copy_from_slice(&hasher.finalize().as_bytes()[..RENEWAL_KEY_LEN]);
        RenewalKey(key)
    }

    /// The key of these bytes.
    pub const fn from_bytes(bytes: [u8; RENEWAL_KEY_LEN]) -> Self {
        Self(bytes)
    }

    /// Parses 32 hex digits (either case); anything else is `None`.
    pub fn from_hex(text: &str) -> Option<Self> {
        let digits = text.as_bytes();
        if digits.len() != 2 * RENEWAL_KEY_LEN {
            return None;
        }
        let mut bytes = [0u8; RENEWAL_KEY_LEN];
        for (byte, pair) in bytes.iter_mut().zip(digits.chunks_exact(2)) {
            let high = (pair[0] as char).to_digit(16)?;
            let low = (pair[1] as char).to_digit(16)?;
            *byte = u8::try_from(high * 16 + low).ok()?;
        }
        Some(Self(bytes))
    }

    /// Its 32 lowercase hex digits.
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }
}

impl PartialEq for RenewalKey {
    /// Constant time: how many leading bytes of a guess are right never shows.
    fn eq(&self, other: &Self) -> bool {
        self.0.iter().zip(&other.0).fold(0u8, |diff, (a, b)| diff | (a ^ b)) == 0
    }
}

impl Eq for RenewalKey {}

impl fmt::Debug for RenewalKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("RenewalKey(..)")
    }
}

impl Serialize for RenewalKey {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        if serializer.is_human_readable() {
            serializer.serialize_str(&self.to_hex())
        } else {
            self.0.serialize(serializer)
        }
    }
}

impl<'de> Deserialize<'de> for RenewalKey {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Hex;
        impl Visitor<'_> for Hex {
            type Value = RenewalKey;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("32 hex digits")
            }
            fn visit_str<E: de::Error>(self, text: &str) -> Result<RenewalKey, E> {
                RenewalKey::from_hex(text).ok_or_else(|| E::invalid_value(de::Unexpected::Str(text), &self))
            }
        }
        if deserializer.is_human_readable() {
            deserializer.deserialize_str(Hex)
        } else {
            <[u8; RENEWAL_KEY_LEN]>::deserialize(deserializer).map(Self)
        }
    }
}

/// The secret a prefill engine's scheduler mints its requests' renewal keys
/// from: chosen at start, kept in the scheduler, never sent. Keys are
/// derived, not stored, so the scheduler keeps no state per key.
#[derive(Clone)]
pub struct RenewalSecret([u8; 32]);

impl RenewalSecret {
    /// A fresh secret, or `None` if the OS random source fails (the caller
    /// then cannot offer renewals, and must say so rather than weaken them).
    pub fn fresh() -> Option<Self> {
        crate::random::array().map(Self)
    }

    /// The secret of these bytes (tests, and engines that bring their own).
    pub fn from_bytes(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }

    /// The renewal key of request `req` (P's id of it).
    pub fn key_for(&self, req: &ReqId) -> RenewalKey {
        let mut hasher = blake3::Hasher::new_keyed(&self.0);
        hasher.update(b"kvlink renewal key\0");
        hasher.update(req.as_str().as_bytes());
        let mut key = [0u8; RENEWAL_KEY_LEN];
        key.copy_from_slice(&hasher.finalize().as_bytes()[..RENEWAL_KEY_LEN]);
        RenewalKey(key)
    }
}

impl fmt::Debug for RenewalSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("RenewalSecret(..)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_round_trips_and_refuses_anything_else() {
        let key = RenewalKey::from_bytes([0xab; RENEWAL_KEY_LEN]);
        assert_eq!(key.to_hex(), "ab".repeat(16));
        assert_eq!(RenewalKey::from_hex(&key.to_hex()), Some(key));
        assert_eq!(RenewalKey::from_hex(&"AB".repeat(16)), Some(key), "either case");
        for bad in ["", "ab", &"ab".repeat(17), &"zz".repeat(16), &"é".repeat(16), &"+1".repeat(16)] {
            assert_eq!(RenewalKey::from_hex(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn keys_are_per_request_and_per_secret_and_never_printed() {
        let secret = RenewalSecret::from_bytes([1; 32]);
        let a = secret.key_for(&ReqId::new("a"));
        assert_eq!(a, secret.key_for(&ReqId::new("a")), "derived, so the same every time");
        assert_ne!(a, secret.key_for(&ReqId::new("b")));
        assert_ne!(a, RenewalSecret::from_bytes([2; 32]).key_for(&ReqId::new("a")));
        assert_eq!(format!("{a:?} {secret:?}"), "RenewalKey(..) RenewalSecret(..)");
    }

    #[test]
    fn json_carries_hex_and_the_wire_carries_bytes() {
        let key = RenewalKey::from_bytes([7; RENEWAL_KEY_LEN]);
        let json = serde_json::to_string(&key).unwrap_or_default();
        assert_eq!(json, format!("\"{}\"", "07".repeat(16)));
        assert_eq!(serde_json::from_str::<RenewalKey>(&json).ok(), Some(key));
        assert!(serde_json::from_str::<RenewalKey>("\"07\"").is_err());
        let mut bytes = Vec::new();
        assert!(crate::codec::encode_into(&key, &mut bytes).is_ok());
        assert_eq!(bytes, [7; RENEWAL_KEY_LEN]);
        assert_eq!(crate::codec::decode::<RenewalKey>(&bytes).ok(), Some(key));
    }
}
