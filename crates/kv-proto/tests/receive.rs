//! The batch-receive machine (`kv_proto::receive`) driven over scripted
//! byte streams with explicit time: every way a batch can go, on a shared
//! connection (with and without a session, with and without tagged
//! payloads) and on a stream of its own. Each case asserts the steps the
//! transport is asked to take, in order, and what was counted.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use bytes::{Buf, BufMut};
use kv_proto::auth::{AuthSecret, Channel, Transcript};
use kv_proto::dataplane::{encode_op, ReplyStatus, OPS_PER_READ, OP_LEN};
use kv_proto::receive::{BatchReceiver, Fault, Framing, HeaderFields, PayloadEnd, ReceiveLimits, Refusal, Step};
use kv_proto::session::{BadTag, End, Session};
use kv_proto::{
    BatchRefusal, DestinationError, GrantId, MemoryBudget, MemoryRegion, NoRoom, RegionAccess, RegisteredMemory,
};
use rstest::rstest;

const HEADER_LEN: usize = 48;
const PRECHECK: u32 = 1;
const REGION: MemoryRegion = MemoryRegion { addr: 0x10_0000, len: 0x10_0000 };
const GRANT: [u8; 16] = [0x5a; 16];
const GRANTED: MemoryRegion = MemoryRegion { addr: 0x10_0000, len: 0x1000 };
const TIMEOUT: Duration = Duration::from_secs(10);
const TTL: Duration = Duration::from_secs(60);

/// A header laid out as TCP's: `batch_id | flags | reserved | op_count | total | grant`.
#[derive(Debug, Clone, Copy)]
struct Header {
    batch_id: u64,
    flags: u32,
    reserved: u32,
    op_count: u64,
    total: u64,
    grant: GrantId,
}

impl Header {
    fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        let mut out = &mut b[..];
        out.put_u64_le(self.batch_id);
        out.put_u32_le(self.flags);
        out.put_u32_le(self.reserved);
        out.put_u64_le(self.op_count);
        out.put_u64_le(self.total);
        out.put_slice(&self.grant.to_bytes());
        b
    }
}

impl Header {
    fn decode(b: &[u8; HEADER_LEN]) -> Self {
        let mut buf = &b[..];
        let (batch_id, flags, reserved) = (buf.get_u64_le(), buf.get_u32_le(), buf.get_u32_le());
        let (op_count, total) = (buf.get_u64_le(), buf.get_u64_le());
        let mut grant = [0u8; 16];
        buf.copy_to_slice(&mut grant);
        Self { batch_id, flags, reserved, op_count, total, grant: GrantId::from_bytes(grant) }
    }
}

impl From<Header> for HeaderFields {
    fn from(h: Header) -> Self {
        HeaderFields {
            grant: h.grant,
            op_count: h.op_count,
            total_bytes: h.total,
            batch_id: h.batch_id,
            precheck: h.flags & PRECHECK != 0,
            well_formed: h.flags & !PRECHECK == 0 && h.reserved == 0,
        }
    }
}

/// What a transport saw of the machine, step by step.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Seen {
    Await,
    Read(&'static str, usize),
    Charge(u64),
    Refused(Refusal),
    Discard(u64),
    Stop,
    Payload(u64),
    Release,
    Reply(ReplyStatus),
    Done,
    Fail(Fault),
}

/// How the scripted peer and the world around it behave.
#[derive(Debug, Clone, Copy, Default)]
struct World {
    /// The op-list budget, bytes (0: room for anything).
    budget: u64,
    /// Bytes of it other batches hold throughout.
    others: u64,
    /// The op list's deadline passes at its read number `n` (from 0).
    late_at: Option<usize>,
    /// The grant is revoked once this many payload bytes landed.
    revoke_after: Option<u64>,
    /// The memory is closed once this many payload bytes landed.
    close_after: Option<u64>,
    /// The memory is closed before anything.
    closed: bool,
    /// Time passes between the grant and the batch.
    elapsed: Duration,
}

