//! The cases of the contract, one public function each, run against any
//! [`Backend`]. A case builds its peers through a [`Harness`], so it speaks
//! the `BatchWriter` trait only.

use std::sync::Arc;
use std::time::Duration;

use kv_proto::{Endpoint, Grant, GrantId, MemoryRegion, Protocol, RegionAccess, TransportError, WriteOp};
use tokio::task::JoinSet;

use super::harness::{assert_dead_peer_error, packed_ops, write_and_check, Backend, Harness, GRANT_TTL};
use crate::{pattern, stats, TestBuf};

/// `stats` counts the grants live: each `grant` adds one, each `revoke`
/// takes it away again; a fresh writer reports zeros, every refusal reason
/// listed.
pub async fn grants_live_follows_grant_and_revoke(backend: impl Backend) {
    let mut h = Harness::new(backend);
    let b = h.peer(&[1 << 16]).await;
    assert_eq!(b.writer.stats(), stats::expected(0, &[], 0), "a fresh writer reports zeros, every reason listed");
    let first = b.grant_all().await;
    let second = b.grant(&[MemoryRegion::new(b.addr(0, 0), 4096)]).await;
    assert_eq!(b.writer.stats().grants_live, 2);
    b.writer.revoke(&first.id).await;
    assert_eq!(b.writer.stats().grants_live, 1);
    b.writer.revoke(&second.id).await;
    assert_eq!(b.writer.stats(), stats::expected(0, &[], 0));
}

/// A writer's endpoint names its protocol and an address.
pub async fn endpoint_names_the_writers_protocol(backend: impl Backend) {
    let mut h = Harness::new(backend);
    let a = h.peer(&[4096]).await;
    let endpoint = a.endpoint();
    assert_eq!(endpoint.protocol, a.writer.protocol());
    assert!(!endpoint.address.is_empty());
}

/// One op lands, and nothing around it.
pub async fn single_op(backend: impl Backend) {
    let mut h = Harness::new(backend);
    let mut a = h.peer(&[1 << 16]).await;
    let b = h.peer(&[1 << 16]).await;
    let ops = [WriteOp { src: a.addr(0, 100), dst: b.addr(0, 5000), len: 8192 }];
    write_and_check(&mut a, &b, &ops).await;
    b.check_untouched_outside(&ops);
}

/// A thousand 4 KiB ops land, and nothing around them.
pub async fn many_ops(backend: impl Backend) {
    let mut h = Harness::new(backend);
    let mut a = h.peer(&[4 << 20]).await;
    let b = h.peer(&[4 << 20]).await;
    let ops = packed_ops(&a, &b, 1000, 4096);
    write_and_check(&mut a, &b, &ops).await;
    b.check_untouched_outside(&ops);
}

/// Non-contiguous sources and destinations, odd lengths, destinations in
/// reverse order spread over two regions.
pub async fn scattered_ops(backend: impl Backend) {
    let mut h = Harness::new(backend);
    let mut a = h.peer(&[2 << 20]).await;
    let b = h.peer(&[1 << 20, 1 << 20]).await;
    let mut ops = Vec::new();
    let mut src_at = 0usize;
    let mut dst_end = [1usize << 20, 1 << 20];
    for k in 0..400usize {
        let len = 1 + (k * 7919) % 4000;
        let region = k % 2;
        let dst_at = dst_end[region] - len - 13;
        dst_end[region] = dst_at;
        ops.push(WriteOp { src: a.addr(0, src_at), dst: b.addr(region, dst_at), len: len as u64 });
        src_at += len + 7;
    }
    write_and_check(&mut a, &b, &ops).await;
    b.check_untouched_outside(&ops);
}

