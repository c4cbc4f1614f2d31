//! `bootstrap_http`: peer bytes into the sans-I/O bootstrap contract of
//! vLLM's Mooncake deployment (`kv_proto::bootstrap`), and a registry
//! driven by the registrations that parse.

use std::collections::BTreeMap;
use std::fmt::Display;

use kv_proto::auth::AuthSecret;
use kv_proto::bootstrap::{
    escape_bounded, registration_proof, reply_detail, verify_registration_proof, BootstrapRegistry, BootstrapUrl,
    Expected, Missing, QueryReply, RegisterRefusal, Registration, WorkerAddr, MAX_BOOTSTRAP_WORKERS,
    MAX_QUERY_REPLY_BYTES, MAX_REGISTRATION_BYTES,
};
use kv_proto::EngineId;
use serde_json::Value;

/// Registrations (lines) fed to the registry at most.
const MAX_REGISTRATIONS: usize = 64;
/// Characters of an error's text at most: the fixed words, a few short
/// paths and numbers, and a peer's text only escaped and cut to 64
/// characters (once) or as a parser's message.
const MAX_ERROR_CHARS: usize = 512;
/// Registrations listed by name in `Missing` (kv-proto's `MISSING_LISTED`).
const MISSING_LISTED: usize = 8;

/// What `escape_bounded` promises never to let through: control characters,
/// bidirectional marks, overrides and isolates, line and paragraph
/// separators, zero-width and soft marks and joiners, the byte-order mark,
/// interlinear annotation and tag characters.
fn hidden(c: char) -> bool {
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
}

/// `text` holds nothing hidden.
fn assert_visible(what: &str, text: &str) {
    assert!(!text.chars().any(hidden), "{what} holds a hidden character: {text:?}");
}

/// An error's text: visible and short, whatever the peer sent.
fn assert_error_text(what: &str, error: &impl Display) {
    let text = error.to_string();
    assert_visible(what, &text);
    let chars = text.chars().count();
    assert!(chars <= MAX_ERROR_CHARS, "{what}'s text is {chars} characters: {text:?}");
}

/// `escape_bounded(text, max)`: nothing hidden, no more than `max`
/// characters of the whole escaped text and "…" exactly when cut; text with
/// nothing hidden is kept as it is.
fn check_escape(text: &str, max: usize) -> String {
    let full = escape_bounded(text, usize::MAX);
    assert_visible("escape_bounded's output", &full);
    if !text.chars().any(hidden) {
        assert_eq!(full, text, "escape_bounded changed text with nothing hidden");
    }
    let out = escape_bounded(text, max);
    let full_chars = full.chars().count();
    if full_chars <= max {
        assert_eq!(out, full, "escape_bounded cut what fits {max} characters");
    } else {
        let kept: String = full.chars().take(max).collect();
        assert_eq!(out, format!("{kept}…"), "escape_bounded is not the first {max} escaped characters and a mark");
    }
    assert!(out.chars().count() <= max + 1, "escape_bounded kept more than {max} characters and the mark");
    out
}

/// `reply_detail(body, max)`: as documented (the `detail` string, other
/// JSON as its text, else the lossy body, trimmed), escaped and cut.
fn check_reply_detail(body: &[u8], max: usize) {
    let text = String::from_utf8_lossy(body);
    let detail = match serde_json::from_str::<Value>(&text) {
        Ok(Value::Object(mut fields)) => match fields.remove("detail") {
            Some(Value::String(s)) => s,
            Some(other) => other.to_string(),
            None => text.to_string(),
        },
        _ => text.to_string(),
    };
    let out = reply_detail(body, max);
    assert_visible("reply_detail", &out);
    assert!(out.chars().count() <= max + 1, "reply_detail kept more than {max} characters and the mark");
    assert_eq!(out, check_escape(detail.trim(), max), "reply_detail is not the escaped detail");
}

/// A worker address that parses shows as text that parses to it again.
fn check_worker_addr(text: &str) {
    let addr = match WorkerAddr::parse(text) {
        Ok(addr) => addr,
        Err(e) => {
            assert_error_text("a worker address's error", &e);
            return;
        }
    };
    assert_eq!(text.parse::<WorkerAddr>().as_ref(), Ok(&addr), "FromStr disagrees with parse");
    let shown = addr.to_string();
    assert!(shown.len() <= text.len(), "{text:?} shows as the longer {shown:?}");
    assert_eq!(WorkerAddr::parse(&shown).as_ref(), Ok(&addr), "{text:?} shows as {shown:?}, which parses differently");
    assert_eq!(WorkerAddr::new(addr.host(), addr.port()).as_ref(), Ok(&addr), "new refuses a parsed address");
    assert_ne!(addr.port(), 0, "accepted port 0 in {text:?}");
    assert!(!addr.host().starts_with('['), "a host kept its bracket: {text:?}");
    if let Some(socket) = addr.socket_addr() {
        assert_eq!(socket.port(), addr.port());
        assert_eq!(WorkerAddr::from_socket(socket).socket_addr(), Some(socket));
    }
}