/// The sending side of a scripted connection.
struct Peer {
    session: Option<Session>,
    tagged_payloads: bool,
    bytes: Vec<u8>,
}

impl Peer {
    fn new(sessions: Option<(Session, Session)>, tagged_payloads: bool) -> (Self, Option<Session>) {
        let (client, server) = sessions.map_or((None, None), |(c, s)| (Some(c), Some(s)));
        (Self { session: client, tagged_payloads, bytes: Vec::new() }, server)
    }

    /// One batch: header, op list and payload (each tagged on an
    /// authenticated connection), the payload's bytes `fill`.
    fn batch(&mut self, header: Header, ops: &[(u64, u64)], send_payload: bool) {
        let h = header.encode();
        self.bytes.put_slice(&h);
        if let Some(s) = &mut self.session {
            self.bytes.put_slice(&s.send.seal(&[&h]));
        }
        let list: Vec<u8> = ops.iter().flat_map(|&(dst, len)| encode_op(dst, len)).collect();
        self.bytes.put_slice(&list);
        if let Some(s) = &mut self.session {
            self.bytes.put_slice(&s.send.seal(&[&list]));
        }
        if send_payload {
            let payload: Vec<u8> = (0..header.total).map(|i| i as u8).collect();
            self.bytes.put_slice(&payload);
            if let (Some(s), true) = (&mut self.session, self.tagged_payloads) {
                let mut frame = s.send.begin_streamed(header.batch_id);
                frame.update(&payload);
                self.bytes.put_slice(&s.send.seal_streamed(frame));
            }
        }
    }
}

fn sessions() -> (Session, Session) {
    let secret = AuthSecret::new("secret");
    let t = Transcript { channel: Channel::DataTcp, client_nonce: &[1; 32], server_nonce: &[2; 32], context: b"x" };
    (Session::derive(&secret, &t, End::Client).unwrap(), Session::derive(&secret, &t, End::Server).unwrap())
}

fn memory(now: Instant) -> RegisteredMemory {
    let memory = RegisteredMemory::new();
    // SAFETY: nothing is written through these addresses: the payload step
    // here only consumes the peer's bytes.
    unsafe { memory.register(&[REGION], RegionAccess::Destination).unwrap() };
    memory.issue_grant(GrantId::from_bytes(GRANT), &[GRANTED], now, TTL).unwrap();
    memory
}

fn limits() -> ReceiveLimits {
    ReceiveLimits { max_ops: 1 << 20, op_list_budget: 1 << 30, op_list_timeout: TIMEOUT }
}