/// An empty batch and zero-length ops succeed and write nothing; mixed
/// with real ops, only those land.
pub async fn zero_length_ops_and_empty_batch(backend: impl Backend) {
    let mut h = Harness::new(backend);
    let mut a = h.peer(&[1 << 16]).await;
    let b = h.peer(&[1 << 16]).await;
    let grant = b.grant_all().await;
    a.writer.batch_write(&b.endpoint(), &grant, &[]).await.unwrap();
    let only_empty = [WriteOp { src: a.addr(0, 10), dst: b.addr(0, 20), len: 0 }];
    a.writer.batch_write(&b.endpoint(), &grant, &only_empty).await.unwrap();
    assert!(b.all_zero());
    let ops = [
        WriteOp { src: a.addr(0, 0), dst: b.addr(0, 0), len: 0 },
        WriteOp { src: a.addr(0, 100), dst: b.addr(0, 1000), len: 300 },
        WriteOp { src: a.addr(0, 1 << 16), dst: b.addr(0, 1 << 16), len: 0 },
        WriteOp { src: a.addr(0, 500), dst: b.addr(0, 2000), len: 1 },
    ];
    a.fill_sources(&ops);
    a.writer.batch_write(&b.endpoint(), &grant, &ops).await.unwrap();
    b.check_destinations(&ops);
    b.check_untouched_outside(&ops);
}

/// 200,000 small ops in one batch, destinations strided and reversed.
pub async fn huge_batch_of_small_ops(backend: impl Backend) {
    const COUNT: usize = 200_000;
    const LEN: usize = 64;
    let mut h = Harness::new(backend);
    let mut a = h.peer(&[COUNT * LEN]).await;
    let b = h.peer(&[COUNT * LEN * 2]).await;
    let ops: Vec<WriteOp> = (0..COUNT)
        .map(|k| WriteOp { src: a.addr(0, k * LEN), dst: b.addr(0, (COUNT - 1 - k) * LEN * 2), len: LEN as u64 })
        .collect();
    write_and_check(&mut a, &b, &ops).await;
    b.check_untouched_outside(&ops);
}

/// One 256 MiB op and three 8 MiB ones (destinations reversed) in one batch.
pub async fn large_ops(backend: impl Backend) {
    const MIB: usize = 1 << 20;
    let mut h = Harness::new(backend);
    let mut a = h.peer(&[280 * MIB]).await;
    let b = h.peer(&[256 * MIB, 24 * MIB]).await;
    let mut ops = vec![WriteOp { src: a.addr(0, 0), dst: b.addr(0, 0), len: (256 * MIB) as u64 }];
    for k in 0..3 {
        ops.push(WriteOp {
            src: a.addr(0, (256 + 8 * k) * MIB),
            dst: b.addr(1, (16 - 8 * k) * MIB),
            len: (8 * MIB) as u64,
        });
    }
    write_and_check(&mut a, &b, &ops).await;
}

/// The bad op of an out-of-range batch.
#[derive(Clone, Copy, Debug)]
pub enum BadDst {
    /// Starts at the end of the region.
    PastEnd,
    /// Starts inside, ends past the end.
    StraddlesEnd,
    /// Starts before the region, ends inside.
    StraddlesStart,
    /// `dst + len` overflows u64.
    Overflows,
    /// An address no region covers.
    Unregistered,
}

/// A batch with one op outside the receiver's memory (past, straddling,
/// overflowing, unregistered) is refused whole, naming the op, and costs
/// the pair nothing else.
pub async fn destination_out_of_range_is_refused_whole(backend: impl Backend, bad: BadDst) {
    let mut h = Harness::new(backend);
    let mut a = h.peer(&[1 << 16]).await;
    let b = h.peer(&[1 << 16]).await;
    let end = b.addr(0, 1 << 16);
    let (dst, len) = match bad {
        BadDst::PastEnd => (end, 16),
        BadDst::StraddlesEnd => (end - 8, 16),
        BadDst::StraddlesStart => (b.addr(0, 0) - 8, 16),
        BadDst::Overflows => (u64::MAX - 8, 16),
        BadDst::Unregistered => (0x1000, 16),
    };
    let good = [
        WriteOp { src: a.addr(0, 0), dst: b.addr(0, 0), len: 4096 },
        WriteOp { src: a.addr(0, 8192), dst: b.addr(0, 8192), len: 4096 },
    ];
    // The bad op's source (16 bytes inside `a`) is valid: only the peer can
    // refuse it. The grant covers all of `b`'s memory; the op is outside.
    let ops = [good[0], WriteOp { src: a.addr(0, 4096), dst, len }, good[1]];
    a.fill_sources(&ops);
    let grant = b.grant_all().await;
    let err = a.writer.batch_write(&b.endpoint(), &grant, &ops).await.unwrap_err();
    match &err {
        TransportError::Refused { reason, .. } => assert!(reason.contains("op 1"), "reason {reason:?} names no op"),
        other => panic!("expected Refused, got {other:?}"),
    }
    assert!(b.all_zero(), "a refused batch wrote bytes");
    // The refusal costs nothing else: the same pair keeps working.
    write_and_check(&mut a, &b, &good).await;
    b.check_untouched_outside(&good);
}

