//! The bootstrap contract of vLLM's Mooncake deployment (vLLM 0.16+), sans
//! I/O: what a prefill instance's "bootstrap server" is told and tells.
//!
//! Every prefill worker registers where its side channel listens
//! ([`Registration`], the JSON body of `POST /register`); routers and
//! decode instances read the whole registry back (`GET /query`, parsed by
//! [`QueryReply::parse`]) as
//! `{"<dp>": {"engine_id": str, "worker_addr": {"<tp>": {"<pp>": "tcp://host:port"}}}}`.
//! [`BootstrapRegistry`] decides each registration as vLLM does (the first
//! registration of a rank wins; a data-parallel rank has one engine id; an
//! identical registration again is accepted) and refuses ranks outside the
//! [`Expected`] shape. One deliberate difference: it has no reply to a query
//! until every expected worker registered ([`BootstrapRegistry::query_json`]
//! is `None`; the server answers 503), because a router caches the first
//! successful reply for good and retries only failures.
//!
//! When the deployment has a shared secret, a registration carries
//! [`registration_proof`] in the [`PROOF_HEADER`]: an HMAC over the exact
//! body, so nobody who merely reaches P can put its own address in the
//! registry. The registry hands out addresses, never secrets, so queries
//! need no proof. A recorded registration can be replayed, but it says
//! nothing new (an identical registration changes nothing).
//!
//! What this module must never do: perform I/O or read a clock; panic or
//! allocate without bound on a peer's bytes (every text a peer sends is
//! parsed within a size bound, and a rejected value is described by its
//! type or escaped and cut short, never echoed raw).

use std::collections::BTreeMap;
use std::fmt;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};

use hmac::{Hmac, Mac};
use serde::{Serialize, Serializer};
use serde_json::{Map, Value};
use sha2::Sha256;

use crate::auth::AuthSecret;
use crate::bounded::MAX_TEXT_LEN;
use crate::ids::EngineId;
use crate::topology::MAX_PARALLEL_SIZE;

/// Most bytes of a registration body (the server's bound on a request body).
pub const MAX_REGISTRATION_BYTES: usize = 16 * 1024;
/// Most workers (data-parallel x tensor-parallel x pipeline-parallel ranks)
/// one bootstrap server lists: 128 nodes of 8 GPUs behind one prefill
/// deployment. It bounds the registry and so the size of a query reply.
pub const MAX_BOOTSTRAP_WORKERS: usize = 1024;
/// Most bytes of a query reply a reader accepts. The largest reply a
/// registry of [`MAX_BOOTSTRAP_WORKERS`] can give fits (tested).
pub const MAX_QUERY_REPLY_BYTES: usize = 4 * 1024 * 1024;
/// Most bytes of a host name in an address (DNS's bound).
pub const MAX_HOST_LEN: usize = 253;
/// The header a registration's proof travels in.
pub const PROOF_HEADER: &str = "X-Kvlink-Proof";
/// What the server answers a registration it accepted.
pub const REGISTERED_JSON: &str = r#"{"status":"ok"}"#;
/// Characters of a peer's text kept in an error or log line.
const SHOWN_CHARS: usize = 64;
/// Registrations listed by name in [`Missing`]'s text.
const MISSING_LISTED: usize = 8;

/// Separates registration proofs from every other MAC keyed with the secret.
const PROOF_LABEL: &[u8] = b"kvlink bootstrap register v1\0";
/// Bytes of a proof (HMAC-SHA-256), twice as many hex digits in the header.
const PROOF_LEN: usize = 32;

/// A bootstrap message or address that could not be parsed, or a shape
/// that cannot be served.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum BootstrapError {
    /// The bytes are not UTF-8 text.
    #[error("{what} is not UTF-8 text")]
    NotUtf8 {
        /// What was read.
        what: &'static str,
    },
    /// More bytes than accepted.
    #[error("{what} of {len} bytes is over the bound of {limit}")]
    TooLarge {
        /// What was read.
        what: &'static str,
        /// Its length.
        len: usize,
        /// The bound.
        limit: usize,
    },
    /// The text is not JSON (the parser's message: a position, never the input).
    #[error("{what} is not valid JSON: {reason}")]
    Json {
        /// What was read.
        what: &'static str,
        /// Why.
        reason: String,
    },
    /// A required field is absent (or `null`).
    #[error("{field} is missing")]
    Missing {
        /// Where, as a path of keys.
        field: String,
    },
    /// A field holds something else than it may.
    #[error("{field} must be {expected}, got {got}")]
    Field {
        /// Where, as a path of keys.
        field: String,
        /// What is accepted.
        expected: &'static str,
        /// What was found: its type, a number, or escaped and cut text.
        got: String,
    },
    /// More entries than accepted.
    #[error("{what}: more than {limit} entries")]
    TooMany {
        /// What holds them.
        what: String,
        /// The bound.
        limit: usize,
    },
    /// A query reply's workers of one engine are not every tensor-parallel
    /// rank times every pipeline-parallel rank from 0.
    #[error("the workers of data-parallel rank {dp_rank} are not every tp rank below {tp_size} times every pp rank below {pp_size} (the registry is incomplete or inconsistent)")]
    NotRectangular {
        /// The data-parallel rank.
        dp_rank: u32,
        /// Tensor-parallel ranks seen.
        tp_size: u32,
        /// Pipeline-parallel ranks seen.
        pp_size: u32,
    },
    /// Two data-parallel ranks of a query reply name the same engine.
    #[error("engine id {engine_id} is listed under data-parallel ranks {first} and {second}")]
    DuplicateEngine {
        /// The engine id, escaped and cut short.
        engine_id: String,
        /// One rank.
        first: u32,
        /// Another.
        second: u32,
    },
    /// A worker address (`tcp://host:port`) that cannot be used.
    #[error("worker address {shown}: {reason}")]
    Addr {
        /// The text, escaped and cut short.
        shown: String,
        /// Why.
        reason: &'static str,
    },
    /// A bootstrap URL (`http://host:port`) that cannot be used.
    #[error("bootstrap address {shown}: {reason}")]
    Url {
        /// The text, escaped and cut short.
        shown: String,
        /// Why.
        reason: &'static str,
    },
    /// An expected shape that cannot be served.
    #[error("a bootstrap of {dp_size} data-parallel x {tp_size} tensor-parallel x {pp_size} pipeline-parallel ranks cannot be served (each at least 1, at most {MAX_BOOTSTRAP_WORKERS} workers in all)")]
    Shape {
        /// Data-parallel ranks asked for.
        dp_size: u32,
        /// Tensor-parallel ranks asked for.
        tp_size: u32,
        /// Pipeline-parallel ranks asked for.
        pp_size: u32,
    },
}

/// `text` with control characters and the invisible ones that reorder,
/// break or hide text (bidirectional marks, overrides and isolates,
/// line and paragraph separators, zero-width and soft marks, tag
/// characters, interlinear annotation) written as `\u{..}`, cut to at most
/// `max_chars` characters of that ("…" marks a cut): how a server's detail
/// may appear in an error or a log line.
pub fn escape_bounded(text: &str, max_chars: usize) -> String {
    let hidden = |c: char| {
        c.is_control()
            || matches!(
                c,
                '\u{ad}'
                    | '\u{61c}'
                    | '\u{180e}'
                    | '\u{200b}'..='\u{200f}'
                    | '\u{2028}'..='\u{202e}'
                    | '\u{2060}'..='\u{2069}'
                    | '\u{feff}'
                    | '\u{fff9}'..='\u{fffb}'
                    | '\u{e0000}'..='\u{e007f}'
            )
    };
    let mut escaped = text.chars().flat_map(|c| {
        let (plain, unicode) = if hidden(c) { (None, Some(c.escape_unicode())) } else { (Some(c), None) };
        plain.into_iter().chain(unicode.into_iter().flatten())
    });
    let mut out: String = escaped.by_ref().take(max_chars).collect();
    if escaped.next().is_some() {
        out.push('…');
    }
    out
}

/// A peer's text as it may appear in an error: quoted, escaped as Rust's
/// `escape_debug` does, cut short.
fn shown(text: &str) -> String {
    let mut escaped = text.chars().flat_map(char::escape_debug);
    let mut out: String = escaped.by_ref().take(SHOWN_CHARS).collect();
    if escaped.next().is_some() {
        out.push('…');
    }
    format!("\"{out}\"")
}

/// What a JSON value is, for an error (never its text).
fn describe(value: &Value) -> String {
    match value {
        Value::Null => "null".into(),
        Value::Bool(b) => format!("{b}"),
        // A number's text is short (serde_json refuses what overflows f64).
        Value::Number(n) => escape_bounded(&n.to_string(), SHOWN_CHARS),
        Value::String(s) => format!("a string of {} bytes", s.len()),
        Value::Array(_) => "an array".into(),
        Value::Object(_) => "an object".into(),
    }
}

