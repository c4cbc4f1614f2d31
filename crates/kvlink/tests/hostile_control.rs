//! `kvlink serve`'s control port against hostile clients speaking its wire
//! by hand from another loopback address (127.0.0.2), each case with an
//! honest `kvlink bench --connect` (from 127.0.0.1) that must complete.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stderr)]

mod common;

use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::thread;
use std::time::{Duration, Instant};

use common::{
    assert_all_verified, assert_one_line_error, assert_refused_and_closed, bytes32, connect_from, hello_json,
    loopback_bench, loopback_serve, reply_within, send_frame, until_closed, SecretFile, ATTACKER, BOUND,
};
use kv_proto::auth::{self, AuthSecret, Channel, Transcript};

/// Slack on top of a server deadline before a test calls it missed: the
/// server must act within its bound, and this machine may be busy.
const SLACK: Duration = Duration::from_secs(3);

/// Stops a server that serves until told (SIGTERM) and returns its exit
/// status and output.
fn stop(serve: common::Proc) -> (String, String) {
    serve.terminate();
    let (status, stdout, stderr) = serve.finish();
    assert!(status.success(), "{status}\nstdout: {stdout}\nstderr: {stderr}");
    (stdout, stderr)
}

/// Lines of `text` containing `needle`.
fn count(text: &str, needle: &str) -> usize {
    text.lines().filter(|l| l.contains(needle)).count()
}

/// Connections that never say hello hold at most their host's share of the
/// handshake places, each until the handshake deadline; an honest client
/// from another host gets in meanwhile, and the refusals cost a few log
/// lines, not one each.
#[test]
fn silent_connections_from_one_host_do_not_lock_out_another() {
    let timeout = Duration::from_secs(3);
    let (serve, control) = loopback_serve("producer", &["--handshake-timeout", "3"]);
    let attack_started = Instant::now();
    let mut silent: Vec<TcpStream> = (0..100).map(|_| connect_from(ATTACKER, control)).collect();
    assert_all_verified(20, &loopback_bench(control, &[]), "decode");
    // The server closes all of them: past its limits at once, the rest at
    // the handshake deadline.
    for s in &mut silent {
        until_closed(s, timeout + SLACK);
    }
    let closed_after = attack_started.elapsed();
    assert!(closed_after < timeout + SLACK, "the last silent connection was closed after {closed_after:?}");
    let (stdout, stderr) = stop(serve);
    assert_eq!(count(&stdout, "session from 127.0.0.1"), 1, "{stdout}");
    assert_eq!(count(&stdout, "session from 127.0.0.2"), 0, "{stdout}");
    // 100 refused connections, a handful of lines.
    let lines = stdout.lines().count() + stderr.lines().count();
    eprintln!("100 silent connections: {lines} log lines\n{stdout}\n{stderr}");
    assert!(lines <= 12, "{lines} log lines for 100 refused connections:\n{stdout}\n{stderr}");
}

/// Writes `bytes` one at a time, `pace` apart, until the server closes the
/// connection; returns how long the connection lived.
fn dribble(s: &mut TcpStream, bytes: &[u8], pace: Duration, started: Instant) -> Duration {
    use std::io::Write;
    for b in bytes {
        if s.write_all(&[*b]).is_err() {
            return started.elapsed();
        }
        thread::sleep(pace);
    }
    panic!("the server read a whole dribbled frame ({} bytes over {:?})", bytes.len(), started.elapsed());
}