/// An op whose source is outside the sender's registered memory is
/// refused by the sender, naming it, before anything is sent.
pub async fn source_out_of_range_is_refused(backend: impl Backend) {
    let mut h = Harness::new(backend);
    let a = h.peer(&[1 << 16]).await;
    let b = h.peer(&[1 << 16]).await;
    let end = a.addr(0, 1 << 16);
    let grant = b.grant_all().await;
    for (src, len) in [(end, 1), (end - 8, 16), (a.addr(0, 0) - 1, 2), (u64::MAX - 8, 16), (0x1000, 8)] {
        let ops = [WriteOp { src: a.addr(0, 0), dst: b.addr(0, 0), len: 64 }, WriteOp { src, dst: b.addr(0, 64), len }];
        let err = a.writer.batch_write(&b.endpoint(), &grant, &ops).await.unwrap_err();
        assert!(
            matches!(err, TransportError::SourceOutOfBounds { addr, len: l } if addr == src && l == len),
            "source {src:#x}+{len}: unexpected {err:?}"
        );
    }
    assert!(b.all_zero());
}

/// An endpoint of another protocol, or an address that does not parse,
/// is refused before anything is sent.
pub async fn wrong_protocol_and_bad_address_are_refused(backend: impl Backend) {
    let mut h = Harness::new(backend);
    let a = h.peer(&[4096]).await;
    let b = h.peer(&[4096]).await;
    let ops = [WriteOp { src: a.addr(0, 0), dst: b.addr(0, 0), len: 16 }];
    let grant = b.grant_for(&ops).await;
    let other = match a.writer.protocol() {
        Protocol::Quic => Protocol::Rdma,
        _ => Protocol::Quic,
    };
    let wrong = Endpoint { protocol: other, ..b.endpoint() };
    let err = a.writer.batch_write(&wrong, &grant, &ops).await.unwrap_err();
    assert!(matches!(err, TransportError::WrongProtocol { .. }), "{err:?}");
    let bad = Endpoint { address: "no port here".to_owned(), ..b.endpoint() };
    let err = a.writer.batch_write(&bad, &grant, &ops).await.unwrap_err();
    assert!(matches!(err, TransportError::BadEndpoint { .. }), "{err:?}");
    assert!(b.all_zero());
}

/// Registering a region that overlaps a registered one, or an empty one,
/// is refused.
pub async fn overlapping_regions_are_refused(backend: impl Backend) {
    let mut h = Harness::new(backend);
    let a = h.peer(&[8192]).await;
    let overlapping = MemoryRegion::new(a.addr(0, 4096), 8192);
    // SAFETY: the registration is refused, so nothing ever touches the range.
    let err = unsafe { a.writer.register_regions(&[overlapping], RegionAccess::Destination) }.unwrap_err();
    assert!(matches!(err, TransportError::Registration(_)), "{err:?}");
    // SAFETY: as above; a zero-length region is refused.
    let err = unsafe { a.writer.register_regions(&[MemoryRegion::new(a.addr(0, 0), 0)], RegionAccess::Destination) }
        .unwrap_err();
    assert!(matches!(err, TransportError::Registration(_)), "{err:?}");
}

/// How a peer goes away.
#[derive(Clone, Copy, Debug)]
pub enum Gone {
    /// `shutdown().await`, its memory kept.
    ShutDown,
    /// Dropped with its memory.
    Dropped,
}