/// Parses `text` as JSON within `limit` bytes.
fn json(what: &'static str, text: &str, limit: usize) -> Result<Value, BootstrapError> {
    if text.len() > limit {
        return Err(BootstrapError::TooLarge { what, len: text.len(), limit });
    }
    // serde_json bounds nesting (128 levels), so deep input is an error, not a stack overflow.
    serde_json::from_str(text).map_err(|e| BootstrapError::Json { what, reason: e.to_string() })
}

fn utf8<'a>(what: &'static str, bytes: &'a [u8]) -> Result<&'a str, BootstrapError> {
    std::str::from_utf8(bytes).map_err(|_| BootstrapError::NotUtf8 { what })
}

// ---------------------------------------------------------------------------
// Addresses
// ---------------------------------------------------------------------------

/// Checks a host without brackets: an IPv6 or IPv4 literal, or a DNS name
/// (labels of letters, digits, `-` and `_`).
/// A host and a port either kind of address may hold.
fn check_host_port(host: &str, port: u16) -> Result<(), &'static str> {
    check_host(host)?;
    if port == 0 {
        return Err("the port must be a number in 1..=65535");
    }
    Ok(())
}

fn check_host(host: &str) -> Result<(), &'static str> {
    if host.is_empty() {
        return Err("the host is empty");
    }
    if host.contains(':') {
        return host.parse::<Ipv6Addr>().map(drop).map_err(|_| "an IPv6 host must be a plain IPv6 address");
    }
    if host.len() > MAX_HOST_LEN {
        return Err("the host name is longer than 253 bytes");
    }
    let label_ok = |label: &str| {
        !label.is_empty()
            && label.len() <= 63
            && label.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    };
    if host.split('.').all(label_ok) {
        Ok(())
    } else {
        Err("the host is neither an IP address nor a DNS name")
    }
}

/// `host:port`, or `[host]:port` for IPv6, parsed; `default_port` when no
/// port is given, if any.
fn parse_authority(text: &str, default_port: Option<u16>) -> Result<(String, u16), &'static str> {
    let (host, port) = if let Some(rest) = text.strip_prefix('[') {
        let (host, after) = rest.split_once(']').ok_or("an IPv6 host's '[' is not closed")?;
        if !host.contains(':') {
            return Err("only an IPv6 host goes in brackets");
        }
        let port = match after {
            "" => None,
            _ => Some(after.strip_prefix(':').ok_or("the host must be followed by ':port'")?),
        };
        (host, port)
    } else {
        match text.split_once(':') {
            Some((host, port)) => {
                if port.contains(':') {
                    return Err("an IPv6 host must be in brackets");
                }
                (host, Some(port))
            }
            None => (text, None),
        }
    };
    check_host(host)?;
    let port = match port {
        None => default_port.ok_or("a port is required")?,
        Some(port) => {
            if port.is_empty() || port.len() > 5 || !port.bytes().all(|b| b.is_ascii_digit()) {
                return Err("the port must be a number in 1..=65535");
            }
            match port.parse::<u16>() {
                Ok(p) if p != 0 => p,
                _ => return Err("the port must be a number in 1..=65535"),
            }
        }
    };
    Ok((host.to_owned(), port))
}

fn authority(host: &str, port: u16) -> String {
    if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

fn socket_addr(host: &str, port: u16) -> Option<SocketAddr> {
    if let Ok(v6) = host.parse::<Ipv6Addr>() {
        return Some(SocketAddr::from((v6, port)));
    }
    host.parse::<Ipv4Addr>().ok().map(|v4| SocketAddr::from((v4, port)))
}

/// Where a prefill worker's side channel listens, as vLLM writes it:
/// `tcp://host:port`, an IPv6 host in brackets. The host is an IP literal
/// or a DNS name; the port is never 0.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorkerAddr {
    /// Without brackets.
    host: String,
    port: u16,
}

impl WorkerAddr {
    /// The scheme every worker address starts with.
    pub const SCHEME: &'static str = "tcp://";

    /// An address of `host` (an IPv6 one without brackets) and `port`.
    pub fn new(host: &str, port: u16) -> Result<Self, BootstrapError> {
        let refused = |reason| BootstrapError::Addr { shown: shown(&authority(host, port)), reason };
        check_host_port(host, port).map_err(refused)?;
        Ok(Self { host: host.to_owned(), port })
    }

    /// The address of a socket.
    pub fn from_socket(addr: SocketAddr) -> Self {
        Self { host: addr.ip().to_string(), port: addr.port() }
    }

    /// Parses `tcp://host:port` (`tcp://[v6]:port` for IPv6).
    pub fn parse(text: &str) -> Result<Self, BootstrapError> {
        let refused = |reason| BootstrapError::Addr { shown: shown(text), reason };
        if text.len() > MAX_TEXT_LEN {
            return Err(refused("longer than 1024 bytes"));
        }
        let rest = text.strip_prefix(Self::SCHEME).ok_or_else(|| refused("it must start with tcp://"))?;
        let (host, port) = parse_authority(rest, None).map_err(refused)?;
        Ok(Self { host, port })
    }

    /// The host, without brackets.
    pub fn host(&self) -> &str {
        &self.host
    }

    /// The port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The socket address, when the host is an IP literal.
    pub fn socket_addr(&self) -> Option<SocketAddr> {
        socket_addr(&self.host, self.port)
    }
}

impl fmt::Display for WorkerAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}", Self::SCHEME, authority(&self.host, self.port))
    }
}

impl fmt::Debug for WorkerAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "\"{self}\"")
    }
}

impl std::str::FromStr for WorkerAddr {
    type Err = BootstrapError;

    fn from_str(text: &str) -> Result<Self, BootstrapError> {
        Self::parse(text)
    }
}

impl Serialize for WorkerAddr {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

/// Where a bootstrap server answers, as D's `remote_bootstrap_addr` names
/// it: `http://host:port` (a trailing `/` tolerated, port 80 when none is
/// given). Only plain HTTP: the server hands out addresses, never secrets.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct BootstrapUrl {
    /// Without brackets.
    host: String,
    port: u16,
}

impl BootstrapUrl {
    /// The server at `host` (an IPv6 one without brackets) and `port`.
    pub fn new(host: &str, port: u16) -> Result<Self, BootstrapError> {
        let refused = |reason| BootstrapError::Url { shown: shown(&authority(host, port)), reason };
        check_host_port(host, port).map_err(refused)?;
        Ok(Self { host: host.to_owned(), port })
    }

    /// Parses `host:port` (`[v6]:port` for IPv6), the port required: how
    /// vLLM's `bootstrap_server_address` names a server.
    pub fn from_authority(text: &str) -> Result<Self, BootstrapError> {
        let refused = |reason| BootstrapError::Url { shown: shown(text), reason };
        if text.len() > MAX_TEXT_LEN {
            return Err(refused("longer than 1024 bytes"));
        }
        let (host, port) = parse_authority(text, None).map_err(refused)?;
        Ok(Self { host, port })
    }

    /// The server at a socket address.
    pub fn from_socket(addr: SocketAddr) -> Self {
        Self { host: addr.ip().to_string(), port: addr.port() }
    }

    /// Parses `http://host[:port][/]`.
    pub fn parse(text: &str) -> Result<Self, BootstrapError> {
        let refused = |reason| BootstrapError::Url { shown: shown(text), reason };
        if text.len() > MAX_TEXT_LEN {
            return Err(refused("longer than 1024 bytes"));
        }
        let Some((scheme, rest)) = text.split_once("://") else {
            return Err(refused("a scheme is required: http://host:port"));
        };
        if scheme.eq_ignore_ascii_case("https") {
            return Err(refused("https is not supported: the bootstrap server speaks plain HTTP (use http://)"));
        }
        if !scheme.eq_ignore_ascii_case("http") {
            return Err(refused("the scheme must be http://"));
        }
        let rest = rest.strip_suffix('/').unwrap_or(rest);
        if rest.contains(['/', '?', '#']) {
            return Err(refused("only http://host:port is accepted (no path, query or fragment)"));
        }
        if rest.contains('@') {
            return Err(refused("user information is not accepted"));
        }
        let (host, port) = parse_authority(rest, Some(80)).map_err(refused)?;
        Ok(Self { host, port })
    }

    /// The host, without brackets.
    pub fn host(&self) -> &str {
        &self.host
    }

    /// The port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `host:port` (`[v6]:port`), as a `Host` header says it.
    pub fn authority(&self) -> String {
        authority(&self.host, self.port)
    }

    /// The socket address, when the host is an IP literal.
    pub fn socket_addr(&self) -> Option<SocketAddr> {
        socket_addr(&self.host, self.port)
    }
}

impl fmt::Display for BootstrapUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "http://{}", self.authority())
    }
}

impl fmt::Debug for BootstrapUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "\"{self}\"")
    }
}

impl std::str::FromStr for BootstrapUrl {
    type Err = BootstrapError;

    fn from_str(text: &str) -> Result<Self, BootstrapError> {
        Self::parse(text)
    }
}

// ---------------------------------------------------------------------------
// Registration
// ---------------------------------------------------------------------------