/// A bootstrap URL that parses shows as text that parses to it again.
fn check_bootstrap_url(text: &str) {
    let url = match BootstrapUrl::parse(text) {
        Ok(url) => url,
        Err(e) => {
            assert_error_text("a bootstrap URL's error", &e);
            return;
        }
    };
    assert_eq!(text.parse::<BootstrapUrl>().as_ref(), Ok(&url), "FromStr disagrees with parse");
    let shown = url.to_string();
    assert_eq!(shown, format!("http://{}", url.authority()));
    assert_eq!(BootstrapUrl::parse(&shown).as_ref(), Ok(&url), "{text:?} shows as {shown:?}, which parses differently");
    assert_eq!(BootstrapUrl::new(url.host(), url.port()).as_ref(), Ok(&url), "new refuses a parsed URL");
    assert_ne!(url.port(), 0, "accepted port 0 in {text:?}");
    if let Some(socket) = url.socket_addr() {
        assert_eq!(socket.port(), url.port());
        assert_eq!(BootstrapUrl::from_socket(socket).socket_addr(), Some(socket));
    }
}

/// A registration body: parsed or refused with a visible, short error; an
/// accepted one holds what the JSON says and round-trips through
/// `to_json`; its proof verifies, and another header only when it is the
/// same proof.
fn check_registration(body: &[u8], secret: &AuthSecret, header: &str) -> Option<Registration> {
    let reg = match Registration::parse(body) {
        Ok(reg) => reg,
        Err(e) => {
            assert_error_text("a registration's error", &e);
            return None;
        }
    };
    assert!(body.len() <= MAX_REGISTRATION_BYTES, "accepted a registration of {} bytes", body.len());
    let Ok(value) = serde_json::from_slice::<Value>(body) else { panic!("accepted a registration that is not JSON") };
    let Some(fields) = value.as_object() else { panic!("accepted a registration that is not an object") };
    let id = reg.engine_id.as_str();
    assert_eq!(fields.get("engine_id").and_then(Value::as_str), Some(id));
    assert!(!id.is_empty() && !id.chars().any(char::is_control), "accepted engine id {id:?}");
    for (name, rank) in [("dp_rank", reg.dp_rank), ("tp_rank", reg.tp_rank), ("pp_rank", reg.pp_rank)] {
        assert_eq!(fields.get(name).and_then(Value::as_u64), Some(u64::from(rank)), "{name}");
        assert!(rank < 1024, "accepted {name} {rank}");
    }
    let addr = fields.get("addr").and_then(Value::as_str).map(WorkerAddr::parse);
    assert_eq!(addr, Some(Ok(reg.addr.clone())), "addr is not what the JSON says");

    let json = reg.to_json();
    assert!(json.len() <= MAX_REGISTRATION_BYTES, "to_json wrote {} bytes", json.len());
    match Registration::parse(json.as_bytes()) {
        Ok(back) => assert_eq!(back, reg, "a registration changed through to_json: {json}"),
        Err(e) => panic!("to_json wrote a registration that is refused: {e}: {json}"),
    }

    let proof = registration_proof(secret, body);
    assert!(verify_registration_proof(secret, body, &proof), "a genuine proof does not verify");
    assert!(verify_registration_proof(secret, body, &proof.to_uppercase()), "an uppercase proof does not verify");
    assert!(!verify_registration_proof(secret, json.as_bytes(), &proof) || json.as_bytes() == body);
    // Nobody forges an HMAC: any other header verifies only if it is this proof.
    let genuine = header.trim().len() == proof.len() && header.trim().eq_ignore_ascii_case(&proof);
    assert_eq!(verify_registration_proof(secret, body, header), genuine, "header {header:?}");
    Some(reg)
}