/// Drives `rx` over `stream` until it fails, is done, or waits for a batch
/// that never comes; returns what it was asked to do.
fn drive(
    rx: &mut BatchReceiver<'_, Header, HEADER_LEN>,
    memory: &RegisteredMemory,
    stream: &[u8],
    world: World,
    start: Instant,
) -> Vec<Seen> {
    let mut stream = stream;
    let mut seen = Vec::new();
    let now = start + world.elapsed;
    let budget = MemoryBudget::new(if world.budget == 0 { u64::MAX } else { world.budget });
    let mut others = budget.charge();
    assert!(others.try_grow(world.others));
    let mut share = budget.charge();
    let mut op_list_reads = 0;
    for _ in 0..10_000 {
        match rx.next_step() {
            Step::AwaitBatch => {
                seen.push(Seen::Await);
                if stream.is_empty() {
                    return seen;
                }
                rx.advance(now);
            }
            Step::Read { what, into, by } => {
                seen.push(Seen::Read(what, into.len()));
                if what == "op list" {
                    assert_eq!(by, Some(now + TIMEOUT), "the op list's one deadline, from its header");
                    op_list_reads += 1;
                    if world.late_at == Some(op_list_reads - 1) {
                        rx.deadline_passed();
                        continue;
                    }
                } else {
                    assert_eq!(by, None);
                }
                let n = into.len();
                assert!(stream.len() >= n, "the machine reads past what the peer sent ({what})");
                into.copy_from_slice(&stream[..n]);
                stream = &stream[n..];
                rx.advance(now);
            }
            Step::Charge { bytes, by } => {
                assert_eq!(by, now + TIMEOUT);
                seen.push(Seen::Charge(bytes));
                if share.try_grow(bytes) {
                    rx.advance(now);
                } else if share.holds_fair_share() {
                    rx.no_room(NoRoom::GiveWay { held: share.bytes(), holders: budget.holders() });
                } else {
                    rx.no_room(NoRoom::Timeout);
                }
            }
            Step::Refused { refusal, reason } => {
                assert!(!reason.is_empty());
                seen.push(Seen::Refused(*refusal));
                rx.advance(now);
            }
            Step::Discard { bytes } => {
                seen.push(Seen::Discard(bytes));
                let n = usize::try_from(bytes).unwrap();
                assert!(stream.len() >= n, "discards past what the peer sent");
                stream = &stream[n..];
                rx.advance(now);
            }
            Step::Stop => {
                seen.push(Seen::Stop);
                stream = &[];
                rx.advance(now);
            }
            Step::Payload { batch, tag } => {
                let total = batch.total();
                seen.push(Seen::Payload(total));
                assert!(batch.access().is_live());
                let mut tag = tag;
                let mut landed = 0u64;
                let mut end = PayloadEnd::Complete;
                while landed < total {
                    if world.revoke_after == Some(landed) {
                        memory.revoke(&batch.grant());
                    }
                    if world.close_after == Some(landed) {
                        memory.close();
                    }
                    let piece = (total - landed).min(7);
                    let n = usize::try_from(piece).unwrap();
                    let written = batch.access().with(|| {
                        if let Some(tag) = tag.as_deref_mut() {
                            tag.update(&stream[..n]);
                        }
                    });
                    if written.is_err() {
                        end = PayloadEnd::Revoked { remaining: total - landed };
                        break;
                    }
                    stream = &stream[n..];
                    landed += piece;
                }
                rx.payload_end(end);
            }
            Step::Release => {
                seen.push(Seen::Release);
                share.release();
                rx.advance(now);
            }
            Step::Reply { status, reason } => {
                assert_eq!(status == ReplyStatus::Ok, reason.is_empty());
                seen.push(Seen::Reply(status));
                rx.advance(now);
            }
            Step::Done => {
                seen.push(Seen::Done);
                return seen;
            }
            Step::Fail(fault) => {
                seen.push(Seen::Fail(fault));
                return seen;
            }
        }
    }
    panic!("the machine did not settle: {seen:?}");
}

fn header(op_count: u64, total: u64) -> Header {
    Header { batch_id: 7, flags: 0, reserved: 0, op_count, total, grant: GrantId::from_bytes(GRANT) }
}

/// Ops inside the grant.
fn inside(n: u64, len: u64) -> Vec<(u64, u64)> {
    (0..n).map(|i| (GRANTED.addr + i * len, len)).collect()
}

/// How a case's connection is framed.
#[derive(Debug, Clone, Copy)]
enum Wire {
    Plain,
    Authenticated,
    TaggedPayloads,
    Stream,
}

struct Case {
    seen: Vec<Seen>,
    counted: Vec<(BatchRefusal, u64)>,
}

fn run(wire: Wire, world: World, header: Header, ops: &[(u64, u64)], payload: bool) -> Case {
    let start = Instant::now();
    let memory = memory(start);
    if world.closed {
        memory.close();
    }
    let (sessions, tagged) = match wire {
        Wire::Plain | Wire::Stream => (None, false),
        Wire::Authenticated => (Some(sessions()), false),
        Wire::TaggedPayloads => (Some(sessions()), true),
    };
    let (mut peer, session) = Peer::new(sessions, tagged);
    peer.batch(header, ops, payload);
    let framing = match wire {
        Wire::Stream => Framing::StreamPerBatch,
        _ => Framing::Connection { session: session.map(Box::new), tagged_payloads: tagged },
    };
    let mut rx = BatchReceiver::new(&memory, limits(), framing, Header::decode);
    let seen = drive(&mut rx, &memory, &peer.bytes, world, start);
    let stats = memory.stats();
    let counted = stats.batches_refused.iter().filter(|(_, n)| *n > 0).map(|(r, n)| (*r, *n)).collect();
    Case { seen, counted }
}

