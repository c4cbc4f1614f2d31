//! The bootstrap server and client over real loopback sockets: vLLM's
//! contract byte for byte where routers read it (`/register`, `/query`),
//! 503 until every expected worker registered, and the bounds every
//! listener of the project keeps (head, body, deadline, places per host),
//! with and without a shared secret.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::time::Duration;

use kv_proto::auth::AuthSecret;
use kv_proto::bootstrap::{registration_proof, BootstrapUrl, Expected, QueryReply, Registration, WorkerAddr};
use kv_proto::EngineId;
use kv_worker::bootstrap::{query, register, BootstrapClientError, BootstrapLimits, BootstrapServer, RunningBootstrap};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Bound on any one wait of a test (never reached when things work).
const PATIENCE: Duration = Duration::from_secs(10);

fn loopback() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

fn reg(engine: &str, dp: u32, tp: u32, pp: u32, port: u16) -> Registration {
    Registration {
        engine_id: EngineId::new(engine),
        dp_rank: dp,
        tp_rank: tp,
        pp_rank: pp,
        addr: WorkerAddr::parse(&format!("tcp://10.0.{dp}.{tp}:{port}")).unwrap(),
    }
}

async fn server(expected: Expected, secret: Option<AuthSecret>, limits: BootstrapLimits) -> RunningBootstrap {
    BootstrapServer::bind(loopback(), expected, secret).await.unwrap().with_limits(limits).spawn()
}

fn url(server: &RunningBootstrap) -> BootstrapUrl {
    BootstrapUrl::from_socket(server.local_addr())
}

/// An answer read whole: status, head, body.
#[derive(Debug)]
struct Answer {
    status: u16,
    head: String,
    body: String,
}

impl Answer {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {self:?}"))
    }

    fn detail(&self) -> String {
        self.json()["detail"].as_str().unwrap_or_else(|| panic!("no string detail: {self:?}")).to_owned()
    }
}

/// Reads until the server closes, and splits the answer.
async fn read_answer(stream: &mut TcpStream) -> Answer {
    let mut bytes = Vec::new();
    tokio::time::timeout(PATIENCE, stream.read_to_end(&mut bytes)).await.expect("the server closes").unwrap();
    let text = String::from_utf8(bytes).unwrap();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or_else(|| panic!("no head in {text:?}"));
    let status = head.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or_else(|| panic!("{head:?}"));
    Answer { status, head: head.to_owned(), body: body.to_owned() }
}

/// Sends `request` as is on a new connection and reads the answer.
async fn raw(addr: SocketAddr, request: &[u8]) -> Answer {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream.write_all(request).await.unwrap();
    read_answer(&mut stream).await
}

async fn get(addr: SocketAddr, path: &str) -> Answer {
    raw(addr, format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes()).await
}

fn post_bytes(body: &str, proof: Option<&str>) -> Vec<u8> {
    let proof = proof.map(|p| format!("X-Kvlink-Proof: {p}\r\n")).unwrap_or_default();
    format!(
        "POST /register HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n{proof}\r\n{body}",
        body.len()
    )
    .into_bytes()
}

async fn post(addr: SocketAddr, body: &str) -> Answer {
    raw(addr, &post_bytes(body, None)).await
}

#[tokio::test]
async fn registering_every_worker_then_querying_gives_vllms_json() {
    let server = server(Expected::new(2, 2, 1).unwrap(), None, BootstrapLimits::default()).await;
    let addr = server.local_addr();
    for dp in 0..2 {
        for tp in 0..2 {
            let answer = post(addr, &reg(&format!("eng_dp{dp}"), dp, tp, 0, 7000).to_json()).await;
            assert_eq!((answer.status, answer.json()), (200, json!({"status": "ok"})), "{answer:?}");
        }
    }
    let answer = get(addr, "/query").await;
    assert_eq!(answer.status, 200, "{answer:?}");
    assert!(answer.head.contains("Content-Type: application/json"), "{answer:?}");
    // Compact, string keys, as FastAPI writes vLLM's reply.
    assert_eq!(
        answer.body,
        concat!(
            r#"{"0":{"engine_id":"eng_dp0","worker_addr":{"0":{"0":"tcp://10.0.0.0:7000"},"1":{"0":"tcp://10.0.0.1:7000"}}},"#,
            r#""1":{"engine_id":"eng_dp1","worker_addr":{"0":{"0":"tcp://10.0.1.0:7000"},"1":{"0":"tcp://10.0.1.1:7000"}}}}"#
        )
    );
    assert_eq!(answer.json()["0"]["engine_id"], "eng_dp0");
    assert_eq!(answer.json()["1"]["worker_addr"]["1"]["0"], "tcp://10.0.1.1:7000");
    let health = get(addr, "/health").await;
    assert_eq!(health.status, 200, "{health:?}");
    // The client reads the same.
    let reply = query(&url(&server), PATIENCE).await.unwrap();
    let e1 = reply.engine("eng_dp1").unwrap();
    assert_eq!((e1.dp_rank(), e1.tp_size(), e1.pp_size()), (1, 2, 1));
    assert_eq!(e1.worker(1, 0).unwrap().to_string(), "tcp://10.0.1.1:7000");
    assert_eq!(QueryReply::parse(&answer.body).unwrap(), reply);
    server.stop().await;
}