/// A batch to a peer that shut down or was dropped fails as a dead peer
/// does, within the backend's bound, even over a pooled connection.
pub async fn writing_to_a_gone_peer_fails_within_the_bound(backend: impl Backend, gone: Gone) {
    let mut h = Harness::new(backend);
    let mut a = h.peer(&[1 << 16]).await;
    let b = h.peer(&[1 << 16]).await;
    let ops = packed_ops(&a, &b, 4, 1024);
    // A first batch leaves a pooled connection behind where there are any.
    write_and_check(&mut a, &b, &ops).await;
    let endpoint = b.endpoint();
    let grant = b.grant_for(&ops).await;
    match gone {
        Gone::ShutDown => {
            b.writer.shutdown().await;
            // Keep the shut-down writer (and its memory) alive; it must not serve.
            let result = tokio::time::timeout(h.failure_bound(), a.writer.batch_write(&endpoint, &grant, &ops)).await;
            assert_dead_peer_error(result.expect("the batch did not fail within the bound"));
            drop(b);
        }
        Gone::Dropped => {
            drop(b);
            let result = tokio::time::timeout(h.failure_bound(), a.writer.batch_write(&endpoint, &grant, &ops)).await;
            assert_dead_peer_error(result.expect("the batch did not fail within the bound"));
        }
    }
}

/// A writer that shut down refuses batches, registrations and grants.
pub async fn a_shut_down_writer_refuses_work(backend: impl Backend) {
    let mut h = Harness::new(backend);
    let a = h.peer(&[4096]).await;
    let b = h.peer(&[4096]).await;
    let ops = [WriteOp { src: a.addr(0, 0), dst: b.addr(0, 0), len: 16 }];
    let grant = b.grant_for(&ops).await;
    a.writer.shutdown().await;
    let err = a.writer.batch_write(&b.endpoint(), &grant, &ops).await.unwrap_err();
    assert!(matches!(err, TransportError::Shutdown), "{err:?}");
    let extra = TestBuf::new(4096);
    // SAFETY: refused (the writer is shut down), so the buffer is never used.
    let err = unsafe { a.writer.register_regions(&[extra.region()], RegionAccess::Destination) }.unwrap_err();
    assert!(matches!(err, TransportError::Shutdown), "{err:?}");
    let err = a.writer.grant(&[MemoryRegion::new(a.addr(0, 0), 16)], GRANT_TTL).await.unwrap_err();
    assert!(matches!(err, TransportError::Shutdown), "{err:?}");
    assert!(b.all_zero());
}

/// Eight batches in flight at once from one writer to one peer.
pub async fn concurrent_batches_to_one_peer(backend: impl Backend) {
    const BATCHES: usize = 8;
    const OPS: usize = 512;
    const LEN: usize = 2048;
    let mut h = Harness::new(backend);
    let mut a = h.peer(&[BATCHES * OPS * LEN]).await;
    let b = h.peer(&[BATCHES * OPS * LEN * 2]).await;
    let all = packed_ops(&a, &b, BATCHES * OPS, LEN);
    // Scatter: every other slot of the destination, so batches interleave.
    let all: Vec<WriteOp> =
        all.iter().enumerate().map(|(k, op)| WriteOp { dst: b.addr(0, k * LEN * 2), ..*op }).collect();
    a.fill_sources(&all);
    let mut tasks = JoinSet::new();
    for chunk in all.chunks(OPS) {
        // One grant per batch, as one pull per transfer request.
        let grant = b.grant_for(chunk).await;
        let (writer, endpoint, ops) = (Arc::clone(&a.writer), b.endpoint(), chunk.to_vec());
        tasks.spawn(async move { writer.batch_write(&endpoint, &grant, &ops).await });
    }
    while let Some(joined) = tasks.join_next().await {
        joined.unwrap().unwrap();
    }
    b.check_destinations(&all);
    b.check_untouched_outside(&all);
}