use Seen::*;

const H: &str = "batch header";

#[rstest]
#[case::well_formed(Wire::Plain, World::default(), header(2, 16), inside(2, 8),
    vec![Await, Read(H, 48), Charge(32), Read("op list", 32), Payload(16), Release, Reply(ReplyStatus::Ok), Await], vec![])]
#[case::an_empty_batch(Wire::Plain, World::default(), header(0, 0), vec![],
    vec![Await, Read(H, 48), Payload(0), Release, Reply(ReplyStatus::Ok), Await], vec![])]
#[case::too_many_ops(Wire::Plain, World::default(), header(1 << 21, 0), vec![],
    vec![Await, Read(H, 48), Fail(Fault::TooManyOps { count: 1 << 21, max: 1 << 20 })], vec![])]
#[case::malformed(Wire::Plain, World::default(), Header { reserved: 1, ..header(1, 8) }, inside(1, 8),
    vec![Await, Read(H, 48), Fail(Fault::Malformed)], vec![])]
#[case::dead_grant(Wire::Plain, World::default(), Header { grant: GrantId::from_bytes([1; 16]), ..header(3, 24) },
    inside(3, 8),
    vec![Await, Read(H, 48), Refused(Refusal::Grant(DestinationError::UnknownGrant)), Discard(48), Discard(24),
        Reply(ReplyStatus::Refused), Await],
    vec![(BatchRefusal::UnknownGrant, 1)])]
#[case::expired_grant(Wire::Plain, World { elapsed: TTL, ..World::default() }, header(1, 8), inside(1, 8),
    vec![Await, Read(H, 48), Refused(Refusal::Grant(DestinationError::ExpiredGrant)), Discard(16), Discard(8),
        Reply(ReplyStatus::Refused), Await],
    vec![(BatchRefusal::ExpiredGrant, 1)])]
#[case::outside_the_grant(Wire::Plain, World::default(), header(2, 16), vec![(GRANTED.addr, 8), (REGION.addr + 0x2000, 8)],
    vec![Await, Read(H, 48), Charge(32), Read("op list", 32), Release,
        Refused(Refusal::Grant(DestinationError::OutsideGrant { index: 1, dst: REGION.addr + 0x2000, len: 8 })),
        Discard(16), Reply(ReplyStatus::Refused), Await],
    vec![(BatchRefusal::OutsideGrant, 1)])]
#[case::no_budget_room(Wire::Plain, World { budget: 64, others: 48, ..World::default() }, header(2, 16), inside(2, 8),
    vec![Await, Read(H, 48), Charge(32), Release, Refused(Refusal::NoRoom(NoRoom::Timeout)), Discard(32), Discard(16),
        Reply(ReplyStatus::Refused), Await],
    vec![(BatchRefusal::OpBudget, 1)])]
#[case::op_list_timeout(Wire::Plain, World { late_at: Some(0), ..World::default() }, header(2, 16), inside(2, 8),
    vec![Await, Read(H, 48), Charge(32), Read("op list", 32), Fail(Fault::OpListTimeout { after: TIMEOUT })], vec![])]
#[case::length_mismatch(Wire::Plain, World::default(), header(2, 17), inside(2, 8),
    vec![Await, Read(H, 48), Charge(32), Read("op list", 32),
        Fail(Fault::LengthMismatch { declared: 17, sum: Some(16) })], vec![(BatchRefusal::LengthMismatch, 1)])]