/// A handshake sent a byte at a time is cut at the one handshake deadline,
/// whether it dribbles the hello or the authentication proof; an honest
/// client with the secret is served meanwhile.
#[test]
fn a_dribbled_handshake_is_cut_at_the_deadline() {
    let secret = SecretFile::new("dribble", "dribble-secret");
    let timeout = Duration::from_secs(2);
    let pace = Duration::from_millis(50);
    let (serve, control) =
        loopback_serve("producer", &["--handshake-timeout", "2", "--auth-secret-file", secret.path()]);
    let hello = common::frame(&hello_json(Some([0x42; 32])));
    let dribble_hello = {
        let hello = hello.clone();
        thread::spawn(move || {
            let started = Instant::now();
            let mut s = connect_from(ATTACKER, control);
            dribble(&mut s, &hello, pace, started)
        })
    };
    let dribble_proof = thread::spawn(move || {
        let started = Instant::now();
        let mut s = connect_from(ATTACKER, control);
        use std::io::Write;
        s.write_all(&hello).unwrap();
        let challenge = reply_within(&mut s, BOUND).expect("a challenge");
        assert_eq!(challenge["type"], "challenge", "{challenge}");
        let proof = serde_json::json!({"type": "proof", "proof": vec![7u8; 32]}).to_string();
        dribble(&mut s, &common::frame(proof.as_bytes()), pace, started)
    });
    assert_all_verified(20, &loopback_bench(control, &["--auth-secret-file", secret.path()]), "decode");
    for (what, attacker) in [("hello", dribble_hello), ("proof", dribble_proof)] {
        let lived = attacker.join().unwrap();
        assert!(lived < timeout + SLACK, "a dribbled {what} held its connection for {lived:?}");
        eprintln!("a dribbled {what} was cut after {lived:?} (deadline {timeout:?})");
    }
    let (stdout, _) = stop(serve);
    assert_eq!(count(&stdout, "session from 127.0.0.2"), 0, "{stdout}");
}

/// A session that goes silent is ended at the idle timeout (the client is
/// told why), so it holds the one session slot no longer than that; then an
/// honest client is served while the idle one still has its socket.
#[test]
fn an_idle_session_is_ended_at_the_idle_timeout() {
    let idle = Duration::from_secs(2);
    let (serve, control) = loopback_serve("producer", &["--idle-timeout", "2"]);
    let mut s = connect_from(ATTACKER, control);
    send_frame(&mut s, &hello_json(None));
    let welcome = reply_within(&mut s, BOUND).expect("a welcome");
    let welcomed = Instant::now();
    assert_eq!((welcome["type"].as_str(), welcome["idle_timeout_ms"].as_u64()), (Some("welcome"), Some(2000)));
    // While it idles it holds the slot.
    assert_one_line_error(&loopback_bench(control, &[]), "busy");
    let last = reply_within(&mut s, idle + SLACK).expect("the reason the session ended");
    let ended_after = welcomed.elapsed();
    assert_eq!(last["type"], "error", "{last}");
    assert!(last["message"].as_str().unwrap().contains("idle"), "{last}");
    assert!(reply_within(&mut s, BOUND).is_none(), "the server closes an idle session");
    assert!(ended_after < idle + SLACK, "an idle session was ended after {ended_after:?}");
    assert_all_verified(20, &loopback_bench(control, &[]), "decode");
    let (stdout, _) = stop(serve);
    assert_eq!(count(&stdout, "session from 127.0.0.1"), 1, "{stdout}");
    assert!(stdout.contains("session from 127.0.0.2") && stdout.contains("idle"), "{stdout}");
    drop(s);
}

/// What the attacker sends as its proof.
#[derive(Clone, Copy, Debug)]
enum Forgery {
    /// The server's own proof, reflected.
    Reflected,
    /// A proof made with the right secret for another protocol.
    OtherChannel(Channel),
    /// A proof made with the right secret over another hello.
    OtherHello,
    /// A proof made with the right secret for an earlier connection.
    Replayed,
    /// A proof made with another secret.
    WrongSecret,
}