/// Four writers write into distinct ranges of one receiver at once.
pub async fn concurrent_peers_into_one_receiver(backend: impl Backend) {
    const SENDERS: usize = 4;
    const OPS: usize = 1024;
    const LEN: usize = 1024;
    let mut h = Harness::new(backend);
    let b = h.peer(&[SENDERS * OPS * LEN]).await;
    let mut senders = Vec::new();
    let mut all = Vec::new();
    for s in 0..SENDERS {
        let mut a = h.peer(&[OPS * LEN]).await;
        // Sender s owns every SENDERS-th slot, starting at slot s.
        let ops: Vec<WriteOp> = (0..OPS)
            .map(|k| WriteOp { src: a.addr(0, k * LEN), dst: b.addr(0, (k * SENDERS + s) * LEN), len: LEN as u64 })
            .collect();
        // Seeds must differ between senders: offset each sender's op index.
        for (k, op) in ops.iter().enumerate() {
            pattern::fill_slice(a.slice_mut(op.src, op.len), (s * OPS + k) as u64);
        }
        all.extend(ops.iter().copied());
        senders.push((a, ops));
    }
    let mut tasks = JoinSet::new();
    for (a, ops) in &senders {
        let grant = b.grant_for(ops).await;
        let (writer, endpoint, ops) = (Arc::clone(&a.writer), b.endpoint(), ops.clone());
        tasks.spawn(async move { writer.batch_write(&endpoint, &grant, &ops).await });
    }
    while let Some(joined) = tasks.join_next().await {
        joined.unwrap().unwrap();
    }
    for (s, (_, ops)) in senders.iter().enumerate() {
        for (k, op) in ops.iter().enumerate() {
            assert!(pattern::holds(b.slice(op.dst, op.len), (s * OPS + k) as u64), "sender {s} op {k} landed wrong");
        }
    }
    b.check_untouched_outside(&all);
}

/// How a batch lacks a live grant.
#[derive(Clone, Copy, Debug)]
pub enum NoGrant {
    /// An id the receiver never issued.
    Forged,
    /// A grant the receiver revoked.
    Revoked,
    /// A grant whose validity ran out.
    Expired,
    /// A live grant of another receiver.
    Elsewhere,
}

/// A batch without a live grant of the receiver lands nothing, and the
/// same pair keeps working under a real one.
pub async fn a_batch_without_a_live_grant_is_refused_whole(backend: impl Backend, how: NoGrant) {
    let mut h = Harness::new(backend);
    let mut a = h.peer(&[1 << 16]).await;
    let b = h.peer(&[1 << 16]).await;
    let c = h.peer(&[1 << 16]).await;
    let ops = packed_ops(&a, &b, 8, 2048);
    a.fill_sources(&ops);
    let grant = match how {
        NoGrant::Forged => Grant::plain(GrantId::random().unwrap()),
        NoGrant::Revoked => {
            let grant = b.grant_for(&ops).await;
            b.writer.revoke(&grant.id).await;
            grant
        }
        NoGrant::Expired => b.writer.grant(&pattern::covering(&ops), Duration::ZERO).await.unwrap(),
        NoGrant::Elsewhere => c.grant_all().await,
    };
    let err = a.writer.batch_write(&b.endpoint(), &grant, &ops).await.unwrap_err();
    assert!(matches!(err, TransportError::Refused { .. }), "{how:?}: expected Refused, got {err:?}");
    assert!(b.all_zero(), "{how:?}: a batch without a live grant wrote bytes");
    write_and_check(&mut a, &b, &ops).await;
}

/// Where an op outside the grant points.
#[derive(Clone, Copy, Debug)]
pub enum OutsideGrant {
    /// A destination region the grant does not cover.
    UngrantedDestination,
    /// A region the receiver registered only as a source.
    SourceRegion,
    /// One byte past the grant's last range.
    PastTheGrant,
}