#[case::revoked_mid_payload(Wire::Plain, World { revoke_after: Some(14), ..World::default() }, header(4, 32),
    inside(4, 8),
    vec![Await, Read(H, 48), Charge(64), Read("op list", 64), Payload(32), Release,
        Refused(Refusal::Revoked { written: 14, remaining: 18 }), Discard(18), Reply(ReplyStatus::Refused), Await],
    vec![(BatchRefusal::UnknownGrant, 1)])]
#[case::closed_mid_payload(Wire::Plain, World { close_after: Some(7), ..World::default() }, header(2, 16), inside(2, 8),
    vec![Await, Read(H, 48), Charge(32), Read("op list", 32), Payload(16), Release, Fail(Fault::Closed)],
    vec![(BatchRefusal::Closed, 1)])]
#[case::closed_memory(Wire::Plain, World { closed: true, ..World::default() }, header(2, 16), inside(2, 8),
    vec![Await, Read(H, 48), Fail(Fault::Closed)], vec![(BatchRefusal::Closed, 1)])]
#[case::precheck_admitted(Wire::Plain, World::default(), Header { flags: PRECHECK, ..header(1, 8) }, inside(1, 8),
    vec![Await, Read(H, 48), Charge(16), Read("op list", 16), Reply(ReplyStatus::Ok), Payload(8), Release,
        Reply(ReplyStatus::Ok), Await], vec![])]
#[case::precheck_refused_reads_no_payload(Wire::Plain, World::default(),
    Header { flags: PRECHECK, grant: GrantId::from_bytes([1; 16]), ..header(1, 8) }, inside(1, 8),
    vec![Await, Read(H, 48), Refused(Refusal::Grant(DestinationError::UnknownGrant)), Discard(16),
        Reply(ReplyStatus::Refused), Await],
    vec![(BatchRefusal::UnknownGrant, 1)])]
#[case::authenticated(Wire::Authenticated, World::default(), header(2, 16), inside(2, 8),
    vec![Await, Read(H, 48), Read("batch header tag", 16), Charge(32), Read("op list", 32), Read("op list tag", 16),
        Payload(16), Release, Reply(ReplyStatus::Ok), Await], vec![])]
#[case::authenticated_dead_grant_drops_the_op_lists_tag(Wire::Authenticated, World::default(),
    Header { grant: GrantId::from_bytes([1; 16]), ..header(2, 16) }, inside(2, 8),
    vec![Await, Read(H, 48), Read("batch header tag", 16), Refused(Refusal::Grant(DestinationError::UnknownGrant)),
        Discard(32), Discard(16), Discard(16), Reply(ReplyStatus::Refused), Await],
    vec![(BatchRefusal::UnknownGrant, 1)])]
#[case::tagged_payload(Wire::TaggedPayloads, World::default(), header(2, 16), inside(2, 8),
    vec![Await, Read(H, 48), Read("batch header tag", 16), Charge(32), Read("op list", 32), Read("op list tag", 16),
        Payload(16), Read("payload tag", 16), Release, Reply(ReplyStatus::Ok), Await], vec![])]
#[case::tagged_payload_refused_drops_its_tag(Wire::TaggedPayloads, World::default(), header(2, 16),
    vec![(GRANTED.addr, 8), (REGION.addr + 0x2000, 8)],
    vec![Await, Read(H, 48), Read("batch header tag", 16), Charge(32), Read("op list", 32), Read("op list tag", 16),
        Release, Refused(Refusal::Grant(DestinationError::OutsideGrant { index: 1, dst: REGION.addr + 0x2000, len: 8 })),
        Discard(16), Discard(16), Reply(ReplyStatus::Refused), Await],
    vec![(BatchRefusal::OutsideGrant, 1)])]
#[case::tagged_payload_revoked_drops_the_rest_and_its_tag(Wire::TaggedPayloads,
    World { revoke_after: Some(7), ..World::default() }, header(2, 16), inside(2, 8),
    vec![Await, Read(H, 48), Read("batch header tag", 16), Charge(32), Read("op list", 32), Read("op list tag", 16),
        Payload(16), Release, Refused(Refusal::Revoked { written: 7, remaining: 9 }), Discard(9), Discard(16),
        Reply(ReplyStatus::Refused), Await],
    vec![(BatchRefusal::UnknownGrant, 1)])]
