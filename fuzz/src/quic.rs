//! `quic_dataplane`: arbitrary bytes as what a QUIC data-plane peer sends.

use kv_proto::dataplane::{decode_verdict_header, put_verdict, ReplyStatus, MAX_REASON_LEN, OP_LEN};
use kv_proto::receive::Framing;
use transport_quic::details::{DetailsError, EndpointDetails, DETAILS_LEN, MAGIC as DETAILS_MAGIC};
use transport_quic::wire::{
    BatchHeader, ClientHello, HelloError, ServerHello, BATCH_HEADER_LEN, CLIENT_HELLO_LEN, HELLO_AUTH, HELLO_MAGIC,
    HELLO_VERSION, SERVER_HELLO_LEN,
};
use transport_quic::{OpListLimits, QuicConfig};

use crate::op_list::{self, Ended, Stream};

/// The endpoint details a sender decodes before it connects.
fn details(bytes: &[u8]) {
    match EndpointDetails::decode(bytes) {
        Ok(details) => {
            assert_eq!(bytes.len(), DETAILS_LEN);
            assert_eq!(details.encode(), bytes, "details do not re-encode to their bytes");
        }
        Err(DetailsError::BadLength(len)) => {
            assert_eq!(len, bytes.len());
            assert_ne!(len, DETAILS_LEN, "details of the right length refused for their length");
        }
        Err(DetailsError::BadMagic(magic)) => {
            assert_eq!(bytes.get(..4), Some(&magic[..]));
            assert_ne!(magic, DETAILS_MAGIC);
        }
        Err(DetailsError::UnsupportedVersion(version)) => {
            assert_eq!(bytes.get(4..6), Some(&version.to_le_bytes()[..]));
        }
        Err(DetailsError::UnknownFlags(flags)) => {
            assert_ne!(flags, 0);
            assert_eq!(bytes.get(6..8), Some(&flags.to_le_bytes()[..]));
        }
    }
}

/// What a hello error says about the bytes it refused.
fn check_hello_error(bytes: &[u8], error: HelloError) {
    match error {
        HelloError::BadMagic(magic) => {
            assert_eq!(&bytes[..4], &magic[..]);
            assert_ne!(magic, HELLO_MAGIC);
        }
        HelloError::UnsupportedVersion(version) => {
            assert_eq!(&bytes[4..6], &version.to_le_bytes()[..]);
            assert_ne!(version, HELLO_VERSION);
        }
        HelloError::UnknownFlags(flags) => {
            assert_eq!(&bytes[6..8], &flags.to_le_bytes()[..]);
            assert_ne!(flags & !HELLO_AUTH, 0);
        }
    }
}

/// The receiver's configuration: small op-list budgets or the default.
fn config(choice: u8) -> QuicConfig {
    let budget = match choice & 3 {
        0 => 256,
        1 => 4096,
        2 => (OP_LEN * kv_proto::dataplane::OPS_PER_READ) as u64 + 4096,
        _ => transport_quic::DEFAULT_UNAUTHENTICATED_OP_LIST_BUDGET,
    };
    let mut config = QuicConfig {
        op_lists: OpListLimits { budget, unauthenticated_budget: budget, ..OpListLimits::default() },
        ..QuicConfig::default()
    };
    if choice & 4 != 0 {
        config.op_lists.max_ops_per_batch = 3;
    }
    config
}

/// One batch's stream as the receiver reads it: header, op list, payload,
/// end of stream, through the machine the receiver runs.
fn batch(options: u8, stream: &mut Stream<'_>) {
    let config = config(options);
    let mut header_stream = *stream;
    let Some(header_bytes) = header_stream.array::<BATCH_HEADER_LEN>() else { return };
    let header = BatchHeader::decode(header_bytes);
    assert_eq!(&header.encode(), header_bytes, "a batch header does not re-encode to its bytes");
    let receiver = op_list::Receiver::new(
        config.op_lists.max_ops_in_force(config.auth_secret.is_some()),
        config.op_lists.budget_in_force(config.auth_secret.is_some()),
        options & 8 != 0,
    );
    let ended = op_list::receive_batches(stream, &receiver, Framing::StreamPerBatch, BatchHeader::decode);
    assert!(matches!(ended, Ended::Done | Ended::Truncated | Ended::Failed(_)), "{ended:?}");
}

/// The verdict a sender reads after its hello proof, or after a batch.
fn verdict(stream: &mut Stream<'_>) {
    let Some(header) = stream.array::<8>() else { return };
    let (status, reason_len) = decode_verdict_header(header);
    assert_eq!(ReplyStatus::from_code(status.code()), status);
    if reason_len as usize > MAX_REASON_LEN {
        return;
    }
    let Some(reason) = stream.take(reason_len as usize) else { return };
    if let Ok(reason) = std::str::from_utf8(reason) {
        let mut again = Vec::new();
        put_verdict(&mut again, status, reason);
        assert_eq!(&again[..8], header, "a verdict does not re-encode to its bytes");
        assert_eq!(&again[8..], reason.as_bytes());
    }
}

/// Arbitrary bytes through the QUIC data plane's decoders.
///
/// Input: one byte choosing the decoder (and, for a batch, the receiver's
/// op-list budget and op limit, and whether other batches hold half the
/// budget), then its bytes. Checks:
/// - endpoint details decode only at exactly their length, with magic,
///   version and no flags, re-encode to their bytes, and an error names
///   what it found;
/// - client and server hellos that decode re-encode to their bytes; a
///   refused one is refused for what its bytes say;
/// - a batch header re-encodes to its bytes; the batch is received by the
///   machine the receiver runs (see `op_list::receive_batches`);
/// - a verdict re-encodes to its bytes.
pub fn quic_dataplane(data: &[u8]) {
    let Some((&choice, rest)) = data.split_first() else { return };
    let mut stream = Stream::new(rest);
    match choice % 5 {
        0 => details(rest),
        1 => {
            let Some(bytes) = stream.array::<CLIENT_HELLO_LEN>() else { return };
            match ClientHello::decode(bytes) {
                Ok(hello) => assert_eq!(&hello.encode(), bytes, "a client hello does not re-encode to its bytes"),
                Err(e) => check_hello_error(bytes, e),
            }
        }
        2 => {
            let Some(bytes) = stream.array::<SERVER_HELLO_LEN>() else { return };
            match ServerHello::decode(bytes) {
                Ok(hello) => assert_eq!(&hello.encode(), bytes, "a server hello does not re-encode to its bytes"),
                Err(e) => check_hello_error(bytes, e),
            }
        }
        3 => batch(choice / 5, &mut stream),
        _ => verdict(&mut stream),
    }
}