#[tokio::test]
async fn query_and_health_answer_503_until_complete() {
    let server = server(Expected::new(1, 2, 1).unwrap(), None, BootstrapLimits::default()).await;
    let addr = server.local_addr();
    for path in ["/query", "/health", "/query?x=1"] {
        let answer = get(addr, path).await;
        assert_eq!(answer.status, 503, "{answer:?}");
        assert!(answer.detail().contains("0 of 2 prefill workers registered"), "{answer:?}");
        assert!(answer.head.contains("Retry-After: 1"), "{answer:?}");
    }
    assert_eq!(post(addr, &reg("e", 0, 1, 0, 1).to_json()).await.status, 200);
    let answer = get(addr, "/query").await;
    assert_eq!(answer.status, 503);
    assert!(answer.detail().contains("1 of 2 prefill workers registered; missing dp/tp/pp 0/0/0"), "{answer:?}");
    // The last worker registers through the local handle, without HTTP.
    server.handle().register(&reg("e", 0, 0, 0, 1)).unwrap();
    assert!(server.handle().is_complete());
    assert_eq!(get(addr, "/query").await.status, 200);
    server.stop().await;
}

#[tokio::test]
async fn conflicting_registrations_get_400_with_a_json_detail() {
    let server = server(Expected::new(2, 2, 1).unwrap(), None, BootstrapLimits::default()).await;
    let addr = server.local_addr();
    assert_eq!(post(addr, &reg("e", 0, 0, 0, 1).to_json()).await.status, 200);
    // The same again: accepted, nothing changes.
    assert_eq!(post(addr, &reg("e", 0, 0, 0, 1).to_json()).await.status, 200);
    let cases = [
        (reg("e", 0, 0, 0, 2), "registered at tcp://10.0.0.0:1 already, not at tcp://10.0.0.0:2"),
        (reg("other\"id", 0, 1, 0, 1), r#"engine id mismatch for dp_rank=0: registered "e", offered "other\"id""#),
        (reg("e", 2, 0, 0, 1), "outside the expected dp 2 x tp 2 x pp 1"),
        (reg("e", 0, 2, 0, 1), "outside the expected"),
    ];
    for (r, says) in cases {
        let answer = post(addr, &r.to_json()).await;
        assert_eq!(answer.status, 400, "{answer:?}");
        assert!(answer.detail().contains(says), "{answer:?}");
    }
    // The client returns the detail, escaped.
    let refused = register(&url(&server), &reg("x\u{202e}y", 0, 1, 0, 1), None, PATIENCE).await.unwrap_err();
    match &refused {
        BootstrapClientError::Refused { status: 400, detail, .. } => {
            assert!(detail.contains(r#"offered "x\u{202e}y""#), "{detail}");
        }
        other => panic!("{other:?}"),
    }
    server.stop().await;
}

#[tokio::test]
async fn garbage_bodies_get_422() {
    let server = server(Expected::new(1, 1, 1).unwrap(), None, BootstrapLimits::default()).await;
    let addr = server.local_addr();
    let cases: &[(&str, &str)] = &[
        ("not json", "not valid JSON"),
        ("[]", "must be a JSON object"),
        (r#"{"engine_id":"e","dp_rank":-1,"tp_rank":0,"pp_rank":0,"addr":"tcp://a:1"}"#, "dp_rank must be"),
        (r#"{"engine_id":"e","dp_rank":0,"tp_rank":0,"pp_rank":0}"#, "addr is missing"),
        (r#"{"engine_id":"e","dp_rank":0,"tp_rank":"0","pp_rank":0,"addr":"tcp://a:1"}"#, "tp_rank must be"),
        (r#"{"engine_id":"e","dp_rank":0,"tp_rank":0,"pp_rank":0,"addr":"a:1"}"#, "must start with tcp://"),
    ];
    for (body, says) in cases {
        let answer = post(addr, body).await;
        assert_eq!(answer.status, 422, "{body}: {answer:?}");
        assert!(answer.detail().contains(says), "{body}: {answer:?}");
    }
    let mut bytes = b"POST /register HTTP/1.1\r\nContent-Length: 2\r\n\r\n".to_vec();
    bytes.extend_from_slice(b"\xff\xfe");
    let answer = raw(addr, &bytes).await;
    assert_eq!(answer.status, 422, "{answer:?}");
    assert!(answer.detail().contains("not UTF-8"), "{answer:?}");
    assert!(!server.handle().is_complete(), "nothing registered");
    server.stop().await;
}

#[tokio::test]
async fn vllms_python_style_body_is_accepted() {
    let server = server(Expected::new(1, 1, 1).unwrap(), None, BootstrapLimits::default()).await;
    // As httpx's json= writes Python's dict: ", " and ": " separators, its own key order.
    let body = r#"{"addr": "tcp://10.1.2.3:41234", "pp_rank": 0, "tp_rank": 0, "engine_id": "0f8c_dp0", "dp_rank": 0}"#;
    let answer = post(server.local_addr(), body).await;
    assert_eq!((answer.status, answer.json()), (200, json!({"status": "ok"})));
    let answer = get(server.local_addr(), "/query").await;
    assert_eq!(
        answer.json(),
        json!({"0": {"engine_id": "0f8c_dp0", "worker_addr": {"0": {"0": "tcp://10.1.2.3:41234"}}}})
    );
    server.stop().await;
}

#[tokio::test]
async fn oversized_heads_get_431_and_bodies_413() {
    let limits = BootstrapLimits::default();
    let server = server(Expected::new(1, 1, 1).unwrap(), None, limits.clone()).await;
    let addr = server.local_addr();
    let big_header = format!("GET /query HTTP/1.1\r\nX-Pad: {}\r\n\r\n", "a".repeat(limits.max_head_bytes));
    let answer = raw(addr, big_header.as_bytes()).await;
    assert_eq!(answer.status, 431, "{answer:?}");
    assert!(answer.detail().contains("too large"), "{answer:?}");
    // Refused from its Content-Length, before a byte of it is read.
    let declared = format!("POST /register HTTP/1.1\r\nContent-Length: {}\r\n\r\n", limits.max_body_bytes + 1);
    let answer = raw(addr, declared.as_bytes()).await;
    assert_eq!(answer.status, 413, "{answer:?}");
    // Sent whole: still refused, and the answer survives the unread bytes.
    let body = format!(r#"{{"engine_id": "{}"}}"#, "e".repeat(limits.max_body_bytes));
    let answer = raw(addr, &post_bytes(&body, None)).await;
    assert_eq!(answer.status, 413, "{answer:?}");
    let huge = "POST /register HTTP/1.1\r\nContent-Length: 99999999999999999999999\r\n\r\n";
    assert_eq!(raw(addr, huge.as_bytes()).await.status, 400);
    let chunked = "POST /register HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n";
    assert_eq!(raw(addr, chunked.as_bytes()).await.status, 411);
    assert_eq!(raw(addr, b"POST /register HTTP/1.1\r\n\r\n").await.status, 411);
    server.stop().await;
}

#[tokio::test]
async fn unknown_paths_and_methods_get_json_404_and_405() {
    let server = server(Expected::new(1, 1, 1).unwrap(), None, BootstrapLimits::default()).await;
    let addr = server.local_addr();
    let answer = get(addr, "/docs").await;
    assert_eq!((answer.status, answer.detail().as_str()), (404, "Not Found"));
    let answer = get(addr, "/register").await;
    assert_eq!(answer.status, 405, "{answer:?}");
    assert!(answer.head.contains("Allow: POST"), "{answer:?}");
    let answer = raw(addr, b"DELETE /query HTTP/1.1\r\n\r\n").await;
    assert_eq!(answer.status, 405, "{answer:?}");
    assert!(answer.head.contains("Allow: GET"), "{answer:?}");
    for garbage in
        [&b"GET /query HTTP/2.0\r\n\r\n"[..], b"get /query HTTP/1.1\r\n\r\n", b"\xff\r\n\r\n", b"GET\r\n\r\n"]
    {
        let answer = raw(addr, garbage).await;
        assert_eq!(answer.status, 400, "{answer:?}");
        answer.detail();
    }
    server.stop().await;
}

#[tokio::test]
async fn a_client_that_dribbles_is_cut_at_the_deadline() {
    let deadline = Duration::from_millis(300);
    let limits = BootstrapLimits { deadline, ..BootstrapLimits::default() };
    let server = server(Expected::new(1, 1, 1).unwrap(), None, limits).await;
    let mut stream = TcpStream::connect(server.local_addr()).await.unwrap();
    let started = tokio::time::Instant::now();
    let request = b"GET /query HTTP/1.1\r\nHost: a-very-slow-client\r\n\r\n";
    let mut pace = tokio::time::interval(Duration::from_millis(50));
    // Late ticks are not made up in a burst: the pace holds on a loaded machine.
    pace.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut sent = 0;
    let mut answer = Vec::new();
    let mut chunk = [0u8; 1024];
    // One byte per tick (the whole head would take over two seconds) until the server ends it.
    let ended = tokio::time::timeout(PATIENCE, async {
        loop {
            tokio::select! {
                _ = pace.tick(), if sent < request.len() => {
                    if stream.write_all(&request[sent..=sent]).await.is_err() {
                        return;
                    }
                    sent += 1;
                }
                read = stream.read(&mut chunk) => match read {
                    Ok(0) | Err(_) => return,
                    Ok(n) => answer.extend_from_slice(&chunk[..n]),
                }
            }
        }
    })
    .await;
    assert!(ended.is_ok(), "the server never ended the connection");
    let elapsed = started.elapsed();
    assert!(elapsed >= deadline, "ended after {elapsed:?}, before the deadline");
    assert!(sent < request.len(), "the whole head went out ({elapsed:?})");
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.is_empty() || answer.starts_with("HTTP/1.1 408 "), "{answer}");
    server.stop().await;
}

#[tokio::test]
async fn connections_over_the_per_host_limit_get_503_at_once() {
    let limits = BootstrapLimits { max_connections_per_host: 2, ..BootstrapLimits::default() };
    let server = server(Expected::new(1, 1, 1).unwrap(), None, limits).await;
    let addr = server.local_addr();
    // Two idle connections hold this host's places (connections are admitted in order).
    let _idle = [TcpStream::connect(addr).await.unwrap(), TcpStream::connect(addr).await.unwrap()];
    let started = tokio::time::Instant::now();
    // Sends nothing: bytes the server never reads would reset the connection
    // it closes, and the answer with it.
    let mut refused = TcpStream::connect(addr).await.unwrap();
    let answer = read_answer(&mut refused).await;
    assert_eq!(answer.status, 503, "{answer:?}");
    assert!(answer.detail().contains("busy"), "{answer:?}");
    assert!(started.elapsed() < BootstrapLimits::default().deadline / 2, "not at once: {:?}", started.elapsed());
    server.stop().await;
}

#[tokio::test]
async fn a_secret_requires_a_proof() {
    let secret = AuthSecret::new("the deployment's secret");
    let server = server(Expected::new(1, 2, 1).unwrap(), Some(secret.clone()), BootstrapLimits::default()).await;
    let addr = server.local_addr();
    let body = reg("e", 0, 0, 0, 1).to_json();
    let missing = raw(addr, &post_bytes(&body, None)).await;
    assert_eq!(missing.status, 403, "{missing:?}");
    assert!(missing.detail().contains("must carry its proof"), "{missing:?}");
    let wrong_key = registration_proof(&AuthSecret::new("another secret"), body.as_bytes());
    let other_body = registration_proof(&secret, reg("e", 0, 0, 0, 2).to_json().as_bytes());
    for proof in [wrong_key.as_str(), other_body.as_str(), "zz", ""] {
        let answer = raw(addr, &post_bytes(&body, Some(proof))).await;
        assert_eq!(answer.status, 403, "{proof}: {answer:?}");
    }
    assert_eq!(server.handle().missing().registered, 0, "nothing refused was registered");
    let right = registration_proof(&secret, body.as_bytes());
    let answer = raw(addr, &post_bytes(&body, Some(&right))).await;
    assert_eq!(answer.status, 200, "{answer:?}");
    // The client proves it itself; without the secret it is refused at once.
    register(&url(&server), &reg("e", 0, 1, 0, 1), Some(&secret), PATIENCE).await.unwrap();
    let refused = register(&url(&server), &reg("e", 0, 1, 0, 1), None, PATIENCE).await.unwrap_err();
    assert!(matches!(refused, BootstrapClientError::Refused { status: 403, .. }), "{refused:?}");
    // Queries need no proof.
    assert_eq!(get(addr, "/query").await.status, 200);
    server.stop().await;
}

#[tokio::test]
async fn the_client_query_of_an_incomplete_server_is_not_ready() {
    let server = server(Expected::new(2, 1, 1).unwrap(), None, BootstrapLimits::default()).await;
    register(&url(&server), &reg("e0", 0, 0, 0, 1), None, PATIENCE).await.unwrap();
    let error = query(&url(&server), PATIENCE).await.unwrap_err();
    match &error {
        BootstrapClientError::NotReady { detail, .. } => assert!(detail.contains("1 of 2"), "{detail}"),
        other => panic!("{other:?}"),
    }
    register(&url(&server), &reg("e1", 1, 0, 0, 1), None, PATIENCE).await.unwrap();
    assert_eq!(query(&url(&server), PATIENCE).await.unwrap().len(), 2);
    server.stop().await;
}

#[tokio::test]
async fn the_client_register_retries_until_the_server_appears() {
    // A listener on the port that drops the first connection: the client has
    // tried (and must try again) before the server is there.
    let placeholder = TcpListener::bind(loopback()).await.unwrap();
    let addr = placeholder.local_addr().unwrap();
    let base = BootstrapUrl::from_socket(addr);
    let client = tokio::spawn(async move { register(&base, &reg("e", 0, 0, 0, 1), None, PATIENCE).await });
    let (first, _) = tokio::time::timeout(PATIENCE, placeholder.accept()).await.unwrap().unwrap();
    drop(first);
    drop(placeholder);
    // Refused until the server binds the port (whenever the client comes back).
    let server = BootstrapServer::bind(addr, Expected::new(1, 1, 1).unwrap(), None).await.unwrap().spawn();
    tokio::time::timeout(PATIENCE, client).await.unwrap().unwrap().unwrap();
    assert!(server.handle().is_complete());
    server.stop().await;
}

#[tokio::test]
async fn the_client_gives_up_at_its_timeout_saying_why() {
    // A port nothing listens on (reserved, then given back).
    let addr = TcpListener::bind(loopback()).await.unwrap().local_addr().unwrap();
    let base = BootstrapUrl::from_socket(addr);
    let timeout = Duration::from_millis(400);
    let started = tokio::time::Instant::now();
    let error = register(&base, &reg("e", 0, 0, 0, 1), None, timeout).await.unwrap_err();
    let elapsed = started.elapsed();
    match &error {
        BootstrapClientError::TimedOut { attempts, last, .. } => {
            assert!(*attempts >= 2, "{error}");
            assert!(last.to_lowercase().contains("refused"), "{error}");
        }
        other => panic!("{other:?}"),
    }
    assert!(elapsed >= timeout && elapsed < PATIENCE, "{elapsed:?}");
    assert!(matches!(query(&base, timeout).await, Err(BootstrapClientError::Unreachable { .. })));
}

#[tokio::test]
async fn the_client_bounds_what_a_server_answers() {
    // A server that answers a query with more than a reply may hold.
    let listener = TcpListener::bind(loopback()).await.unwrap();
    let base = BootstrapUrl::from_socket(listener.local_addr().unwrap());
    let serve = tokio::spawn(async move {
        for reply in [
            format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n", 64 * 1024 * 1024),
            "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n[]".to_owned(),
            "HTTP/1.1 400 Bad Request\r\n\r\n{\"detail\": \"no \\u001b[31m colours\"}".to_owned(),
            "NOT HTTP\r\n\r\n".to_owned(),
        ] {
            let (mut stream, _) = listener.accept().await.unwrap();
            let mut head = [0u8; 1024];
            let _ = stream.read(&mut head).await;
            stream.write_all(reply.as_bytes()).await.unwrap();
        }
    });
    let too_big = query(&base, PATIENCE).await.unwrap_err();
    assert!(too_big.to_string().contains("over its bound"), "{too_big}");
    let not_registry = query(&base, PATIENCE).await.unwrap_err();
    assert!(matches!(not_registry, BootstrapClientError::Reply { .. }), "{not_registry}");
    match query(&base, PATIENCE).await.unwrap_err() {
        BootstrapClientError::Refused { status: 400, detail, .. } => assert_eq!(detail, r"no \u{1b}[31m colours"),
        other => panic!("{other:?}"),
    }
    let malformed = query(&base, PATIENCE).await.unwrap_err();
    assert!(matches!(malformed, BootstrapClientError::Protocol { .. }), "{malformed}");
    serve.await.unwrap();
}