/// One prefill worker's registration, the body of `POST /register`:
/// `{"engine_id": str, "dp_rank": int, "tp_rank": int, "pp_rank": int, "addr": "tcp://host:port"}`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Registration {
    /// The engine (one per data-parallel rank) the worker belongs to.
    pub engine_id: EngineId,
    /// The worker's data-parallel rank.
    pub dp_rank: u32,
    /// The worker's tensor-parallel rank.
    pub tp_rank: u32,
    /// The worker's pipeline-parallel rank.
    pub pp_rank: u32,
    /// Where its side channel listens.
    pub addr: WorkerAddr,
}

/// What a rank accepts, in errors.
const RANK_EXPECTED: &str = "an integer rank in 0..1024";
const _: () = assert!(MAX_PARALLEL_SIZE == 1024, "RANK_EXPECTED names the bound");
/// What an engine id accepts, in errors.
const ENGINE_ID_EXPECTED: &str = "a non-empty string of at most 1024 bytes without control characters";
const _: () = assert!(MAX_TEXT_LEN == 1024, "ENGINE_ID_EXPECTED names the bound");

/// A rank from a JSON value.
fn rank(field: impl Fn() -> String, value: &Value) -> Result<u32, BootstrapError> {
    value
        .as_u64()
        .filter(|&r| r < u64::from(MAX_PARALLEL_SIZE))
        .and_then(|r| u32::try_from(r).ok())
        .ok_or_else(|| BootstrapError::Field { field: field(), expected: RANK_EXPECTED, got: describe(value) })
}

/// An engine id from a JSON value: bounded, and free of control characters,
/// so it is never more than twice as long escaped (which bounds a reply).
fn engine_id(field: impl Fn() -> String, value: &Value) -> Result<EngineId, BootstrapError> {
    match value.as_str() {
        Some(s) if !s.is_empty() && s.len() <= MAX_TEXT_LEN && !s.chars().any(char::is_control) => Ok(EngineId::new(s)),
        _ => Err(BootstrapError::Field { field: field(), expected: ENGINE_ID_EXPECTED, got: describe(value) }),
    }
}

/// A worker address from a JSON value.
fn worker_addr(field: impl Fn() -> String, value: &Value) -> Result<WorkerAddr, BootstrapError> {
    let text = value.as_str().ok_or_else(|| BootstrapError::Field {
        field: field(),
        expected: "a string tcp://host:port",
        got: describe(value),
    })?;
    WorkerAddr::parse(text)
}

impl Registration {
    /// Parses a `POST /register` body (at most [`MAX_REGISTRATION_BYTES`]).
    /// Keys may come in any order with any whitespace; unknown keys are
    /// ignored (as vLLM's server does); a missing or wrong field is an
    /// error naming it.
    pub fn parse(body: &[u8]) -> Result<Self, BootstrapError> {
        const WHAT: &str = "the registration";
        if body.len() > MAX_REGISTRATION_BYTES {
            return Err(BootstrapError::TooLarge { what: WHAT, len: body.len(), limit: MAX_REGISTRATION_BYTES });
        }
        let value = json(WHAT, utf8(WHAT, body)?, MAX_REGISTRATION_BYTES)?;
        let Value::Object(fields) = &value else {
            return Err(BootstrapError::Field {
                field: "the body".into(),
                expected: "a JSON object",
                got: describe(&value),
            });
        };
        let field = |name: &'static str| {
            fields.get(name).filter(|v| !v.is_null()).ok_or_else(|| BootstrapError::Missing { field: name.into() })
        };
        let name = |name: &'static str| move || name.to_owned();
        Ok(Self {
            engine_id: engine_id(name("engine_id"), field("engine_id")?)?,
            dp_rank: rank(name("dp_rank"), field("dp_rank")?)?,
            tp_rank: rank(name("tp_rank"), field("tp_rank")?)?,
            pp_rank: rank(name("pp_rank"), field("pp_rank")?)?,
            addr: worker_addr(name("addr"), field("addr")?)?,
        })
    }

    /// The body that registers it (compact JSON, fields in vLLM's order).
    pub fn to_json(&self) -> String {
        // Serializing strings and integers into a String cannot fail.
        serde_json::to_string(self).unwrap_or_default()
    }
}

// ---------------------------------------------------------------------------
// Proof of the shared secret
// ---------------------------------------------------------------------------

fn proof_mac(secret: &AuthSecret, body: &[u8]) -> Option<Hmac<Sha256>> {
    let mut mac = Hmac::<Sha256>::new_from_slice(secret.bytes()).ok()?;
    mac.update(PROOF_LABEL);
    mac.update(body);
    Some(mac)
}

/// The [`PROOF_HEADER`] value for a registration `body` (its exact bytes):
/// HMAC-SHA-256 keyed with the secret over a label of its own and the body,
/// in lowercase hex.
pub fn registration_proof(secret: &AuthSecret, body: &[u8]) -> String {
    let tag: [u8; PROOF_LEN] = proof_mac(secret, body).map_or([0; PROOF_LEN], |m| m.finalize().into_bytes().into());
    tag.iter().map(|b| format!("{b:02x}")).collect()
}

/// Whether `header` is the proof of `body` (hex in either case; compared in
/// constant time).
pub fn verify_registration_proof(secret: &AuthSecret, body: &[u8], header: &str) -> bool {
    let header = header.trim().as_bytes();
    if header.len() != 2 * PROOF_LEN {
        return false;
    }
    let mut proof = [0u8; PROOF_LEN];
    for (byte, pair) in proof.iter_mut().zip(header.chunks_exact(2)) {
        let digit = |c: u8| (c as char).to_digit(16);
        let (Some(hi), Some(lo)) = (digit(pair[0]), digit(pair[1])) else { return false };
        // Two hex digits fit a byte.
        *byte = (hi * 16 + lo) as u8;
    }
    proof_mac(secret, body).is_some_and(|m| m.verify_slice(&proof).is_ok())
}

// ---------------------------------------------------------------------------
// The registry
// ---------------------------------------------------------------------------

/// The workers a bootstrap server waits for: data-parallel ranks
/// `0..dp_size`, each with `tp_size * pp_size` workers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Expected {
    dp_size: u32,
    tp_size: u32,
    pp_size: u32,
}

impl Expected {
    /// `dp_size` engines of `tp_size` x `pp_size` workers: each size at
    /// least 1, at most [`MAX_BOOTSTRAP_WORKERS`] workers in all.
    pub fn new(dp_size: u32, tp_size: u32, pp_size: u32) -> Result<Self, BootstrapError> {
        let workers = u128::from(dp_size) * u128::from(tp_size) * u128::from(pp_size);
        if workers == 0 || workers > MAX_BOOTSTRAP_WORKERS as u128 {
            return Err(BootstrapError::Shape { dp_size, tp_size, pp_size });
        }
        Ok(Self { dp_size, tp_size, pp_size })
    }

    /// Data-parallel ranks.
    pub fn dp_size(&self) -> u32 {
        self.dp_size
    }

    /// Tensor-parallel ranks of each engine.
    pub fn tp_size(&self) -> u32 {
        self.tp_size
    }

    /// Pipeline-parallel ranks of each engine.
    pub fn pp_size(&self) -> u32 {
        self.pp_size
    }

    /// Workers in all (at most [`MAX_BOOTSTRAP_WORKERS`]).
    pub fn workers(&self) -> usize {
        (self.dp_size * self.tp_size * self.pp_size) as usize
    }

    fn contains(&self, dp_rank: u32, tp_rank: u32, pp_rank: u32) -> bool {
        dp_rank < self.dp_size && tp_rank < self.tp_size && pp_rank < self.pp_size
    }
}

impl fmt::Display for Expected {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "dp {} x tp {} x pp {}", self.dp_size, self.tp_size, self.pp_size)
    }
}

/// Why a registration was refused (the server answers 400 with its text;
/// the texts a client sent appear escaped).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RegisterRefusal {
    /// A rank outside the shape the server waits for.
    #[error("dp_rank={dp_rank}, tp_rank={tp_rank}, pp_rank={pp_rank} is outside the expected {expected}")]
    OutsideShape {
        /// Its data-parallel rank.
        dp_rank: u32,
        /// Its tensor-parallel rank.
        tp_rank: u32,
        /// Its pipeline-parallel rank.
        pp_rank: u32,
        /// The shape waited for.
        expected: Expected,
    },
    /// The data-parallel rank is registered under another engine id.
    #[error("engine id mismatch for dp_rank={dp_rank}: registered {registered:?}, offered {offered:?}")]
    EngineMismatch {
        /// The data-parallel rank.
        dp_rank: u32,
        /// The engine id registered first.
        registered: EngineId,
        /// The one offered now.
        offered: EngineId,
    },
    /// The engine id is registered under another data-parallel rank (a
    /// reply listing one engine twice could not say which rank D means).
    #[error("engine id {engine_id:?} is registered for dp_rank={registered} already, not for dp_rank={offered}")]
    EngineElsewhere {
        /// The engine id.
        engine_id: EngineId,
        /// The rank it is registered for.
        registered: u32,
        /// The rank offered now.
        offered: u32,
    },
    /// The worker is registered at another address.
    #[error("worker dp_rank={dp_rank}, tp_rank={tp_rank}, pp_rank={pp_rank} is registered at {registered} already, not at {offered}")]
    AddressConflict {
        /// Its data-parallel rank.
        dp_rank: u32,
        /// Its tensor-parallel rank.
        tp_rank: u32,
        /// Its pipeline-parallel rank.
        pp_rank: u32,
        /// The address registered first.
        registered: WorkerAddr,
        /// The one offered now.
        offered: WorkerAddr,
    },
}

