//! `tcp_dataplane`: arbitrary bytes as what a TCP data-plane peer sends.

use kv_proto::dataplane::{ReplyStatus, MAX_REASON_LEN, OP_LEN};
use transport_tcp::wire::{
    encode_reply, Accept, AcceptStatus, BatchHeader, Preamble, ReplyHeader, ACCEPT_LEN, AUTH_TAG_LEN, BATCH_HEADER_LEN,
    FLAG_AUTH, MAGIC, PREAMBLE_LEN, REPLY_HEADER_LEN, SUPPORTED_BATCH_FLAGS, SUPPORTED_FLAGS, VERSION,
};
use transport_tcp::TcpConfig;

use crate::op_list::{self, ListOutcome, Stream};

/// The receiver's configuration: op-list budgets small enough for an input
/// to exhaust, or the defaults; a small or the default op limit.
fn config(choice: u8) -> TcpConfig {
    let budget = match choice & 3 {
        0 => 256,
        1 => 4096,
        2 => (OP_LEN * kv_proto::dataplane::OPS_PER_READ) as u64 + 4096,
        _ => transport_tcp::DEFAULT_UNAUTHENTICATED_OP_LIST_BUDGET,
    };
    let mut config =
        TcpConfig { op_list_budget: budget, unauthenticated_op_list_budget: budget, ..TcpConfig::default() };
    if choice & 4 != 0 {
        config.max_ops_per_batch = 3;
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

    let receiver =
        op_list::Receiver::new(config.max_ops_in_force(), config.op_list_budget_in_force(), options & 32 != 0);
    while let Some(header_bytes) = stream.array::<BATCH_HEADER_LEN>() {
        let header = BatchHeader::decode(header_bytes);
        assert_eq!(&header.encode(), header_bytes, "a batch header does not re-encode to its bytes");
        let well_formed = header.flags & !SUPPORTED_BATCH_FLAGS == 0 && header.reserved == 0;
        assert_eq!(header.is_well_formed(), well_formed);
        if !well_formed {
            return;
        }
        if preamble.announces_auth() {
            // An authenticated connection's header is followed by its tag,
            // under a session key these bytes cannot know: the receiver
            // checks it before acting on the header, and closes.
            return;
        }
        let outcome = op_list::receive_op_list(stream, &receiver, &header.grant, header.op_count, header.total_bytes);
        let payload_follows = !header.wants_precheck();
        let continues = match outcome {
            ListOutcome::TooManyOps | ListOutcome::Truncated | ListOutcome::LengthMismatch => false,
            ListOutcome::DeadGrant => {
                stream.skip(header.op_count.saturating_mul(OP_LEN as u64))
                    && (!payload_follows || stream.skip(header.total_bytes))
            }
            ListOutcome::NoRoom { unread } => {
                stream.skip(unread * OP_LEN as u64) && (!payload_follows || stream.skip(header.total_bytes))
            }
            ListOutcome::Refused => !payload_follows || stream.skip(header.total_bytes),
            ListOutcome::Admitted => stream.skip(header.total_bytes),
        };
        if !continues {
            return;
        }
    }
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
///   and a secret on both sides or neither;
/// - a batch header is well formed exactly with known flags and a zero
///   reserved field;
/// - the op list of each batch is read as the receiver reads it (see
///   `op_list::receive_op_list`: within the limit and budget, memory
///   following the bytes that arrive, admitted only inside the grant with
///   lengths adding up), and the stream goes on where the receiver's would.
pub fn tcp_dataplane(data: &[u8]) {
    let Some((&options, rest)) = data.split_first() else { return };
    let mut stream = Stream::new(rest);
    if options & 16 != 0 {
        send(&mut stream);
    } else {
        receive(options, &mut stream);
    }
}