/// A query reply: parsed or refused with a visible, short error; an
/// accepted one holds what the JSON says, each engine every tp rank times
/// every pp rank below its sizes, no engine id twice, the workers bounded.
fn check_query_reply(bytes: &[u8]) -> Option<QueryReply> {
    let reply = match QueryReply::from_bytes(bytes) {
        Ok(reply) => reply,
        Err(e) => {
            assert_error_text("a query reply's error", &e);
            return None;
        }
    };
    let Ok(text) = std::str::from_utf8(bytes) else { panic!("accepted a query reply that is not UTF-8") };
    assert_eq!(QueryReply::parse(text).as_ref(), Ok(&reply), "from_bytes disagrees with parse");
    let Ok(Value::Object(top)) = serde_json::from_str::<Value>(text) else {
        panic!("accepted a reply not a JSON object")
    };
    assert_eq!(reply.len(), top.len(), "not every key of the reply is an engine");
    assert_eq!(reply.is_empty(), top.is_empty());
    let mut workers = 0usize;
    let mut ids: BTreeMap<&EngineId, u32> = BTreeMap::new();
    for engine in reply.engines() {
        let dp = engine.dp_rank();
        assert_eq!(reply.dp(dp), Some(engine));
        assert_eq!(reply.engine(engine.engine_id().as_str()), Some(engine), "engine ids do not name one engine");
        assert_eq!(ids.insert(engine.engine_id(), dp), None, "engine id {:?} listed twice", engine.engine_id());
        let entry = top.get(&dp.to_string()).and_then(Value::as_object);
        let Some(entry) = entry else { panic!("rank {dp} is not a canonical key of the reply") };
        assert_eq!(entry.get("engine_id").and_then(Value::as_str), Some(engine.engine_id().as_str()));
        let (tp_size, pp_size) = (engine.tp_size(), engine.pp_size());
        assert!(tp_size >= 1 && pp_size >= 1, "rank {dp}: {tp_size} x {pp_size} workers");
        let by_tp = entry.get("worker_addr").and_then(Value::as_object);
        assert_eq!(by_tp.map(serde_json::Map::len), Some(tp_size as usize), "rank {dp}: tp keys");
        for tp in 0..tp_size {
            let by_pp = by_tp.and_then(|m| m.get(&tp.to_string())).and_then(Value::as_object);
            assert_eq!(by_pp.map(serde_json::Map::len), Some(pp_size as usize), "rank {dp}, tp {tp}: pp keys");
            for pp in 0..pp_size {
                let Some(addr) = engine.worker(tp, pp) else { panic!("rank {dp} lacks worker {tp}/{pp}") };
                let listed = by_pp.and_then(|m| m.get(&pp.to_string())).and_then(Value::as_str);
                assert_eq!(listed.map(WorkerAddr::parse), Some(Ok(addr)), "rank {dp}: worker {tp}/{pp}");
                workers += 1;
            }
            assert_eq!(engine.worker(tp, pp_size), None);
        }
        assert_eq!(engine.worker(tp_size, 0), None);
    }
    assert!(workers <= MAX_BOOTSTRAP_WORKERS, "accepted a reply of {workers} workers");
    Some(reply)
}

/// The registry's model: vLLM's decisions, written out.
struct Model {
    expected: Expected,
    engines: BTreeMap<u32, EngineId>,
    workers: BTreeMap<(u32, u32, u32), WorkerAddr>,
}

impl Model {
    fn register(&mut self, reg: &Registration) -> Result<(), RegisterRefusal> {
        let e = self.expected;
        let (dp_rank, tp_rank, pp_rank) = (reg.dp_rank, reg.tp_rank, reg.pp_rank);
        if dp_rank >= e.dp_size() || tp_rank >= e.tp_size() || pp_rank >= e.pp_size() {
            return Err(RegisterRefusal::OutsideShape { dp_rank, tp_rank, pp_rank, expected: e });
        }
        if let Some((&registered, _)) = self.engines.iter().find(|(&rank, id)| rank != dp_rank && **id == reg.engine_id)
        {
            return Err(RegisterRefusal::EngineElsewhere {
                engine_id: reg.engine_id.clone(),
                registered,
                offered: dp_rank,
            });
        }
        if let Some(registered) = self.engines.get(&dp_rank).filter(|id| **id != reg.engine_id) {
            return Err(RegisterRefusal::EngineMismatch {
                dp_rank,
                registered: registered.clone(),
                offered: reg.engine_id.clone(),
            });
        }
        if let Some(registered) = self.workers.get(&(dp_rank, tp_rank, pp_rank)).filter(|a| **a != reg.addr) {
            return Err(RegisterRefusal::AddressConflict {
                dp_rank,
                tp_rank,
                pp_rank,
                registered: registered.clone(),
                offered: reg.addr.clone(),
            });
        }
        self.engines.entry(dp_rank).or_insert_with(|| reg.engine_id.clone());
        self.workers.insert((dp_rank, tp_rank, pp_rank), reg.addr.clone());
        Ok(())
    }

    fn missing(&self) -> Missing {
        let e = self.expected;
        let first = (0..e.dp_size())
            .flat_map(|dp| (0..e.tp_size()).flat_map(move |tp| (0..e.pp_size()).map(move |pp| (dp, tp, pp))))
            .filter(|w| !self.workers.contains_key(w))
            .take(MISSING_LISTED)
            .collect();
        Missing { registered: self.workers.len(), expected: e.workers(), first }
    }
}