/// One data-parallel rank's engine and the workers registered so far.
#[derive(Clone, Debug)]
struct EngineSlot {
    engine_id: EngineId,
    /// By `(tp_rank, pp_rank)`.
    workers: BTreeMap<(u32, u32), WorkerAddr>,
}

/// The bootstrap server's registry: who registered, decided as vLLM
/// decides, and whether every expected worker did.
#[derive(Clone, Debug)]
pub struct BootstrapRegistry {
    expected: Expected,
    engines: BTreeMap<u32, EngineSlot>,
    registered: usize,
}

/// What the registry still waits for (the text of a 503 and of log lines).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Missing {
    /// Workers registered.
    pub registered: usize,
    /// Workers expected.
    pub expected: usize,
    /// The first few workers not registered, as `(dp, tp, pp)`.
    pub first: Vec<(u32, u32, u32)>,
}

impl fmt::Display for Missing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} of {} prefill workers registered", self.registered, self.expected)?;
        if self.first.is_empty() {
            return Ok(());
        }
        f.write_str("; missing dp/tp/pp")?;
        for (i, (dp, tp, pp)) in self.first.iter().enumerate() {
            write!(f, "{} {dp}/{tp}/{pp}", if i == 0 { "" } else { "," })?;
        }
        let unlisted = self.expected - self.registered - self.first.len();
        if unlisted > 0 {
            write!(f, " and {unlisted} more")?;
        }
        Ok(())
    }
}

/// One engine's entry of a query reply, as serialized.
#[derive(Serialize)]
struct EngineJson<'a> {
    engine_id: &'a EngineId,
    /// serde_json writes integer keys as strings, as vLLM's reply has them.
    worker_addr: BTreeMap<u32, BTreeMap<u32, &'a WorkerAddr>>,
}

impl BootstrapRegistry {
    /// An empty registry waiting for `expected`.
    pub fn new(expected: Expected) -> Self {
        Self { expected, engines: BTreeMap::new(), registered: 0 }
    }

    /// The shape it waits for.
    pub fn expected(&self) -> Expected {
        self.expected
    }

    /// Registers a worker: refused when its ranks are outside the expected
    /// shape, when its data-parallel rank is registered under another
    /// engine id (or its engine id under another rank), or when the worker
    /// is registered at another address; the same registration again is
    /// accepted and changes nothing.
    pub fn register(&mut self, reg: &Registration) -> Result<(), RegisterRefusal> {
        let (dp_rank, tp_rank, pp_rank) = (reg.dp_rank, reg.tp_rank, reg.pp_rank);
        if !self.expected.contains(dp_rank, tp_rank, pp_rank) {
            return Err(RegisterRefusal::OutsideShape { dp_rank, tp_rank, pp_rank, expected: self.expected });
        }
        if let Some((&registered, _)) =
            self.engines.iter().find(|(&rank, slot)| rank != dp_rank && slot.engine_id == reg.engine_id)
        {
            return Err(RegisterRefusal::EngineElsewhere {
                engine_id: reg.engine_id.clone(),
                registered,
                offered: dp_rank,
            });
        }
        let slot = self
            .engines
            .entry(dp_rank)
            .or_insert_with(|| EngineSlot { engine_id: reg.engine_id.clone(), workers: BTreeMap::new() });
        if slot.engine_id != reg.engine_id {
            return Err(RegisterRefusal::EngineMismatch {
                dp_rank,
                registered: slot.engine_id.clone(),
                offered: reg.engine_id.clone(),
            });
        }
        match slot.workers.get(&(tp_rank, pp_rank)) {
            Some(registered) if *registered == reg.addr => Ok(()),
            Some(registered) => Err(RegisterRefusal::AddressConflict {
                dp_rank,
                tp_rank,
                pp_rank,
                registered: registered.clone(),
                offered: reg.addr.clone(),
            }),
            None => {
                slot.workers.insert((tp_rank, pp_rank), reg.addr.clone());
                self.registered += 1;
                Ok(())
            }
        }
    }

    /// Workers registered.
    pub fn registered(&self) -> usize {
        self.registered
    }

    /// Whether every expected worker registered.
    pub fn is_complete(&self) -> bool {
        // Only workers inside the shape are ever registered, once each.
        self.registered == self.expected.workers()
    }

    /// What is still missing (nothing once complete).
    pub fn missing(&self) -> Missing {
        let e = self.expected;
        let mut first = Vec::new();
        'ranks: for dp in 0..e.dp_size {
            let slot = self.engines.get(&dp);
            if slot.is_some_and(|s| s.workers.len() == (e.tp_size * e.pp_size) as usize) {
                continue;
            }
            for tp in 0..e.tp_size {
                for pp in 0..e.pp_size {
                    if !slot.is_some_and(|s| s.workers.contains_key(&(tp, pp))) {
                        if first.len() == MISSING_LISTED {
                            break 'ranks;
                        }
                        first.push((dp, tp, pp));
                    }
                }
            }
        }
        Missing { registered: self.registered, expected: e.workers(), first }
    }

    /// The reply to `GET /query`, once complete (`None` until then):
    /// `{"<dp>": {"engine_id": str, "worker_addr": {"<tp>": {"<pp>": "tcp://host:port"}}}}`,
    /// compact, ranks in numeric order.
    pub fn query_json(&self) -> Option<String> {
        if !self.is_complete() {
            return None;
        }
        let reply: BTreeMap<u32, EngineJson<'_>> = self
            .engines
            .iter()
            .map(|(&dp, slot)| {
                let mut worker_addr: BTreeMap<u32, BTreeMap<u32, &WorkerAddr>> = BTreeMap::new();
                for (&(tp, pp), addr) in &slot.workers {
                    worker_addr.entry(tp).or_default().insert(pp, addr);
                }
                (dp, EngineJson { engine_id: &slot.engine_id, worker_addr })
            })
            .collect();
        serde_json::to_string(&reply).ok()
    }
}

// ---------------------------------------------------------------------------
// The query reply, read back
// ---------------------------------------------------------------------------

/// One engine of a query reply: its id and its workers' addresses, every
/// tensor-parallel rank times every pipeline-parallel rank from 0.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineEntry {
    dp_rank: u32,
    engine_id: EngineId,
    tp_size: u32,
    pp_size: u32,
    /// By `(tp_rank, pp_rank)`.
    workers: BTreeMap<(u32, u32), WorkerAddr>,
}

impl EngineEntry {
    /// Its data-parallel rank (the key it was listed under).
    pub fn dp_rank(&self) -> u32 {
        self.dp_rank
    }

    /// Its engine id.
    pub fn engine_id(&self) -> &EngineId {
        &self.engine_id
    }

    /// The worker of tensor-parallel rank `tp` and pipeline-parallel rank `pp`.
    pub fn worker(&self, tp: u32, pp: u32) -> Option<WorkerAddr> {
        self.workers.get(&(tp, pp)).cloned()
    }

    /// Its tensor-parallel size.
    pub fn tp_size(&self) -> u32 {
        self.tp_size
    }

    /// Its pipeline-parallel size.
    pub fn pp_size(&self) -> u32 {
        self.pp_size
    }
}

/// A `GET /query` reply, parsed and checked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QueryReply {
    /// By data-parallel rank.
    engines: BTreeMap<u32, EngineEntry>,
}

/// What a rank key accepts, in errors.
const KEY_EXPECTED: &str = "a decimal rank in 0..1024 without sign or leading zeros";

/// A rank from an object key: canonical decimal only, so no two keys name
/// one rank.
fn rank_key(field: impl Fn() -> String, key: &str) -> Result<u32, BootstrapError> {
    let canonical = !key.is_empty() && key.bytes().all(|b| b.is_ascii_digit()) && (key == "0" || !key.starts_with('0'));
    key.parse::<u32>().ok().filter(|&r| canonical && r < MAX_PARALLEL_SIZE).ok_or_else(|| BootstrapError::Field {
        field: field(),
        expected: KEY_EXPECTED,
        got: shown(key),
    })
}

fn object(field: impl Fn() -> String, value: &Value) -> Result<&Map<String, Value>, BootstrapError> {
    value.as_object().ok_or_else(|| BootstrapError::Field {
        field: field(),
        expected: "an object",
        got: describe(value),
    })
}

