//! kvlink's fuzz targets, as plain functions of the input bytes.
//!
//! Each target checks what must hold for any input, not only that nothing
//! panics: a failed check is a panic, which libFuzzer reports as a crash and
//! saves. The thin binaries in `fuzz_targets/` (feature `libfuzzer`, built by
//! `cargo +nightly fuzz`) only call these functions; `tests/replay.rs` calls
//! them on stable for every file of the committed corpus
//! (`cargo xtask fuzz --replay`), so the checks are compiled and exercised by
//! the ordinary toolchain as well.
//!
//! | target | what it drives | what it checks |
//! | --- | --- | --- |
//! | [`side_channel_frame`] | `FrameCodec::decode` (split at chosen points), `decode_eof`, `decode_exact` | same result however the stream is split; heap bounded by the frame limit and the input, whatever lengths the frame claims; whatever decodes re-encodes no longer and decodes to the same message |
//! | [`side_channel_message`] | built `SideMessage`s | encode/decode round trip; out-of-bound fields refused; `reply_bound` covers the worst reply |
//! | [`auth`] | proofs over built transcripts and secrets | a proof verifies only for its own secret (up to HMAC key equivalence), role and transcript |
//! | [`transfer_config_json`] | `KvTransferConfig::from_json` | accepted configs hold what the JSON says (no protocol when unset) and re-serialize to the same config |
//! | [`transfer_params_json`] | `KvTransferParams::from_json` | accepted params hold what the JSON says and round-trip through `to_json` |
//! | [`bootstrap_http`] | bootstrap registrations, query replies, worker addresses, bootstrap URLs, error details (`kv_proto::bootstrap`); a `BootstrapRegistry` fed the registrations that parse | errors short and escaped; accepted values hold what the JSON says and round-trip; every engine of a reply lists every tp x pp worker; the registry agrees with a model and answers a query exactly when complete, with what was registered |
//! | [`registered_memory`] | `RegisteredMemory` operation sequences | agrees with a model; admitted ops lie in the grant and in destination memory, never in source-only memory; dead grants refuse |
//! | [`dataplane`] | op entries, `Cursor`, verdicts, bounded texts | round trips; the cursor walks exactly the segments' bytes; reasons bounded on a character boundary |
//! | [`tcp_dataplane`] | TCP data-plane preamble as the receiver answers it, then batches through the batch-receive machine (`kv_proto::receive`) the receiver runs; accept and reply headers as the sender reads them | re-encoding gives the same bytes; preamble answered by the model; op list within the limit and the budget, memory following the bytes that arrive, admitted only inside the grant with lengths adding up; refusals answered; each batch read to its end, in step |
//! | [`quic_dataplane`] | QUIC endpoint details, hellos, a batch stream through the same machine, verdicts | re-encoding gives the same bytes; errors name what they found; the batch as on TCP, a refused stream stopped |
//! | [`rdma_control`] | RDMA control replies and requests (`read_reply`, `read_request`), the handshake (`read_message`), endpoint details | the stream readers agree with the decoders; round trips; heap bounded by the bytes read, not the counts claimed; limits kept |
//! | [`bench_control`] | the bench control connection: its length-delimited codecs, `decode_client_msg` / `decode_server_msg`, `check_shape` | no frame over the bound; heap bounded; decoded messages round-trip; admitted shapes within bounds |
//! | [`cores`] | `ConnectorScheduler`, `SenderCore`, `ReceiverCore` event sequences | each agrees with a model; every pull reported (or cancelled) exactly once and only once fenced; a cancelled pull never reported, its grant revoked or refused; blocks freed once per hold; no external count without a pull |

mod alloc_meter;
mod arb;
mod auth;
mod bootstrap;
mod control;
mod cores;
mod dataplane;
mod frame;
mod json;
mod message;
mod op_list;
mod quic;
mod rdma;
mod registered;
mod tcp;

pub use auth::auth;
pub use bootstrap::bootstrap_http;
pub use control::bench_control;
pub use cores::cores;
pub use dataplane::dataplane;
pub use frame::side_channel_frame;
pub use json::{transfer_config_json, transfer_params_json};
pub use message::side_channel_message;
pub use quic::quic_dataplane;
pub use rdma::rdma_control;
pub use registered::registered_memory;
pub use tcp::tcp_dataplane;

/// A fuzz target: checks one input, panics when a check fails.
pub type Target = fn(&[u8]);

/// Every target by name (the name of its binary and of its corpus folder).
pub const TARGETS: &[(&str, Target)] = &[
    ("side_channel_frame", side_channel_frame),
    ("side_channel_message", side_channel_message),
    ("auth", auth),
    ("transfer_config_json", transfer_config_json),
    ("transfer_params_json", transfer_params_json),
    ("bootstrap_http", bootstrap_http),
    ("registered_memory", registered_memory),
    ("dataplane", dataplane),
    ("cores", cores),
    ("tcp_dataplane", tcp_dataplane),
    ("quic_dataplane", quic_dataplane),
    ("rdma_control", rdma_control),
    ("bench_control", bench_control),
];
