//! [`Node`]: a transport with one buffer registered both as a source and as
//! a destination (a `kv_both` instance), as a transport's own tests use it.

use std::sync::Arc;
use std::time::Duration;

use kv_proto::{BatchWriter, Grant, MemoryRegion, RegionAccess, TransportError, WriteOp};

use crate::{pattern, TestBuf};

/// How long the grants of [`Node`] are valid: longer than any test waits.
pub const GRANT_VALIDITY: Duration = Duration::from_secs(60);

/// A transport and its one registered buffer. Field order matters: the
/// transport is dropped (and stops touching memory) before the buffer is
/// freed.
pub struct Node<W: BatchWriter + ?Sized> {
    /// The transport under test.
    pub transport: Arc<W>,
    /// Its memory, registered as a source and as a destination.
    pub buf: TestBuf,
}

impl<W: BatchWriter + ?Sized> Node<W> {
    /// Registers a new zeroed buffer of `len` bytes with `transport`.
    pub fn registered(transport: Arc<W>, len: usize) -> Self {
        let buf = TestBuf::new(len);
        // SAFETY: `buf` lives in the returned node, which drops the
        // transport first; tests read it only after the batches into it
        // completed or their grant was revoked.
        unsafe {
            transport.register_regions(&[buf.region()], RegionAccess::Source).unwrap();
            transport.register_regions(&[buf.region()], RegionAccess::Destination).unwrap();
        }
        Self { transport, buf }
    }

    /// A grant over `ranges` of this node's buffer, valid for [`GRANT_VALIDITY`].
    pub async fn grant(&self, ranges: &[MemoryRegion]) -> Grant {
        self.transport.grant(ranges, GRANT_VALIDITY).await.unwrap()
    }

    /// A grant over `[off, off + len)` of this node's buffer.
    pub async fn grant_range(&self, off: u64, len: u64) -> Grant {
        self.grant(&[MemoryRegion::new(self.buf.addr() + off, len)]).await
    }

    /// A grant over exactly the destinations of `ops`.
    pub async fn grant_for(&self, ops: &[WriteOp]) -> Grant {
        self.grant(&pattern::covering(ops)).await
    }

    /// A grant over this node's whole buffer.
    pub async fn grant_all(&self) -> Grant {
        self.grant(&[self.buf.region()]).await
    }
}

/// `sender` writes a patterned batch of eight 1 KiB ops into `victim`, from
/// byte `at` of its buffer on, under a fresh grant over exactly them; the
/// batch must be answered within `bound`. The grant is revoked once it is,
/// and where the batch succeeded every byte is checked. Returns how the
/// batch ended.
pub async fn write_batch<S, V>(
    sender: &mut Node<S>,
    victim: &Node<V>,
    at: usize,
    bound: Duration,
) -> Result<(), TransportError>
where
    S: BatchWriter + ?Sized,
    V: BatchWriter + ?Sized,
{
    let ops: Vec<WriteOp> = (0..8)
        .map(|k| WriteOp { src: sender.buf.at(k * 1024), dst: victim.buf.at(at + k * 1024), len: 1024 })
        .collect();
    pattern::fill(&mut sender.buf, &ops);
    let grant = victim.grant_for(&ops).await;
    let written = tokio::time::timeout(bound, sender.transport.batch_write(&victim.transport.endpoint(), &grant, &ops))
        .await
        .expect("the batch was not answered in time");
    victim.transport.revoke(&grant.id).await;
    if written.is_ok() {
        pattern::check(&victim.buf, &ops);
    }
    written
}

/// `sender` writes a batch into `victim` (from 32 KiB on, see
/// [`write_batch`]) within `bound`, and the bytes landed: the receiver
/// still serves.
pub async fn assert_still_serves<S, V>(sender: &mut Node<S>, victim: &Node<V>, bound: Duration)
where
    S: BatchWriter + ?Sized,
    V: BatchWriter + ?Sized,
{
    write_batch(sender, victim, 32 * 1024, bound).await.expect("well-behaved batch failed");
}