/// The registry against its model after each registration; once complete,
/// its query reply parses back to exactly the engines and addresses
/// registered.
fn check_registry(expected: Expected, regs: &[Registration]) {
    let mut registry = BootstrapRegistry::new(expected);
    let mut model = Model { expected, engines: BTreeMap::new(), workers: BTreeMap::new() };
    assert_eq!(registry.expected(), expected);
    for reg in regs {
        let got = registry.register(reg);
        assert_eq!(got, model.register(reg), "registering {reg:?}");
        if let Err(refusal) = &got {
            let text = refusal.to_string();
            assert!(!text.chars().any(char::is_control), "a refusal's text holds a control character: {text:?}");
        }
        let complete = model.workers.len() == expected.workers();
        assert_eq!(registry.registered(), model.workers.len());
        assert_eq!(registry.is_complete(), complete);
        let missing = registry.missing();
        assert_eq!(missing, model.missing());
        let _ = missing.to_string();
        let Some(json) = registry.query_json() else {
            assert!(!complete, "a complete registry has no query reply");
            continue;
        };
        assert!(complete, "an incomplete registry has a query reply: {json}");
        assert!(json.len() <= MAX_QUERY_REPLY_BYTES);
        let reply = match QueryReply::parse(&json) {
            Ok(reply) => reply,
            Err(e) => panic!("the registry's query reply is refused: {e}: {json}"),
        };
        assert_eq!(check_query_reply(json.as_bytes()).as_ref(), Some(&reply));
        assert_eq!(reply.len(), expected.dp_size() as usize);
        for (dp, id) in &model.engines {
            let Some(engine) = reply.dp(*dp) else { panic!("rank {dp} missing from {json}") };
            assert_eq!(engine.engine_id(), id, "rank {dp}'s engine id");
            assert_eq!((engine.tp_size(), engine.pp_size()), (expected.tp_size(), expected.pp_size()));
        }
        for (&(dp, tp, pp), addr) in &model.workers {
            let worker = reply.dp(dp).and_then(|e| e.worker(tp, pp));
            assert_eq!(worker.as_ref(), Some(addr), "worker {dp}/{tp}/{pp}");
        }
    }
}

/// The bootstrap contract on arbitrary bytes.
///
/// Input: a shape byte (dp 1..=4, tp 1..=4, pp 1..=4 from its bit pairs, at
/// most 64 workers), a bound byte (characters kept by `escape_bounded` and
/// `reply_detail`), then the body. The whole body goes through
/// `Registration::parse`, `QueryReply::from_bytes` and `reply_detail`, and
/// as text through `escape_bounded`, `WorkerAddr::parse` and
/// `BootstrapUrl::parse`; so does each of its first 64 lines, and the lines
/// that parse as registrations register, in order, with a registry of that
/// shape.
///
/// Checks: no panic; errors are short and show nothing hidden; an accepted
/// registration holds what its JSON says, round-trips through `to_json`,
/// and its proof (under a secret of the first two bytes) verifies, any other
/// header only when equal to it; an accepted query reply holds what its
/// JSON says, every engine listing every tp x pp worker below its sizes, no
/// engine id twice; addresses and URLs round-trip through `Display`;
/// `escape_bounded` / `reply_detail` give the documented text, nothing
/// hidden, at most the bound and "…" exactly when cut; the registry decides
/// each registration as its model does (outside the shape, another engine
/// id for the rank, another address for the worker, else accepted) and
/// counts and lists what is missing as it does; `query_json()` is `Some`
/// exactly when `is_complete()`, and then parses to the engine ids and
/// addresses registered.
pub fn bootstrap_http(data: &[u8]) {
    let [shape, bound, body @ ..] = data else { return };
    let size = |shift: u32| 1 + u32::from((shape >> shift) & 3);
    let Ok(expected) = Expected::new(size(0), size(2), size(4)) else { panic!("a shape of at most 64 refused") };
    let max = usize::from(*bound);
    let secret = AuthSecret::new([*shape, *bound]);

    let text = String::from_utf8_lossy(body);
    let lines: Vec<&str> = text.lines().take(MAX_REGISTRATIONS).collect();
    let header = lines.get(1).copied().unwrap_or_default();
    check_registration(body, &secret, header);
    check_query_reply(body);
    check_reply_detail(body, max);
    check_escape(&text, max);
    check_worker_addr(&text);
    check_bootstrap_url(&text);

    let mut regs = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        check_worker_addr(line);
        check_bootstrap_url(line);
        check_escape(line, max);
        let header = lines.get(i + 1).copied().unwrap_or_default();
        regs.extend(check_registration(line.as_bytes(), &secret, header));
    }
    check_registry(expected, &regs);
}