#[case::stream_well_formed(Wire::Stream, World::default(), header(2, 16), inside(2, 8),
    vec![Read(H, 48), Charge(32), Read("op list", 32), Payload(16), Release, Reply(ReplyStatus::Ok), Done], vec![])]
#[case::stream_dead_grant_is_stopped(Wire::Stream, World::default(),
    Header { grant: GrantId::from_bytes([1; 16]), ..header(1, 8) }, inside(1, 8),
    vec![Read(H, 48), Refused(Refusal::Grant(DestinationError::UnknownGrant)), Stop, Reply(ReplyStatus::Refused),
        Done], vec![(BatchRefusal::UnknownGrant, 1)])]
#[case::stream_no_room(Wire::Stream, World { budget: 64, others: 48, ..World::default() }, header(2, 16), inside(2, 8),
    vec![Read(H, 48), Charge(32), Release, Refused(Refusal::NoRoom(NoRoom::Timeout)), Stop,
        Reply(ReplyStatus::Refused), Done], vec![(BatchRefusal::OpBudget, 1)])]
#[case::stream_revoked_mid_payload(Wire::Stream, World { revoke_after: Some(0), ..World::default() }, header(1, 8),
    inside(1, 8),
    vec![Read(H, 48), Charge(16), Read("op list", 16), Payload(8), Release,
        Refused(Refusal::Revoked { written: 0, remaining: 8 }), Stop, Reply(ReplyStatus::Refused), Done],
    vec![(BatchRefusal::UnknownGrant, 1)])]
fn every_path_of_a_batch(
    #[case] wire: Wire,
    #[case] world: World,
    #[case] header: Header,
    #[case] ops: Vec<(u64, u64)>,
    #[case] expected: Vec<Seen>,
    #[case] counted: Vec<(BatchRefusal, u64)>,
) {
    let payload = !HeaderFields::from(header).precheck || !expected.contains(&Seen::Reply(ReplyStatus::Refused));
    let case = run(wire, world, header, &ops, payload);
    assert_eq!(case.seen, expected);
    assert_eq!(case.counted, counted);
}

/// A giving-way refusal: the batch holds an equal share already.
#[test]
fn a_list_that_holds_an_equal_share_gives_way() {
    let count = OPS_PER_READ as u64 + 1;
    let budget = (OPS_PER_READ * OP_LEN) as u64 + 16;
    let world = World { budget, others: 8, ..World::default() };
    let ops: Vec<(u64, u64)> = (0..count).map(|i| (GRANTED.addr + i % 8, 0)).collect();
    let case = run(Wire::Plain, world, header(count, 0), &ops, true);
    let held = (OPS_PER_READ * OP_LEN) as u64;
    assert_eq!(case.seen[..5], [Await, Read(H, 48), Charge(held), Read("op list", OPS_PER_READ * OP_LEN), Charge(16)]);
    assert_eq!(case.seen[5..7], [Release, Refused(Refusal::NoRoom(NoRoom::GiveWay { held, holders: 2 }))]);
    assert_eq!(case.seen[7..], [Discard(16), Reply(ReplyStatus::Refused), Await], "the one unread entry is dropped");
}

/// Which frame of an authenticated batch the peer alters.
#[derive(Debug, Clone, Copy)]
enum Altered {
    Header,
    HeaderTag,
    OpList,
    OpListTag,
    Payload,
    PayloadTag,
}