/// An op outside the grant (though perhaps inside registered memory) makes
/// the whole batch refused; a large batch too (transports that spread a
/// batch over several connections must still refuse it whole).
pub async fn an_op_outside_the_grant_is_refused_whole(
    backend: impl Backend,
    outside: OutsideGrant,
    batch_bytes: usize,
) {
    let mut h = Harness::new(backend);
    let size = batch_bytes * 2;
    let mut a = h.peer_with(&[size], &[RegionAccess::Source]).await;
    // Buffer 0: destinations; buffer 1: a source region of the receiver.
    let b = h.peer_with(&[size, 4096], &[]).await;
    let b_regions: Vec<MemoryRegion> = b.bufs.iter().map(TestBuf::region).collect();
    // SAFETY: as in `Harness::peer_with`: the buffers outlive the writer.
    unsafe {
        b.writer.register_regions(&b_regions[..1], RegionAccess::Destination).unwrap();
        b.writer.register_regions(&b_regions[1..], RegionAccess::Source).unwrap();
    }
    let ops = packed_ops(&a, &b, 16, batch_bytes / 16);
    let grant = b.grant_for(&ops).await;
    let bad_dst = match outside {
        OutsideGrant::UngrantedDestination => b.addr(0, size - 4096),
        OutsideGrant::SourceRegion => b.addr(1, 0),
        OutsideGrant::PastTheGrant => b.addr(0, batch_bytes),
    };
    let mut bad = ops.clone();
    bad.push(WriteOp { src: a.addr(0, batch_bytes), dst: bad_dst, len: 16 });
    a.fill_sources(&bad);
    let err = a.writer.batch_write(&b.endpoint(), &grant, &bad).await.unwrap_err();
    assert!(matches!(err, TransportError::Refused { .. }), "{outside:?}: expected Refused, got {err:?}");
    assert!(b.all_zero(), "{outside:?}: a batch with an op outside its grant wrote bytes");
    // A grant can never cover a source region.
    let err = b.writer.grant(&b_regions[1..], GRANT_TTL).await.unwrap_err();
    assert!(matches!(err, TransportError::Grant(_)), "{err:?}");
    // The grant itself is still good.
    a.writer.batch_write(&b.endpoint(), &grant, &ops).await.unwrap();
    b.check_destinations(&ops);
    b.check_untouched_outside(&ops);
}

/// A writer that registered only sources (a prefill-only instance) accepts
/// no write: it has nothing to grant, and no forged grant opens it.
pub async fn a_sender_only_writer_accepts_no_writes(backend: impl Backend) {
    let mut h = Harness::new(backend);
    let p = h.peer_with(&[1 << 16], &[RegionAccess::Source]).await;
    let mut hostile = h.peer(&[1 << 16]).await;
    let ops = packed_ops(&hostile, &p, 4, 1024);
    hostile.fill_sources(&ops);
    let err = p.writer.grant(&pattern::covering(&ops), GRANT_TTL).await.unwrap_err();
    assert!(matches!(err, TransportError::Grant(_)), "a source-only writer granted its sources: {err:?}");
    let forged = Grant::plain(GrantId::random().unwrap());
    let err = hostile.writer.batch_write(&p.endpoint(), &forged, &ops).await.unwrap_err();
    assert!(
        matches!(err, TransportError::Refused { .. } | TransportError::Connect { .. }),
        "expected a refusal, got {err:?}"
    );
    assert!(p.all_zero(), "a peer wrote into a sender's source memory");
}

/// A hostile peer's refused batches cost an honest peer nothing: both write
/// into one receiver at once; the honest one's batch lands, the hostile
/// ones land nothing.
pub async fn an_honest_peer_is_unaffected_by_a_hostile_one(backend: impl Backend) {
    const OPS: usize = 256;
    const LEN: usize = 4096;
    let mut h = Harness::new(backend);
    let b = h.peer(&[2 * OPS * LEN]).await;
    let mut honest = h.peer(&[OPS * LEN]).await;
    let mut hostile = h.peer(&[OPS * LEN]).await;
    let honest_ops = packed_ops(&honest, &b, OPS, LEN);
    honest.fill_sources(&honest_ops);
    let hostile_ops: Vec<WriteOp> = (0..OPS)
        .map(|k| WriteOp { src: hostile.addr(0, k * LEN), dst: b.addr(0, (OPS + k) * LEN), len: LEN as u64 })
        .collect();
    hostile.fill_sources(&hostile_ops);
    let grant = b.grant_for(&honest_ops).await;
    let forged = Grant::plain(GrantId::random().unwrap());
    let mut tasks = JoinSet::new();
    for attempt in 0..4 {
        // Alternately a forged grant, and the honest grant stolen for ops outside it.
        let used = if attempt % 2 == 0 { forged.clone() } else { grant.clone() };
        let (writer, endpoint, ops) = (Arc::clone(&hostile.writer), b.endpoint(), hostile_ops.clone());
        tasks.spawn(async move { (false, writer.batch_write(&endpoint, &used, &ops).await) });
    }
    let (writer, endpoint, ops) = (Arc::clone(&honest.writer), b.endpoint(), honest_ops.clone());
    let honest_grant = grant.clone();
    tasks.spawn(async move { (true, writer.batch_write(&endpoint, &honest_grant, &ops).await) });
    while let Some(joined) = tasks.join_next().await {
        match joined.unwrap() {
            (true, result) => result.unwrap(),
            (false, result) => {
                let err = result.unwrap_err();
                assert!(matches!(err, TransportError::Refused { .. }), "hostile batch: {err:?}");
            }
        }
    }
    b.check_destinations(&honest_ops);
    b.check_untouched_outside(&honest_ops);
}