/// One authentication attempt on a new connection: hello with a nonce, the
/// server's challenge (checked: the server proves the secret), then `proof`
/// computed from the transcript. Returns the connection, after the proof.
fn attempt(
    control: SocketAddr,
    secret: &AuthSecret,
    proof: impl FnOnce(&Transcript<'_>, &[u8; 32]) -> [u8; 32],
) -> TcpStream {
    let mut s = connect_from(ATTACKER, control);
    let nonce = auth::fresh_nonce().unwrap();
    let hello = hello_json(Some(nonce));
    send_frame(&mut s, &hello);
    let challenge = reply_within(&mut s, BOUND).expect("a challenge");
    assert_eq!(challenge["type"], "challenge", "{challenge}");
    let (server_nonce, server_proof) = (bytes32(&challenge["server_nonce"]), bytes32(&challenge["server_proof"]));
    let transcript =
        Transcript { channel: Channel::Control, client_nonce: &nonce, server_nonce: &server_nonce, context: &hello };
    assert!(auth::verify_server_proof(secret, &transcript, &server_proof), "the server's proof");
    let proof = proof(&transcript, &server_proof);
    send_frame(&mut s, serde_json::json!({"type": "proof", "proof": proof}).to_string().as_bytes());
    s
}

/// No proof that was not made for this connection, this protocol and this
/// secret gets a session, and none of them disturbs an honest client.
#[test]
fn a_proof_not_made_for_this_connection_is_refused() {
    let secret_file = SecretFile::new("forgery", "control-secret");
    let secret = AuthSecret::new("control-secret");
    let (serve, control) = loopback_serve("producer", &["--auth-secret-file", secret_file.path()]);
    let attacks = {
        let secret = secret.clone();
        thread::spawn(move || {
            // A valid proof of an earlier connection, kept for replay.
            let mut earlier = None;
            let mut s = attempt(control, &secret, |t, _| {
                earlier = Some(auth::client_proof(&secret, t));
                [0; 32]
            });
            assert_refused_and_closed(&mut s, "authentication failed");
            for forgery in [
                Forgery::Reflected,
                Forgery::OtherChannel(Channel::SideChannel),
                Forgery::OtherChannel(Channel::DataTcp),
                Forgery::OtherChannel(Channel::DataQuic),
                Forgery::OtherHello,
                Forgery::Replayed,
                Forgery::WrongSecret,
            ] {
                let mut s = attempt(control, &secret, |t, server_proof| match forgery {
                    Forgery::Reflected => *server_proof,
                    Forgery::OtherChannel(channel) => auth::client_proof(&secret, &Transcript { channel, ..*t }),
                    Forgery::OtherHello => {
                        let other = hello_json(Some(*t.client_nonce)).to_ascii_uppercase();
                        auth::client_proof(&secret, &Transcript { context: &other, ..*t })
                    }
                    Forgery::Replayed => earlier.unwrap(),
                    Forgery::WrongSecret => auth::client_proof(&AuthSecret::new("control-secreT"), t),
                });
                eprintln!("{forgery:?}");
                assert_refused_and_closed(&mut s, "authentication failed");
            }
        })
    };
    assert_all_verified(20, &loopback_bench(control, &["--auth-secret-file", secret_file.path()]), "decode");
    attacks.join().unwrap();
    let (stdout, _) = stop(serve);
    assert_eq!(count(&stdout, "session from 127.0.0.2"), 0, "{stdout}");
    assert_eq!(count(&stdout, "session from 127.0.0.1"), 1, "{stdout}");
}

/// Without the secret, nothing past the hello: no challenge, no instance.
#[test]
fn a_client_without_the_secret_gets_only_a_refusal() {
    let secret = SecretFile::new("none", "control-secret");
    let (serve, control) = loopback_serve("consumer", &["--auth-secret-file", secret.path()]);
    let mut s = connect_from(Ipv4Addr::new(127, 0, 0, 3), control);
    send_frame(&mut s, &hello_json(None));
    assert_refused_and_closed(&mut s, "requires the shared secret");
    assert_all_verified(20, &loopback_bench(control, &["--auth-secret-file", secret.path()]), "prefill");
    let (stdout, _) = stop(serve);
    assert_eq!(count(&stdout, "session from 127.0.0.3"), 0, "{stdout}");
}
