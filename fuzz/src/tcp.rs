//! `tcp_dataplane`: arbitrary bytes as what a TCP data-plane peer sends.

use kv_proto::dataplane::{ReplyStatus, MAX_REASON_LEN, OP_LEN};
use kv_proto::receive::Framing;
use transport_tcp::wire::{
    encode_reply, Accept, AcceptStatus, BatchHeader, Preamble, ReplyHeader, ACCEPT_LEN, AUTH_TAG_LEN, BATCH_HEADER_LEN,
    FLAG_AUTH, FLAG_PAYLOAD_AUTH, MAGIC, PREAMBLE_LEN, REPLY_HEADER_LEN, SUPPORTED_BATCH_FLAGS, SUPPORTED_FLAGS,
    VERSION,
};
use transport_tcp::{OpListLimits, TcpConfig};

use crate::op_list::{self, Ended, Stream};

/// The receiver's configuration: op-list budgets small enough for an input
/// to exhaust, or the defaults; a small or the default op limit.
fn config(choice: u8) -> TcpConfig {
    let budget = match choice & 3 {
        0 => 256,
        1 => 4096,
        2 => (OP_LEN * kv_proto::dataplane::OPS_PER_READ) as u64 + 4096,
        _ => transport_tcp::DEFAULT_UNAUTHENTICATED_OP_LIST_BUDGET,
    };
    let mut config = TcpConfig {
        op_lists: OpListLimits { budget, unauthenticated_budget: budget, ..OpListLimits::default() },
        ..TcpConfig::default()
    };
    if choice & 4 != 0 {
        config.op_lists.max_ops_per_batch = 3;
    }
    config
}

/// The receiver's side: a preamble (the handshake's answer for a receiver
/// with or without the secret), then batches until the stream ends or the
/// receiver would close the connection.
fn receive(options: u8, stream: &mut Stream<'_>) {
    let has_secret = options & 8 != 0;
    let config = config(options);
    let Some(preamble_bytes) = stream.array::<PREAMBLE_LEN>() else { return };
    let preamble = match Preamble::decode(preamble_bytes) {
        Ok(preamble) => preamble,
        Err(magic) => {
            assert_eq!(&magic[..], &preamble_bytes[..4]);
            assert_ne!(magic, MAGIC, "the right magic refused");
            return;
        }
    };
    assert_eq!(&preamble.encode(), preamble_bytes, "a preamble does not re-encode to its bytes");
    let answer = preamble.answer(has_secret);
    let expected_ok = preamble.version == VERSION
        && preamble.flags & !SUPPORTED_FLAGS == 0
        && (preamble.flags & FLAG_PAYLOAD_AUTH == 0 || preamble.flags & FLAG_AUTH != 0)
        && (preamble.flags & FLAG_AUTH != 0) == has_secret;
    assert_eq!(
        answer == AcceptStatus::Accepted,
        expected_ok,
        "{preamble:?} answered {answer:?} (secret: {has_secret})"
    );
    assert!(!matches!(answer, AcceptStatus::Unknown(_)));
    if answer != AcceptStatus::Accepted {
        return;
    }
    if preamble.announces_auth() && !(stream.skip(AUTH_TAG_LEN as u64) && stream.skip(AUTH_TAG_LEN as u64)) {
        // The nonce, then (after the challenge) the proof.
        return;
    }

    let receiver = op_list::Receiver::new(
        config.op_lists.max_ops_in_force(config.auth_secret.is_some()),
        config.op_lists.budget_in_force(config.auth_secret.is_some()),
        options & 32 != 0,
    );
    if preamble.announces_auth() {
        // An authenticated connection's header is followed by its tag,
        // under a session key these bytes cannot know: the receiver checks
        // it before acting on the header, and closes.
        let Some(header_bytes) = stream.array::<BATCH_HEADER_LEN>() else { return };
        check_header(header_bytes);
        return;
    }
    // The headers as they come, checked before the machine reads them.
    let mut headers = *stream;
    let framing = Framing::Connection { session: None, tagged_payloads: false };
    let ended = op_list::receive_batches(stream, &receiver, framing, BatchHeader::decode);
    if let Some(header_bytes) = headers.array::<BATCH_HEADER_LEN>() {
        check_header(header_bytes);
    }
    assert!(matches!(ended, Ended::Idle | Ended::Truncated | Ended::Failed(_)), "{ended:?}");
}

/// A batch header re-encodes to its bytes, and is well formed exactly with
/// known flags and a zero reserved field.
fn check_header(header_bytes: &[u8; BATCH_HEADER_LEN]) {
    let header = BatchHeader::decode(header_bytes);
    assert_eq!(&header.encode(), header_bytes, "a batch header does not re-encode to its bytes");
    let well_formed = header.flags & !SUPPORTED_BATCH_FLAGS == 0 && header.reserved == 0;
    assert_eq!(header.is_well_formed(), well_formed);
}

/// The sender's side: an accept reply, then replies to batches (each
/// header, then its reason), as the sender reads them.
fn send(stream: &mut Stream<'_>) {
    let Some(accept_bytes) = stream.array::<ACCEPT_LEN>() else { return };
    match Accept::decode(accept_bytes) {
        Ok(accept) => {
            assert_eq!(&accept.encode(), accept_bytes, "an accept reply does not re-encode to its bytes");
            assert_eq!(AcceptStatus::from_code(accept.status.code()), accept.status);
        }
        Err(magic) => {
            assert_ne!(magic, MAGIC);
            return;
        }
    }
    while let Some(header_bytes) = stream.array::<REPLY_HEADER_LEN>() {
        let reply = ReplyHeader::decode(header_bytes);
        assert_eq!(ReplyStatus::from_code(reply.status.code()), reply.status);
        let reason_len = reply.reason_len as usize;
        if reason_len > MAX_REASON_LEN {
            return;
        }
        let Some(reason) = stream.take(reason_len) else { return };
        if let Ok(reason) = std::str::from_utf8(reason) {
            let again = encode_reply(reply.batch_id, reply.status, reason);
            assert_eq!(&again[..REPLY_HEADER_LEN], header_bytes, "a reply does not re-encode to its bytes");
            assert_eq!(&again[REPLY_HEADER_LEN..], reason.as_bytes());
        }
    }
}

/// Arbitrary bytes through the TCP data plane's decoders, on both sides.
///
/// Input: one options byte (bit 4: the sender's side; bit 3: the receiver
/// holds the secret; bits 0–2: the receiver's op-list budget and op limit;
/// bit 5: other batches hold half the budget),
/// then the stream. Checks:
/// - every preamble, accept reply, batch header and reply header that
///   decodes re-encodes to its bytes; a bad magic is reported as found;
/// - a preamble is accepted exactly for this build's version, known flags
///   (payload tags only with the secret) and a secret on both sides or
///   neither;
/// - a batch header is well formed exactly with known flags and a zero
///   reserved field;
/// - the batches are received by the machine the receiver runs (see
///   `op_list::receive_batches`: within the limit and budget, memory
///   following the bytes that arrive, admitted only inside the grant with
///   lengths adding up, refusals answered, and each batch read to its end
///   so the next starts in step).
pub fn tcp_dataplane(data: &[u8]) {
    let Some((&options, rest)) = data.split_first() else { return };
    let mut stream = Stream::new(rest);
    if options & 16 != 0 {
        send(&mut stream);
    } else {
        receive(options, &mut stream);
    }
}