#[rstest]
#[case::the_header(Altered::Header, Fault::BadTag(BadTag { seq: 0 }))]
#[case::the_header_tag(Altered::HeaderTag, Fault::BadTag(BadTag { seq: 0 }))]
#[case::an_op(Altered::OpList, Fault::BadTag(BadTag { seq: 1 }))]
#[case::the_op_list_tag(Altered::OpListTag, Fault::BadTag(BadTag { seq: 1 }))]
#[case::the_payload(Altered::Payload, Fault::BadPayloadTag(BadTag { seq: 2 }))]
#[case::the_payload_tag(Altered::PayloadTag, Fault::BadPayloadTag(BadTag { seq: 2 }))]
fn an_altered_frame_fails_its_tag(#[case] altered: Altered, #[case] fault: Fault) {
    let start = Instant::now();
    let memory = memory(start);
    let (mut peer, session) = Peer::new(Some(sessions()), true);
    peer.batch(header(2, 16), &inside(2, 8), true);
    let at = match altered {
        Altered::Header => 8,
        Altered::HeaderTag => 48,
        Altered::OpList => 64 + 16,
        Altered::OpListTag => 64 + 32,
        Altered::Payload => 64 + 48 + 3,
        Altered::PayloadTag => 64 + 48 + 16 + 15,
    };
    peer.bytes[at] ^= 0x01;
    let framing = Framing::Connection { session: session.map(Box::new), tagged_payloads: true };
    let mut rx = BatchReceiver::new(&memory, limits(), framing, Header::decode);
    let seen = drive(&mut rx, &memory, &peer.bytes, World::default(), start);
    assert_eq!(seen.last(), Some(&Fail(fault)), "{seen:?}");
    let landed = seen.iter().any(|s| matches!(s, Payload(_)));
    assert_eq!(landed, matches!(altered, Altered::Payload | Altered::PayloadTag), "a payload lands only once admitted");
    assert!(!seen.contains(&Reply(ReplyStatus::Ok)));
}

/// Refused batches keep the session in step: the frames dropped unread are
/// counted, so the next batch's tags check.
#[test]
fn batches_after_refused_ones_still_check() {
    let start = Instant::now();
    let memory = memory(start);
    let (mut peer, session) = Peer::new(Some(sessions()), true);
    let dead = Header { grant: GrantId::from_bytes([1; 16]), ..header(2, 16) };
    peer.batch(dead, &inside(2, 8), true);
    peer.batch(header(2, 16), &[(GRANTED.addr, 8), (REGION.addr + 0x2000, 8)], true);
    peer.batch(Header { flags: PRECHECK, ..dead }, &inside(2, 8), false);
    peer.batch(header(2, 16), &inside(2, 8), true);
    let framing = Framing::Connection { session: session.map(Box::new), tagged_payloads: true };
    let mut rx = BatchReceiver::new(&memory, limits(), framing, Header::decode);
    let seen = drive(&mut rx, &memory, &peer.bytes, World::default(), start);
    let replies: Vec<&Seen> = seen.iter().filter(|s| matches!(s, Reply(_))).collect();
    assert_eq!(
        replies,
        [
            &Reply(ReplyStatus::Refused),
            &Reply(ReplyStatus::Refused),
            &Reply(ReplyStatus::Refused),
            &Reply(ReplyStatus::Ok)
        ]
    );
    assert_eq!(seen.last(), Some(&Await));
    assert_eq!(rx.header().map(|h| h.batch_id), Some(7));
}

/// Replies are tagged in the send direction, in order.
#[test]
fn replies_are_sealed_in_order() {
    let start = Instant::now();
    let memory = memory(start);
    let (mut client, server) = sessions();
    let framing = Framing::Connection { session: Some(Box::new(server)), tagged_payloads: false };
    let mut rx = BatchReceiver::new(&memory, limits(), framing, Header::decode);
    let first = rx.seal(b"one").unwrap();
    let second = rx.seal(b"two").unwrap();
    assert_eq!(client.recv.open(&[b"one"], &first), Ok(()));
    assert_eq!(client.recv.open(&[b"two"], &second), Ok(()));
    let mut plain = BatchReceiver::new(&memory, limits(), Framing::StreamPerBatch, Header::decode);
    assert!(plain.seal(b"one").is_none());
}