/// Revocation is a fence: a batch racing `revoke` either completed before
/// it returned or lands nothing after; a batch sent after it is refused.
pub async fn revoke_is_a_fence(backend: impl Backend) {
    const SIZE: usize = 64 << 20;
    let mut h = Harness::new(backend);
    let mut a = h.peer(&[SIZE]).await;
    let b = h.peer(&[SIZE]).await;
    let ops = packed_ops(&a, &b, 64, SIZE / 64);
    a.fill_sources(&ops);
    let grant = b.grant_for(&ops).await;
    let (writer, endpoint, batch_ops, batch_grant) = (Arc::clone(&a.writer), b.endpoint(), ops.clone(), grant.clone());
    let batch = tokio::spawn(async move { writer.batch_write(&endpoint, &batch_grant, &batch_ops).await });
    // Let the batch get going, then revoke in the middle of it (or after it,
    // on a fast machine: the assertions hold either way).
    tokio::task::yield_now().await;
    b.writer.revoke(&grant.id).await;
    let at_revoke: Vec<u8> = b.bufs[0].bytes().to_vec();
    let result = batch.await.unwrap();
    assert_eq!(b.bufs[0].bytes(), &at_revoke[..], "bytes landed after revoke returned (result {result:?})");
    if result.is_ok() {
        b.check_destinations(&ops);
    }
    let err = a.writer.batch_write(&b.endpoint(), &grant, &ops).await.unwrap_err();
    assert!(matches!(err, TransportError::Refused { .. }), "a batch after revoke: {err:?}");
    assert_eq!(b.bufs[0].bytes(), &at_revoke[..], "a batch after revoke wrote bytes");
}

/// `close` ends all access at once: no grant survives it, nothing is served.
pub async fn close_ends_every_grant(backend: impl Backend) {
    let mut h = Harness::new(backend);
    let mut a = h.peer(&[1 << 16]).await;
    let b = h.peer(&[1 << 16]).await;
    let ops = packed_ops(&a, &b, 4, 1024);
    a.fill_sources(&ops);
    let grant = b.grant_for(&ops).await;
    b.writer.close();
    let result = tokio::time::timeout(h.failure_bound(), a.writer.batch_write(&b.endpoint(), &grant, &ops))
        .await
        .expect("the batch did not fail within the bound");
    assert!(result.is_err(), "a closed writer accepted a batch");
    assert!(b.all_zero(), "a closed writer let bytes land");
}

/// Two ops of one batch writing the same bytes is always a sender's bug:
/// the batch is refused whole, in any op order.
pub async fn overlapping_writes_in_one_batch_are_refused_whole(backend: impl Backend) {
    let mut h = Harness::new(backend);
    let mut a = h.peer(&[1 << 16]).await;
    let b = h.peer(&[1 << 16]).await;
    let ops = [
        WriteOp { src: a.addr(0, 0), dst: b.addr(0, 8192), len: 4096 },
        WriteOp { src: a.addr(0, 4096), dst: b.addr(0, 0), len: 4096 },
        WriteOp { src: a.addr(0, 8192), dst: b.addr(0, 10240), len: 4096 },
    ];
    a.fill_sources(&ops);
    let grant = b.grant_all().await;
    let err = a.writer.batch_write(&b.endpoint(), &grant, &ops).await.unwrap_err();
    assert!(matches!(err, TransportError::Refused { .. }), "expected Refused, got {err:?}");
    assert!(b.all_zero(), "a batch with overlapping writes wrote bytes");
    write_and_check(&mut a, &b, &ops[..2]).await;
}