impl QueryReply {
    /// Parses a query reply (at most [`MAX_QUERY_REPLY_BYTES`], at most
    /// [`MAX_BOOTSTRAP_WORKERS`] workers): keys are ranks, each engine's
    /// workers every tensor- times every pipeline-parallel rank, no engine
    /// id under two ranks. Unknown fields of an entry are ignored.
    pub fn parse(text: &str) -> Result<Self, BootstrapError> {
        const WHAT: &str = "the query reply";
        let value = json(WHAT, text, MAX_QUERY_REPLY_BYTES)?;
        let top = object(|| "the query reply".into(), &value)?;
        if top.len() > MAX_BOOTSTRAP_WORKERS {
            return Err(BootstrapError::TooMany { what: "the query reply".into(), limit: MAX_BOOTSTRAP_WORKERS });
        }
        let mut engines = BTreeMap::new();
        let mut owners: BTreeMap<EngineId, u32> = BTreeMap::new();
        let mut workers_seen = 0usize;
        for (key, entry) in top {
            let dp_rank = rank_key(|| "a data-parallel rank key".into(), key)?;
            let at = |name: &str| format!("\"{dp_rank}\".{name}");
            let fields = object(|| format!("\"{dp_rank}\""), entry)?;
            let field = |name: &'static str| {
                fields.get(name).filter(|v| !v.is_null()).ok_or_else(|| BootstrapError::Missing { field: at(name) })
            };
            let engine_id = engine_id(|| at("engine_id"), field("engine_id")?)?;
            let by_tp = object(|| at("worker_addr"), field("worker_addr")?)?;
            let mut workers = BTreeMap::new();
            for (tp_key, by_pp) in by_tp {
                let tp = rank_key(|| at("worker_addr key"), tp_key)?;
                let by_pp = object(|| at(&format!("worker_addr.\"{tp}\"")), by_pp)?;
                for (pp_key, addr) in by_pp {
                    let pp = rank_key(|| at(&format!("worker_addr.\"{tp}\" key")), pp_key)?;
                    workers_seen += 1;
                    if workers_seen > MAX_BOOTSTRAP_WORKERS {
                        return Err(BootstrapError::TooMany {
                            what: "the query reply's workers".into(),
                            limit: MAX_BOOTSTRAP_WORKERS,
                        });
                    }
                    let addr = worker_addr(|| at(&format!("worker_addr.\"{tp}\".\"{pp}\"")), addr)?;
                    workers.insert((tp, pp), addr);
                }
            }
            let (tp_size, pp_size) = rectangle(dp_rank, &workers)?;
            if let Some(&first) = owners.get(&engine_id) {
                return Err(BootstrapError::DuplicateEngine {
                    engine_id: shown(engine_id.as_str()),
                    first,
                    second: dp_rank,
                });
            }
            owners.insert(engine_id.clone(), dp_rank);
            engines.insert(dp_rank, EngineEntry { dp_rank, engine_id, tp_size, pp_size, workers });
        }
        Ok(Self { engines })
    }

    /// Parses a query reply's bytes (UTF-8 JSON).
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, BootstrapError> {
        if bytes.len() > MAX_QUERY_REPLY_BYTES {
            return Err(BootstrapError::TooLarge {
                what: "the query reply",
                len: bytes.len(),
                limit: MAX_QUERY_REPLY_BYTES,
            });
        }
        Self::parse(utf8("the query reply", bytes)?)
    }

    /// The engine named `engine_id`.
    pub fn engine(&self, engine_id: &str) -> Option<&EngineEntry> {
        self.engines.values().find(|e| e.engine_id.as_str() == engine_id)
    }

    /// The engine of data-parallel rank `dp_rank`.
    pub fn dp(&self, dp_rank: u32) -> Option<&EngineEntry> {
        self.engines.get(&dp_rank)
    }

    /// Every engine, by data-parallel rank.
    pub fn engines(&self) -> impl Iterator<Item = &EngineEntry> {
        self.engines.values()
    }

    /// How many engines (data-parallel ranks) it lists.
    pub fn len(&self) -> usize {
        self.engines.len()
    }

    /// Whether it lists none.
    pub fn is_empty(&self) -> bool {
        self.engines.is_empty()
    }
}

/// The sizes of a full `tp x pp` set of workers, or why it is not one.
fn rectangle(dp_rank: u32, workers: &BTreeMap<(u32, u32), WorkerAddr>) -> Result<(u32, u32), BootstrapError> {
    let tp_size = workers.keys().map(|&(tp, _)| tp + 1).max().unwrap_or(0);
    let pp_size = workers.keys().map(|&(_, pp)| pp + 1).max().unwrap_or(0);
    // Keys are distinct and within the sizes, so a full set has exactly tp x pp of them.
    if tp_size == 0 || workers.len() != (tp_size * pp_size) as usize {
        return Err(BootstrapError::NotRectangular { dp_rank, tp_size, pp_size });
    }
    Ok((tp_size, pp_size))
}

// ---------------------------------------------------------------------------
// Error bodies
// ---------------------------------------------------------------------------

/// A JSON error body `{"detail": text}`, as FastAPI writes one.
pub fn detail_json(text: &str) -> String {
    let mut body = Map::new();
    body.insert("detail".into(), Value::String(text.to_owned()));
    Value::Object(body).to_string()
}

/// The `detail` of an error reply, escaped and cut to at most `max_chars`
/// characters: the string itself, other JSON as its text, a body that is
/// no JSON object with a `detail` as its (lossy) text.
pub fn reply_detail(body: &[u8], max_chars: usize) -> String {
    let text = String::from_utf8_lossy(body);
    let detail = match serde_json::from_str::<Value>(&text) {
        Ok(Value::Object(mut fields)) => match fields.remove("detail") {
            Some(Value::String(s)) => s,
            Some(other) => other.to_string(),
            None => text.into_owned(),
        },
        _ => text.into_owned(),
    };
    escape_bounded(detail.trim(), max_chars)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use rstest::rstest;

    use super::*;

    fn addr(text: &str) -> WorkerAddr {
        WorkerAddr::parse(text).unwrap()
    }

    fn reg(engine: &str, dp: u32, tp: u32, pp: u32, at: &str) -> Registration {
        Registration { engine_id: EngineId::new(engine), dp_rank: dp, tp_rank: tp, pp_rank: pp, addr: addr(at) }
    }

    fn shape(dp: u32, tp: u32, pp: u32) -> Expected {
        Expected::new(dp, tp, pp).unwrap()
    }

    // --- addresses ---

    #[rstest]
    #[case::ipv4("tcp://10.0.0.2:5600", "10.0.0.2", 5600)]
    #[case::name("tcp://prefill-0.cluster_local:1", "prefill-0.cluster_local", 1)]
    #[case::ipv6("tcp://[fe80::1]:65535", "fe80::1", 65535)]
    #[case::ipv6_mapped("tcp://[::ffff:1.2.3.4]:7", "::ffff:1.2.3.4", 7)]
    fn worker_addresses_parse_and_print_back(#[case] text: &str, #[case] host: &str, #[case] port: u16) {
        let a = WorkerAddr::parse(text).unwrap();
        assert_eq!((a.host(), a.port()), (host, port));
        assert_eq!(a.to_string(), text);
        assert_eq!(WorkerAddr::new(host, port).unwrap(), a);
    }

    #[rstest]
    #[case::no_scheme("10.0.0.2:5600")]
    #[case::http("http://10.0.0.2:5600")]
    #[case::no_port("tcp://10.0.0.2")]
    #[case::empty_port("tcp://10.0.0.2:")]
    #[case::port_zero("tcp://10.0.0.2:0")]
    #[case::port_too_big("tcp://10.0.0.2:65536")]
    #[case::port_huge("tcp://10.0.0.2:99999999999999999999")]
    #[case::port_signed("tcp://10.0.0.2:+80")]
    #[case::port_negative("tcp://10.0.0.2:-1")]
    #[case::empty_host("tcp://:80")]
    #[case::ipv6_unbracketed("tcp://fe80::1:80")]
    #[case::ipv6_unclosed("tcp://[fe80::1:80")]
    #[case::brackets_not_v6("tcp://[10.0.0.2]:80")]
    #[case::bad_v6("tcp://[fe80::zz]:80")]
    #[case::v6_zone("tcp://[fe80::1%eth0]:80")]
    #[case::path("tcp://10.0.0.2:80/x")]
    #[case::space("tcp://10.0.0 .2:80")]
    #[case::empty_label("tcp://a..b:80")]
    #[case::control("tcp://a\u{0}b:80")]
    #[case::empty("")]
    fn bad_worker_addresses_are_refused(#[case] text: &str) {
        let err = WorkerAddr::parse(text).unwrap_err();
        assert!(matches!(err, BootstrapError::Addr { .. }), "{err:?}");
        assert!(!err.to_string().contains('\0'), "escaped: {err}");
    }

    #[test]
    fn long_hosts_are_refused() {
        let label = "a".repeat(63);
        let ok = [label.as_str(); 4].join(".");
        assert_eq!(ok.len(), 255);
        assert!(WorkerAddr::parse(&format!("tcp://{}:1", &ok[..253])).is_ok());
        assert!(WorkerAddr::parse(&format!("tcp://{ok}:1")).is_err());
        assert!(WorkerAddr::parse(&format!("tcp://{}:1", "a".repeat(64))).is_err(), "a label over 63 bytes");
        let err = WorkerAddr::parse(&format!("tcp://{}:1", "a".repeat(5000))).unwrap_err();
        assert!(err.to_string().len() < 300, "the error is cut short: {err}");
    }

    #[rstest]
    #[case::plain("http://10.0.0.2:8998", "10.0.0.2", 8998)]
    #[case::trailing_slash("http://10.0.0.2:8998/", "10.0.0.2", 8998)]
    #[case::upper_scheme("HTTP://p0:8998", "p0", 8998)]
    #[case::ipv6("http://[::1]:8998", "::1", 8998)]
    #[case::default_port("http://p0", "p0", 80)]
    #[case::ipv6_default_port("http://[::1]/", "::1", 80)]
    fn bootstrap_urls_parse(#[case] text: &str, #[case] host: &str, #[case] port: u16) {
        let url = BootstrapUrl::parse(text).unwrap();
        assert_eq!((url.host(), url.port()), (host, port));
        assert_eq!(BootstrapUrl::parse(&url.to_string()).unwrap(), url);
    }

    #[rstest]
    #[case::no_scheme("10.0.0.2:8998", "scheme is required")]
    #[case::https("https://10.0.0.2:8998", "https is not supported")]
    #[case::tcp("tcp://10.0.0.2:8998", "must be http")]
    #[case::path("http://10.0.0.2:8998/query", "no path")]
    #[case::query("http://10.0.0.2:8998?x", "no path")]
    #[case::userinfo("http://u@10.0.0.2:8998", "user information")]
    #[case::port_zero("http://10.0.0.2:0", "port")]
    #[case::empty_host("http://:8998", "empty")]
    #[case::ipv6_bare("http://::1:8998", "brackets")]
    fn bad_bootstrap_urls_say_why(#[case] text: &str, #[case] says: &str) {
        let err = BootstrapUrl::parse(text).unwrap_err().to_string();
        assert!(err.contains(says), "{text}: {err}");
    }

    // --- registrations ---

    #[rstest]
    #[case::compact(r#"{"engine_id":"e","dp_rank":1,"tp_rank":2,"pp_rank":3,"addr":"tcp://1.2.3.4:5"}"#)]
    #[case::python_style(
        "{\"addr\": \"tcp://1.2.3.4:5\",  \"pp_rank\": 3, \"tp_rank\": 2,\n \"dp_rank\": 1, \"engine_id\": \"e\"}\n"
    )]
    #[case::extra_keys(
        r#"{"engine_id":"e","dp_rank":1,"tp_rank":2,"pp_rank":3,"addr":"tcp://1.2.3.4:5","zone":[1,{"a":null}]}"#
    )]
    fn registrations_parse_whatever_the_order_and_spacing(#[case] body: &str) {
        assert_eq!(Registration::parse(body.as_bytes()).unwrap(), reg("e", 1, 2, 3, "tcp://1.2.3.4:5"));
    }

    #[test]
    fn a_registration_round_trips_in_vllms_field_order() {
        let r = reg("eng_dp1", 1, 0, 0, "tcp://[::1]:7000");
        let body = r.to_json();
        assert_eq!(body, r#"{"engine_id":"eng_dp1","dp_rank":1,"tp_rank":0,"pp_rank":0,"addr":"tcp://[::1]:7000"}"#);
        assert_eq!(Registration::parse(body.as_bytes()).unwrap(), r);
    }

    fn body_with(field: &str, value: &str) -> String {
        let mut fields = vec![
            ("engine_id", r#""e""#.to_owned()),
            ("dp_rank", "0".into()),
            ("tp_rank", "0".into()),
            ("pp_rank", "0".into()),
            ("addr", r#""tcp://1.2.3.4:5""#.into()),
        ];
        fields.retain(|(name, _)| *name != field);
        if !value.is_empty() {
            fields.push((field, value.into()));
        }
        let inner: Vec<String> = fields.iter().map(|(k, v)| format!("\"{k}\": {v}")).collect();
        format!("{{{}}}", inner.join(", "))
    }

    #[rstest]
    #[case::missing_engine("engine_id", "", "engine_id is missing")]
    #[case::null_engine("engine_id", "null", "engine_id is missing")]
    #[case::engine_number("engine_id", "7", "engine_id must be")]
    #[case::engine_empty("engine_id", r#""""#, "engine_id must be")]
    #[case::engine_control("engine_id", r#""a\u0001b""#, "engine_id must be")]
    #[case::missing_dp("dp_rank", "", "dp_rank is missing")]
    #[case::dp_negative("dp_rank", "-1", "dp_rank must be an integer rank in 0..1024, got -1")]
    #[case::dp_too_big("dp_rank", "1024", "dp_rank must be")]
    #[case::dp_huge("dp_rank", "123456789012345678901234567890", "dp_rank must be")]
    #[case::dp_float("dp_rank", "1.0", "dp_rank must be")]
    #[case::dp_exponent("tp_rank", "1e2", "tp_rank must be")]
    #[case::dp_string("dp_rank", r#""0""#, "dp_rank must be an integer rank in 0..1024, got a string of 1 bytes")]
    #[case::dp_bool("pp_rank", "true", "pp_rank must be")]
    #[case::tp_array("tp_rank", "[0]", "tp_rank must be")]
    #[case::pp_object("pp_rank", "{}", "pp_rank must be")]
    #[case::addr_number("addr", "5", "addr must be a string")]
    #[case::addr_bad("addr", r#""tcp://x""#, "port is required")]
    #[case::addr_http("addr", r#""http://1.2.3.4:5""#, "tcp://")]
    fn bad_registrations_name_the_field(#[case] field: &str, #[case] value: &str, #[case] says: &str) {
        let body = body_with(field, value);
        let err = Registration::parse(body.as_bytes()).unwrap_err().to_string();
        assert!(err.contains(says), "{body}: {err}");
    }

    #[rstest]
    #[case::not_json(b"engine_id=e".as_slice(), "not valid JSON")]
    #[case::empty(b"".as_slice(), "not valid JSON")]
    #[case::array(b"[1,2]".as_slice(), "must be a JSON object")]
    #[case::string(br#""x""#.as_slice(), "must be a JSON object")]
    #[case::not_utf8(b"{\"engine_id\": \"\xff\"}".as_slice(), "not UTF-8")]
    #[case::truncated(br#"{"engine_id": "e", "dp_rank""#.as_slice(), "not valid JSON")]
    #[case::trailing(br#"{"engine_id":"e","dp_rank":0,"tp_rank":0,"pp_rank":0,"addr":"tcp://a:1"} x"#.as_slice(), "not valid JSON")]
    fn hostile_registration_bodies_are_errors(#[case] body: &[u8], #[case] says: &str) {
        let err = Registration::parse(body).unwrap_err().to_string();
        assert!(err.contains(says), "{err}");
    }

    #[test]
    fn deep_nesting_and_size_are_bounded() {
        let deep =
            format!("{}{}", "[".repeat(MAX_REGISTRATION_BYTES / 2 - 1), "]".repeat(MAX_REGISTRATION_BYTES / 2 - 1));
        let err = Registration::parse(deep.as_bytes()).unwrap_err().to_string();
        assert!(err.contains("recursion limit"), "{err}");
        let big = format!(r#"{{"engine_id": "{}"}}"#, "e".repeat(MAX_REGISTRATION_BYTES));
        assert!(matches!(Registration::parse(big.as_bytes()), Err(BootstrapError::TooLarge { .. })));
        let long_id = body_with("engine_id", &format!("\"{}\"", "e".repeat(MAX_TEXT_LEN + 1)));
        let err = Registration::parse(long_id.as_bytes()).unwrap_err().to_string();
        assert!(err.contains("engine_id must be") && err.contains("1025 bytes"), "{err}");
    }

    // --- proofs ---

    #[test]
    fn proofs_bind_the_secret_and_the_exact_body() {
        let secret = AuthSecret::new("s3cret");
        let body = reg("e", 0, 0, 0, "tcp://1.2.3.4:5").to_json();
        let proof = registration_proof(&secret, body.as_bytes());
        assert_eq!(proof.len(), 64);
        assert!(verify_registration_proof(&secret, body.as_bytes(), &proof));
        assert!(verify_registration_proof(&secret, body.as_bytes(), &proof.to_uppercase()), "either case");
        assert!(verify_registration_proof(&secret, body.as_bytes(), &format!(" {proof} ")), "header whitespace");
        assert!(!verify_registration_proof(&AuthSecret::new("other"), body.as_bytes(), &proof));
        assert!(!verify_registration_proof(&secret, format!("{body} ").as_bytes(), &proof), "another body");
        for bad in ["", "00", &proof[..62], &format!("{proof}00"), &"zz".repeat(32), &"é".repeat(32)].map(str::to_owned)
        {
            assert!(!verify_registration_proof(&secret, body.as_bytes(), &bad), "{bad:?}");
        }
        // Not the plain MAC of the body: the label separates it from other uses of the secret.
        let mut plain = Hmac::<Sha256>::new_from_slice(secret.bytes()).unwrap();
        plain.update(body.as_bytes());
        let plain: String = plain.finalize().into_bytes().iter().map(|b| format!("{b:02x}")).collect();
        assert_ne!(plain, proof);
    }

    // --- registry ---

    #[test]
    fn registering_every_worker_completes_the_registry_in_any_order() {
        let mut registry = BootstrapRegistry::new(shape(2, 2, 2));
        let mut all = Vec::new();
        for dp in 0..2 {
            for tp in 0..2 {
                for pp in 0..2 {
                    all.push(reg(&format!("eng_dp{dp}"), dp, tp, pp, &format!("tcp://10.0.{dp}.{tp}:{}", 6000 + pp)));
                }
            }
        }
        all.reverse();
        for (i, r) in all.iter().enumerate() {
            assert!(!registry.is_complete());
            assert_eq!(registry.query_json(), None, "no reply before every worker registered");
            assert_eq!(registry.missing().registered, i);
            registry.register(r).unwrap();
        }
        assert!(registry.is_complete());
        assert_eq!(registry.missing(), Missing { registered: 8, expected: 8, first: vec![] });
        let json = registry.query_json().unwrap();
        let expected = serde_json::json!({
            "0": {"engine_id": "eng_dp0", "worker_addr": {
                "0": {"0": "tcp://10.0.0.0:6000", "1": "tcp://10.0.0.0:6001"},
                "1": {"0": "tcp://10.0.0.1:6000", "1": "tcp://10.0.0.1:6001"}}},
            "1": {"engine_id": "eng_dp1", "worker_addr": {
                "0": {"0": "tcp://10.0.1.0:6000", "1": "tcp://10.0.1.0:6001"},
                "1": {"0": "tcp://10.0.1.1:6000", "1": "tcp://10.0.1.1:6001"}}},
        });
        assert_eq!(serde_json::from_str::<Value>(&json).unwrap(), expected);
        assert!(json.starts_with(r#"{"0":{"engine_id":"eng_dp0","worker_addr":{"0":{"0":"tcp://"#), "{json}");
        let back = QueryReply::parse(&json).unwrap();
        let e1 = back.engine("eng_dp1").unwrap();
        assert_eq!((e1.dp_rank(), e1.tp_size(), e1.pp_size()), (1, 2, 2));
        assert_eq!(e1.worker(1, 1), Some(addr("tcp://10.0.1.1:6001")));
        assert_eq!(e1.worker(2, 0), None);
    }

    #[test]
    fn ranks_sort_numerically_in_the_reply() {
        let mut registry = BootstrapRegistry::new(shape(11, 1, 1));
        for dp in 0..11 {
            registry.register(&reg(&format!("e{dp}"), dp, 0, 0, "tcp://h:1")).unwrap();
        }
        let json = registry.query_json().unwrap();
        let keys: Vec<u32> = QueryReply::parse(&json).unwrap().engines().map(EngineEntry::dp_rank).collect();
        assert_eq!(keys, (0..11).collect::<Vec<_>>());
        assert!(json.find("\"9\":").unwrap() < json.find("\"10\":").unwrap(), "{json}");
    }

    /// What each registration after the first meets.
    #[derive(Debug)]
    enum Then {
        Accepted,
        OutsideShape,
        EngineMismatch,
        EngineElsewhere,
        AddressConflict,
    }

    #[rstest]
    #[case::identical_again(reg("e", 0, 0, 0, "tcp://a:1"), Then::Accepted)]
    #[case::another_worker_same_engine(reg("e", 0, 1, 0, "tcp://a:2"), Then::Accepted)]
    #[case::another_dp_rank(reg("f", 1, 0, 0, "tcp://a:1"), Then::Accepted)]
    #[case::same_rank_other_addr(reg("e", 0, 0, 0, "tcp://a:2"), Then::AddressConflict)]
    #[case::same_dp_other_engine(reg("f", 0, 1, 0, "tcp://a:2"), Then::EngineMismatch)]
    #[case::same_rank_other_engine_and_addr(reg("f", 0, 0, 0, "tcp://b:9"), Then::EngineMismatch)]
    #[case::same_engine_other_dp_rank(reg("e", 1, 0, 0, "tcp://a:3"), Then::EngineElsewhere)]
    #[case::dp_outside(reg("e", 2, 0, 0, "tcp://a:1"), Then::OutsideShape)]
    #[case::tp_outside(reg("e", 0, 2, 0, "tcp://a:1"), Then::OutsideShape)]
    #[case::pp_outside(reg("e", 0, 0, 1, "tcp://a:1"), Then::OutsideShape)]
    fn registrations_are_decided_as_vllm_decides(#[case] second: Registration, #[case] then: Then) {
        let mut registry = BootstrapRegistry::new(shape(2, 2, 1));
        registry.register(&reg("e", 0, 0, 0, "tcp://a:1")).unwrap();
        let result = registry.register(&second);
        match (then, &result) {
            (Then::Accepted, Ok(())) => {}
            (Then::OutsideShape, Err(RegisterRefusal::OutsideShape { .. }))
            | (Then::EngineMismatch, Err(RegisterRefusal::EngineMismatch { .. }))
            | (Then::EngineElsewhere, Err(RegisterRefusal::EngineElsewhere { .. }))
            | (Then::AddressConflict, Err(RegisterRefusal::AddressConflict { .. })) => {
                // A refusal changes nothing.
                assert_eq!(registry.registered(), 1);
                assert_eq!(registry.register(&reg("e", 0, 0, 0, "tcp://a:1")), Ok(()));
            }
            (then, got) => panic!("expected {then:?}, got {got:?}"),
        }
    }

    #[test]
    fn refusals_escape_what_the_client_sent() {
        let mut registry = BootstrapRegistry::new(shape(1, 1, 1));
        registry.register(&reg("e", 0, 0, 0, "tcp://a:1")).unwrap();
        let text = registry.register(&reg("x\"\u{7f}\u{202e}y", 0, 0, 0, "tcp://a:1")).unwrap_err().to_string();
        assert!(text.contains(r#"offered "x\"\u{7f}\u{202e}y""#), "{text}");
    }

    #[test]
    fn missing_lists_the_first_few_and_counts_the_rest() {
        let mut registry = BootstrapRegistry::new(shape(2, 4, 2));
        registry.register(&reg("e", 0, 0, 0, "tcp://a:1")).unwrap();
        registry.register(&reg("e", 0, 0, 1, "tcp://a:2")).unwrap();
        let missing = registry.missing();
        assert_eq!(missing.registered, 2);
        assert_eq!(missing.expected, 16);
        assert_eq!(
            missing.first,
            vec![(0, 1, 0), (0, 1, 1), (0, 2, 0), (0, 2, 1), (0, 3, 0), (0, 3, 1), (1, 0, 0), (1, 0, 1)]
        );
        assert_eq!(
            missing.to_string(),
            "2 of 16 prefill workers registered; missing dp/tp/pp 0/1/0, 0/1/1, 0/2/0, 0/2/1, 0/3/0, 0/3/1, 1/0/0, 1/0/1 and 6 more"
        );
    }

    #[rstest]
    #[case::zero_dp(0, 1, 1)]
    #[case::zero_tp(1, 0, 1)]
    #[case::zero_pp(1, 1, 0)]
    #[case::too_many(2, 1024, 1)]
    #[case::overflowing(u32::MAX, u32::MAX, u32::MAX)]
    fn impossible_shapes_are_refused(#[case] dp: u32, #[case] tp: u32, #[case] pp: u32) {
        assert!(matches!(Expected::new(dp, tp, pp), Err(BootstrapError::Shape { .. })));
    }

    #[test]
    fn the_largest_registry_fits_a_reply() {
        // Most engines, each id as long as allowed and twice as long escaped.
        let expected = shape(MAX_BOOTSTRAP_WORKERS as u32, 1, 1);
        let mut registry = BootstrapRegistry::new(expected);
        let host = format!("{}.{}.{}.{}", "h".repeat(63), "h".repeat(63), "h".repeat(63), "h".repeat(61));
        for dp in 0..expected.dp_size() {
            let id = format!("{dp:04}{}", "\"".repeat(MAX_TEXT_LEN - 4));
            registry.register(&reg(&id, dp, 0, 0, &format!("tcp://{host}:65535"))).unwrap();
        }
        let json = registry.query_json().unwrap();
        assert!(json.len() <= MAX_QUERY_REPLY_BYTES, "{} bytes", json.len());
        assert_eq!(QueryReply::parse(&json).unwrap().len(), MAX_BOOTSTRAP_WORKERS);
        // The most workers, with the longest IPv6 addresses.
        let expected = shape(1, 32, 32);
        let mut registry = BootstrapRegistry::new(expected);
        for tp in 0..32 {
            for pp in 0..32 {
                let a = format!("tcp://[ffff:ffff:ffff:ffff:ffff:ffff:255.255.255.255]:{}", 1 + tp * 32 + pp);
                registry.register(&reg("e", 0, tp, pp, &a)).unwrap();
            }
        }
        let json = registry.query_json().unwrap();
        assert!(json.len() <= MAX_QUERY_REPLY_BYTES);
        let back = QueryReply::parse(&json).unwrap();
        assert_eq!((back.dp(0).unwrap().tp_size(), back.dp(0).unwrap().pp_size()), (32, 32));
    }

    // --- query replies ---

    #[test]
    fn vllms_reply_parses() {
        // As FastAPI writes it, and as pretty-printed by hand.
        for text in [
            r#"{"0":{"engine_id":"eng-1","worker_addr":{"0":{"0":"tcp://1.1.1.1:1111","1":"tcp://2.2.2.2:2222"}}}}"#,
            "{ \"0\" : { \"worker_addr\" : { \"0\" : { \"1\" : \"tcp://2.2.2.2:2222\", \"0\": \"tcp://1.1.1.1:1111\" } },\n \"engine_id\" : \"eng-1\", \"extra\": 1 } }",
        ] {
            let reply = QueryReply::parse(text).unwrap();
            assert_eq!(reply.len(), 1);
            let e = reply.engine("eng-1").unwrap();
            assert_eq!((e.dp_rank(), e.tp_size(), e.pp_size()), (0, 1, 2));
            assert_eq!(e.worker(0, 1), Some(addr("tcp://2.2.2.2:2222")));
            assert_eq!(reply.engine("eng-2"), None);
        }
        assert!(QueryReply::parse("{}").unwrap().is_empty(), "an empty registry parses (as nothing)");
    }

    fn entry(id: &str, workers: &str) -> String {
        format!(r#"{{"engine_id":"{id}","worker_addr":{workers}}}"#)
    }

    #[rstest]
    #[case::not_json("nope", "not valid JSON")]
    #[case::array("[]", "the query reply must be an object")]
    #[case::null("null", "must be an object, got null")]
    #[case::negative_key(&format!(r#"{{"-1":{}}}"#, entry("e", r#"{"0":{"0":"tcp://a:1"}}"#)), "rank key must be")]
    #[case::signed_key(&format!(r#"{{"+1":{}}}"#, entry("e", r#"{"0":{"0":"tcp://a:1"}}"#)), "rank key must be")]
    #[case::leading_zero(&format!(r#"{{"01":{}}}"#, entry("e", r#"{"0":{"0":"tcp://a:1"}}"#)), "rank key must be")]
    #[case::huge_key(&format!(r#"{{"99999999999999999999":{}}}"#, entry("e", r#"{"0":{"0":"tcp://a:1"}}"#)), "rank key must be")]
    #[case::word_key(&format!(r#"{{"zero":{}}}"#, entry("e", r#"{"0":{"0":"tcp://a:1"}}"#)), "got \"zero\"")]
    #[case::entry_not_object(r#"{"0":"e"}"#, "\"0\" must be an object, got a string")]
    #[case::missing_engine(r#"{"0":{"worker_addr":{"0":{"0":"tcp://a:1"}}}}"#, "\"0\".engine_id is missing")]
    #[case::engine_number(r#"{"0":{"engine_id":1,"worker_addr":{"0":{"0":"tcp://a:1"}}}}"#, "\"0\".engine_id must be")]
    #[case::missing_workers(r#"{"0":{"engine_id":"e"}}"#, "\"0\".worker_addr is missing")]
    #[case::workers_list(&format!(r#"{{"0":{}}}"#, entry("e", r#"["tcp://a:1"]"#)), "\"0\".worker_addr must be an object")]
    #[case::tp_key_bad(&format!(r#"{{"0":{}}}"#, entry("e", r#"{"x":{"0":"tcp://a:1"}}"#)), "worker_addr key must be")]
    #[case::pp_not_object(&format!(r#"{{"0":{}}}"#, entry("e", r#"{"0":"tcp://a:1"}"#)), "worker_addr.\"0\" must be an object")]
    #[case::addr_number(&format!(r#"{{"0":{}}}"#, entry("e", r#"{"0":{"0":5}}"#)), "worker_addr.\"0\".\"0\" must be a string")]
    #[case::addr_bad(&format!(r#"{{"0":{}}}"#, entry("e", r#"{"0":{"0":"udp://a:1"}}"#)), "tcp://")]
    #[case::no_workers(&format!(r#"{{"0":{}}}"#, entry("e", "{}")), "not every tp rank")]
    #[case::hole_in_tp(&format!(r#"{{"0":{}}}"#, entry("e", r#"{"0":{"0":"tcp://a:1"},"2":{"0":"tcp://a:2"}}"#)), "not every tp rank")]
    #[case::ragged_pp(&format!(r#"{{"0":{}}}"#, entry("e", r#"{"0":{"0":"tcp://a:1","1":"tcp://a:2"},"1":{"0":"tcp://a:3"}}"#)), "not every tp rank")]
    #[case::duplicate_engine(&format!(r#"{{"0":{},"1":{}}}"#, entry("e", r#"{"0":{"0":"tcp://a:1"}}"#), entry("e", r#"{"0":{"0":"tcp://a:2"}}"#)), "listed under data-parallel ranks 0 and 1")]
    fn hostile_query_replies_are_errors(#[case] text: &str, #[case] says: &str) {
        let err = QueryReply::parse(text).unwrap_err().to_string();
        assert!(err.contains(says), "{text}: {err}");
    }

    #[test]
    fn query_replies_are_bounded() {
        let too_big = " ".repeat(MAX_QUERY_REPLY_BYTES + 1);
        assert!(matches!(QueryReply::parse(&too_big), Err(BootstrapError::TooLarge { .. })));
        assert!(matches!(QueryReply::from_bytes(too_big.as_bytes()), Err(BootstrapError::TooLarge { .. })));
        assert!(matches!(QueryReply::from_bytes(b"{\"0\xff\":1}"), Err(BootstrapError::NotUtf8 { .. })));
        let deep = format!("{}{}", "{\"0\":".repeat(200), "}".repeat(200));
        assert!(QueryReply::parse(&deep).unwrap_err().to_string().contains("recursion limit"));
        let engines: Vec<String> = (0..=MAX_BOOTSTRAP_WORKERS)
            .map(|dp| format!("\"{dp}\":{}", entry(&format!("e{dp}"), r#"{"0":{"0":"tcp://a:1"}}"#)))
            .collect();
        let many = format!("{{{}}}", engines.join(","));
        // MAX_BOOTSTRAP_WORKERS + 1 engines: also past the rank bound, but the count is checked first.
        assert!(matches!(QueryReply::parse(&many), Err(BootstrapError::TooMany { .. })), "too many engines");
        let workers: Vec<String> = (0..32).map(|pp| format!("\"{pp}\":\"tcp://a:{}\"", pp + 1)).collect();
        let row = format!("{{{}}}", workers.join(","));
        let rows: Vec<String> = (0..33).map(|tp| format!("\"{tp}\":{row}")).collect();
        let wide = format!("{{\"0\":{}}}", entry("e", &format!("{{{}}}", rows.join(","))));
        assert!(matches!(QueryReply::parse(&wide), Err(BootstrapError::TooMany { .. })), "too many workers");
    }

    // --- error bodies ---

    #[rstest]
    #[case::string(br#"{"detail": "Engine ID mismatch"}"#.as_slice(), "Engine ID mismatch")]
    #[case::fastapi_list(br#"{"detail":[{"loc":["body","dp_rank"]}]}"#.as_slice(), r#"[{"loc":["body","dp_rank"]}]"#)]
    #[case::no_detail(br#"{"x":1}"#.as_slice(), r#"{"x":1}"#)]
    #[case::plain_text(b"Internal Server Error\n".as_slice(), "Internal Server Error")]
    #[case::control(b"\x1b[31mred\x00".as_slice(), r"\u{1b}[31mred\u{0}")]
    #[case::bidi("a\u{202e}b\u{200b}".as_bytes(), r"a\u{202e}b\u{200b}")]
    #[case::not_utf8(b"a\xffb".as_slice(), "a\u{fffd}b")]
    fn error_details_are_extracted_escaped(#[case] body: &[u8], #[case] detail: &str) {
        assert_eq!(reply_detail(body, 200), detail);
    }

    #[test]
    fn details_are_cut_and_bodies_are_json() {
        assert_eq!(reply_detail("x".repeat(1000).as_bytes(), 10), format!("{}…", "x".repeat(10)));
        assert_eq!(escape_bounded("ab", 2), "ab");
        let body = detail_json("say \"hi\"\n");
        assert_eq!(body, r#"{"detail":"say \"hi\"\n"}"#);
        assert_eq!(reply_detail(body.as_bytes(), 100), r#"say "hi""#);
        assert_eq!(escape_bounded("\u{7}é\\", 100), r"\u{7}é\", "only the hidden are escaped");
        assert_eq!(escape_bounded("\u{0}\u{0}", 5), r"\u{0}…", "cut in the escaped form");
        assert_eq!(serde_json::from_str::<Value>(REGISTERED_JSON).unwrap(), serde_json::json!({"status": "ok"}));
    }
}
