//! Receiving batches, as one state machine without I/O ([`BatchReceiver`]):
//! the procedure every byte-stream data plane follows from a batch's header
//! to its reply, written once, so a transport keeps only its reads, writes
//! and waits, and cannot get the order of the checks wrong.
//!
//! For each batch, in this order: the header (and, on an authenticated
//! connection, its tag, checked before the header is acted on); the header's
//! form and its op count against the bound in force; the grant's liveness
//! ([`RegisteredMemory::check_grant`]), before a byte of the op list is
//! buffered; the op list, grown in [`OpListBuffer`]'s steps, each charged to
//! the transport's op-list budget first, all of it within one deadline; the
//! op list's tag; the admission of every op against the grant
//! ([`RegisteredMemory::admit`]); the payload, moved by the transport into
//! the admitted destinations; the payload's tag, where payloads are tagged;
//! the op list's memory given back; the reply. A refused batch is answered
//! with the reason after what is left of it was read and dropped (batches
//! that share a connection: it must stay in step) or its stream stopped (a
//! stream per batch).
//!
//! The machine is driven by asking it for its next [`Step`]
//! ([`BatchReceiver::next_step`]), carrying the step out, and telling it
//! how that went ([`BatchReceiver::advance`] for most steps,
//! [`BatchReceiver::no_room`], [`BatchReceiver::deadline_passed`] and
//! [`BatchReceiver::payload_end`] for the others). Time enters as an
//! argument: the machine reads no clock, and its deadlines are `Instant`s
//! computed from the `now` it is given. It counts the refusals it decides
//! in the memory's [`crate::TransportCounters`] (as `check_grant` and
//! `admit` count theirs); the transport logs them.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use crate::budget::NoRoom;
use crate::dataplane::{decode_op, OpEntry, OpListBuffer, ReplyStatus, OP_LEN};
use crate::grant::GrantId;
use crate::registered::{DestinationError, GrantAccess, RegisteredMemory};
use crate::session::{BadTag, FrameTag, Session, StreamedFrame, FRAME_TAG_LEN};
use crate::stats::BatchRefusal;

/// What the machine reads of a batch header, whatever the wire: the fields
/// every data plane has, and those only some have (a batch id, flags).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeaderFields {
    /// The grant the batch writes under.
    pub grant: GrantId,
    /// Entries of the op list that follows.
    pub op_count: u64,
    /// Payload bytes after the op list: the sum of the ops' lengths.
    pub total_bytes: u64,
    /// The sender's id of the batch (0 where the wire has none).
    pub batch_id: u64,
    /// Whether the sender asks for an admission verdict before it sends
    /// the payload (no payload follows a refusal then).
    pub precheck: bool,
    /// Whether the receiver can read this batch at all (known flags,
    /// reserved fields zero).
    pub well_formed: bool,
}

impl HeaderFields {
    /// The fields of a header that names only the grant, the op count and
    /// the payload's length: no batch id, no flags, always well formed.
    pub fn plain(grant: GrantId, op_count: u64, total_bytes: u64) -> Self {
        Self { grant, op_count, total_bytes, batch_id: 0, precheck: false, well_formed: true }
    }
}

/// How a wire's batch header of `N` bytes reads (read whole before anything
/// is decided) into the wire's own header `H`: any bytes are a header, the
/// machine checks the values it reads of it ([`HeaderFields`]).
pub type DecodeHeader<H, const N: usize> = fn(&[u8; N]) -> H;

/// The receiver's bounds on one batch, as in force.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReceiveLimits {
    /// Most ops in one batch.
    pub max_ops: u64,
    /// The op-list budget every batch of the transport shares, bytes (for
    /// the reason of a refusal).
    pub op_list_budget: u64,
    /// One bound on receiving a batch's op list, from its header, waits for
    /// room in the budget included.
    pub op_list_timeout: Duration,
}

/// How batches travel.
#[derive(Debug)]
pub enum Framing {
    /// One batch per stream (QUIC): a refused batch's stream is stopped and
    /// the rest of it never read; the machine is done after one batch.
    StreamPerBatch,
    /// One batch after another on one connection (TCP): what is left of a
    /// refused batch is read and dropped, so the connection stays in step.
    Connection {
        /// Checks every header and op list and tags every reply, once the
        /// connection is authenticated.
        session: Option<Box<Session>>,
        /// Whether a tag follows every payload (it does only with a
        /// session): checked over the bytes as they landed.
        tagged_payloads: bool,
    },
}

/// Why the batch is refused, nothing of it written (or, for
/// [`Refusal::Revoked`], nothing after the revocation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The grant is not live, or an op is not inside it.
    Grant(DestinationError),
    /// The op list found no room in the budget.
    NoRoom(NoRoom),
    /// The grant was revoked while the payload was landing.
    Revoked {
        /// Payload bytes that had landed.
        written: u64,
        /// Payload bytes left unwritten.
        remaining: u64,
    },
}

/// Why the connection (or stream) cannot go on: the transport tells the
/// peer where its wire allows, and closes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Fault {
    /// A header or op list failed its tag.
    #[error(transparent)]
    BadTag(BadTag),
    /// A payload failed its tag: its bytes landed inside the grant, and the
    /// batch fails.
    #[error("the payload failed its authentication tag: {0}")]
    BadPayloadTag(BadTag),
    /// Unknown header flags or a non-zero reserved field.
    #[error("unknown batch flags or a non-zero reserved field")]
    Malformed,
    /// More ops than the bound in force.
    #[error("batch announces {count} ops, more than the limit of {max}")]
    TooManyOps {
        /// Ops announced.
        count: u64,
        /// The bound.
        max: u64,
    },
    /// The op list did not arrive within its deadline.
    #[error("op list not received within {after:?}")]
    OpListTimeout {
        /// The bound.
        after: Duration,
    },
    /// The ops' lengths do not add up to the header's total.
    #[error("op lengths add up to {}, the header says {declared}",
        .sum.map_or_else(|| "more than u64::MAX".to_owned(), |s| s.to_string()))]
    LengthMismatch {
        /// The header's total.
        declared: u64,
        /// The ops' sum (`None`: over `u64::MAX`).
        sum: Option<u64>,
    },
    /// The memory is closed: the transport is shutting down.
    #[error("the transport is shut down")]
    Closed,
}

/// How an admitted batch's payload ended, as the transport saw it (a read
/// that failed is the transport's own error).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PayloadEnd {
    /// Every byte landed.
    Complete,
    /// The grant was revoked (or the memory closed) with `remaining` bytes
    /// not written.
    Revoked {
        /// Payload bytes left unwritten.
        remaining: u64,
    },
}

/// A peer's op list admitted under one live grant: where one batch's
/// payload may land, and, with its [`GrantAccess`], the only way to write
/// it.
#[derive(Debug)]
pub struct AdmittedBatch {
    access: GrantAccess,
    list: Vec<OpEntry>,
    total: u64,
}

impl AdmittedBatch {
    /// Admits a peer's op list under `grant` ([`RegisteredMemory::admit`]:
    /// lengths add up to `declared`, the grant is live at `now`, every op
    /// lies inside it); on error the list is handed back with the reason.
    pub fn admit(
        memory: &RegisteredMemory,
        grant: &GrantId,
        list: Vec<OpEntry>,
        declared: u64,
        now: Instant,
    ) -> Result<Self, (Vec<OpEntry>, DestinationError)> {
        match memory.admit(grant, list.iter().map(decode_op), declared, now) {
            Ok(access) => Ok(Self { access, list, total: declared }),
            Err(e) => Err((list, e)),
        }
    }

    /// Permission to write: every raw write happens inside its `with`.
    pub fn access(&self) -> &GrantAccess {
        &self.access
    }

    /// The admitted ops, in payload order.
    pub fn entries(&self) -> &[OpEntry] {
        &self.list
    }

    /// The payload's length.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// The grant the batch writes under.
    pub fn grant(&self) -> GrantId {
        self.access.id()
    }
}

/// What the transport does next.
#[derive(Debug)]
pub enum Step<'a> {
    /// Wait for the next batch's first byte, within the idle bound (batches
    /// sharing a connection, between two batches); then
    /// [`BatchReceiver::advance`]. A peer that closes or idles ends the
    /// connection there.
    AwaitBatch,
    /// Read exactly `into.len()` bytes into `into` (`what` names them),
    /// each wait bounded as usual and, where `by` is given, all of it
    /// before `by`; then [`BatchReceiver::advance`], or
    /// [`BatchReceiver::deadline_passed`] when `by` passed first.
    Read {
        /// What is read.
        what: &'static str,
        /// Where.
        into: &'a mut [u8],
        /// The deadline of the whole op list, if this is part of it.
        by: Option<Instant>,
    },
    /// Charge `bytes` more to the op-list budget, waiting for room until
    /// `by`; then [`BatchReceiver::advance`], or [`BatchReceiver::no_room`].
    Charge {
        /// Bytes to take.
        bytes: u64,
        /// The op list's deadline.
        by: Instant,
    },
    /// The batch is refused (log it; the machine counted it): what is left
    /// of it is dropped next, then the reason is the reply. Then
    /// [`BatchReceiver::advance`].
    Refused {
        /// Why.
        refusal: &'a Refusal,
        /// The reply's reason.
        reason: &'a str,
    },
    /// Read and drop `bytes` (what is left of a refused batch); then
    /// [`BatchReceiver::advance`].
    Discard {
        /// Bytes to drop.
        bytes: u64,
    },
    /// Stop reading the batch's stream (a refused batch's rest is never
    /// read); then [`BatchReceiver::advance`].
    Stop,
    /// Move the admitted payload into `batch`'s destinations, feeding every
    /// byte as it landed to `tag` where there is one (inside the grant's
    /// fence); then [`BatchReceiver::payload_end`].
    Payload {
        /// Where the payload lands.
        batch: &'a AdmittedBatch,
        /// The payload's tag, to feed.
        tag: Option<&'a mut StreamedFrame>,
    },
    /// Give the batch's op-list memory back to the budget; then
    /// [`BatchReceiver::advance`].
    Release,
    /// Reply to the batch (on an authenticated connection, tagged with
    /// [`BatchReceiver::seal`]); then [`BatchReceiver::advance`].
    Reply {
        /// The verdict.
        status: ReplyStatus,
        /// Its reason (empty for `Ok`).
        reason: &'a str,
    },
    /// The stream's batch is done.
    Done,
    /// The connection (or stream) ends: tell the peer where the wire
    /// allows, and close.
    Fail(Fault),
}

/// A step the machine has decided on and not seen carried out yet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Planned {
    Refused,
    /// `frame`: the bytes dropped are a tagged frame, counted as skipped.
    Discard {
        bytes: u64,
        frame: bool,
    },
    Stop,
    Release,
    Reply(ReplyStatus),
}

#[derive(Debug)]
enum State {
    AwaitBatch,
    Header,
    HeaderTag,
    /// `charge > 0`: that much is to be charged before the next chunk is
    /// handed out; otherwise the current chunk is being read.
    OpList {
        buffer: OpListBuffer,
        by: Instant,
        charge: u64,
    },
    OpListTag {
        list: Vec<OpEntry>,
    },
    Payload,
    PayloadTag,
    Done,
    Failed(Fault),
}

/// The batches of one connection (or the one batch of a stream), received
/// into `memory`: see the module docs.
#[derive(Debug)]
pub struct BatchReceiver<'m, H, const N: usize> {
    memory: &'m RegisteredMemory,
    limits: ReceiveLimits,
    framing: Framing,
    state: State,
    plan: VecDeque<Planned>,
    header_bytes: [u8; N],
    decode: DecodeHeader<H, N>,
    header: Option<H>,
    fields: Option<HeaderFields>,
    tag: FrameTag,
    refusal: Option<Refusal>,
    reason: String,
    admitted: Option<AdmittedBatch>,
    payload_tag: Option<StreamedFrame>,
}

impl<'m, H: Copy + Into<HeaderFields>, const N: usize> BatchReceiver<'m, H, N> {
    /// A receiver of batches into `memory` under `limits`, whose headers
    /// read as `decode` says; it starts by waiting for a batch (a
    /// connection) or reading its header (a stream).
    pub fn new(
        memory: &'m RegisteredMemory,
        limits: ReceiveLimits,
        framing: Framing,
        decode: DecodeHeader<H, N>,
    ) -> Self {
        let state = match framing {
            Framing::StreamPerBatch => State::Header,
            Framing::Connection { .. } => State::AwaitBatch,
        };
        Self {
            memory,
            limits,
            framing,
            state,
            plan: VecDeque::new(),
            header_bytes: [0; N],
            decode,
            header: None,
            fields: None,
            tag: [0u8; FRAME_TAG_LEN],
            refusal: None,
            reason: String::new(),
            admitted: None,
            payload_tag: None,
        }
    }

    /// The header of the batch in progress (or the last one), once read and
    /// its tag checked.
    pub fn header(&self) -> Option<&H> {
        self.header.as_ref()
    }

    /// The tag of the next frame this end sends (a reply, or a report of a
    /// fault), on an authenticated connection; counts it.
    pub fn seal(&mut self, frame: &[u8]) -> Option<FrameTag> {
        self.session().map(|session| session.send.seal(&[frame]))
    }

    fn session(&mut self) -> Option<&mut Session> {
        match &mut self.framing {
            Framing::Connection { session, .. } => session.as_deref_mut(),
            Framing::StreamPerBatch => None,
        }
    }

    fn tagged_payloads(&self) -> bool {
        matches!(&self.framing, Framing::Connection { session: Some(_), tagged_payloads: true })
    }

    /// What follows a batch: the next one on a connection, nothing on a
    /// stream.
    fn after_batch(&self) -> State {
        match self.framing {
            Framing::StreamPerBatch => State::Done,
            Framing::Connection { .. } => State::AwaitBatch,
        }
    }

    /// What the transport does next (the same step until it is reported
    /// carried out).
    pub fn next_step(&mut self) -> Step<'_> {
        if let Some(&planned) = self.plan.front() {
            return match planned {
                Planned::Refused => match &self.refusal {
                    Some(refusal) => Step::Refused { refusal, reason: &self.reason },
                    None => Step::Release,
                },
                Planned::Discard { bytes, .. } => Step::Discard { bytes },
                Planned::Stop => Step::Stop,
                Planned::Release => Step::Release,
                Planned::Reply(status) => Step::Reply { status, reason: &self.reason },
            };
        }
        let Self { state, header_bytes, tag, admitted, payload_tag, .. } = self;
        match state {
            State::AwaitBatch => Step::AwaitBatch,
            State::Header => Step::Read { what: "batch header", into: &mut header_bytes[..], by: None },
            State::HeaderTag => Step::Read { what: "batch header tag", into: &mut tag[..], by: None },
            State::OpList { charge, by, .. } if *charge > 0 => Step::Charge { bytes: *charge, by: *by },
            State::OpList { buffer, by, .. } => {
                Step::Read { what: "op list", into: buffer.current_chunk(), by: Some(*by) }
            }
            State::OpListTag { .. } => Step::Read { what: "op list tag", into: &mut tag[..], by: None },
            State::Payload => match admitted {
                Some(batch) => Step::Payload { batch, tag: payload_tag.as_mut() },
                None => Step::Fail(Fault::Closed),
            },
            State::PayloadTag => Step::Read { what: "payload tag", into: &mut tag[..], by: None },
            State::Done => Step::Done,
            State::Failed(fault) => Step::Fail(*fault),
        }
    }

    /// The step [`BatchReceiver::next_step`] gave was carried out (for a
    /// [`Step::Read`], its bytes are in place; for a [`Step::Charge`], the
    /// budget was charged), at `now`.
    pub fn advance(&mut self, now: Instant) {
        if let Some(done) = self.plan.pop_front() {
            if let Planned::Discard { frame: true, .. } = done {
                if let Some(session) = self.session() {
                    // Dropped unread: its tag does not matter, and the next
                    // frame is checked under the next number.
                    session.recv.skip();
                }
            }
            return;
        }
        let state = std::mem::replace(&mut self.state, State::Done);
        self.state = match state {
            State::AwaitBatch => {
                self.header = None;
                self.fields = None;
                State::Header
            }
            State::Header if self.session().is_some() => State::HeaderTag,
            State::Header => self.on_header(now),
            State::HeaderTag => match open(&mut self.framing, &[&self.header_bytes[..]], &self.tag) {
                Ok(()) => self.on_header(now),
                Err(bad) => self.tag_failed(Fault::BadTag(bad)),
            },
            State::OpList { mut buffer, by, charge } => {
                if charge > 0 {
                    // Charged: the chunk is handed out, to be read.
                    buffer.next_chunk();
                    State::OpList { buffer, by, charge: 0 }
                } else {
                    self.op_list_step(buffer, by, now)
                }
            }
            State::OpListTag { list } => match open(&mut self.framing, &[list.as_flattened()], &self.tag) {
                Ok(()) => self.admit(list, now),
                Err(bad) => self.tag_failed(Fault::BadTag(bad)),
            },
            State::PayloadTag => {
                self.plan.push_back(Planned::Release);
                let (frame, tag) = (self.payload_tag.take(), self.tag);
                let opened = match (frame, self.session()) {
                    (Some(frame), Some(session)) => session.recv.open_streamed(frame, &tag),
                    _ => Err(BadTag { seq: 0 }),
                };
                match opened {
                    Ok(()) => {
                        self.reply_ok();
                        self.after_batch()
                    }
                    Err(bad) => self.tag_failed(Fault::BadPayloadTag(bad)),
                }
            }
            // These end with another call, or not at all.
            other @ (State::Payload | State::Done | State::Failed(_)) => other,
        };
    }

    /// The budget had no room for the op list ([`Step::Charge`]): the batch
    /// is refused, counted as [`BatchRefusal::OpBudget`].
    pub fn no_room(&mut self, no_room: NoRoom) {
        let State::OpList { charge, .. } = &self.state else { return };
        if *charge == 0 {
            return;
        }
        let State::OpList { buffer, .. } = std::mem::replace(&mut self.state, State::Done) else { return };
        let unread = buffer.count() - buffer.filled();
        drop(buffer);
        // The budget is the transport's, not the memory's: counted here.
        self.memory.counters().refused(BatchRefusal::OpBudget);
        self.plan.push_back(Planned::Release);
        self.state = self.refuse(Refusal::NoRoom(no_room), Some(unread), None);
    }

    /// The deadline of a [`Step::Read`] passed first: the op list did not
    /// arrive in time, a fault.
    pub fn deadline_passed(&mut self) {
        if let State::OpList { charge: 0, .. } = self.state {
            self.state = State::Failed(Fault::OpListTimeout { after: self.limits.op_list_timeout });
        }
    }

    /// How the admitted payload ([`Step::Payload`]) ended; the transport has
    /// let go of the batch's destinations.
    pub fn payload_end(&mut self, end: PayloadEnd) {
        if !matches!(self.state, State::Payload) {
            return;
        }
        let total = self.admitted.take().map_or(0, |batch| batch.total());
        self.state = match end {
            PayloadEnd::Complete if self.payload_tag.is_some() => State::PayloadTag,
            PayloadEnd::Complete => {
                self.plan.push_back(Planned::Release);
                self.reply_ok();
                self.after_batch()
            }
            PayloadEnd::Revoked { remaining } => {
                // Admitted, then fenced mid-payload: `admit` counted
                // nothing, so the refusal is counted here.
                self.plan.push_back(Planned::Release);
                if self.memory.is_closed() {
                    self.memory.counters().refused(BatchRefusal::Closed);
                    State::Failed(Fault::Closed)
                } else {
                    self.memory.counters().refused(BatchRefusal::UnknownGrant);
                    let remaining = remaining.min(total);
                    let tagged = self.payload_tag.take().is_some();
                    let refusal = Refusal::Revoked { written: total - remaining, remaining };
                    self.refuse(refusal, None, Some((remaining, tagged)))
                }
            }
        };
    }

    /// A frame failed its tag: counted, and the connection ends.
    fn tag_failed(&self, fault: Fault) -> State {
        self.memory.counters().tag_failed();
        State::Failed(fault)
    }

    fn reply_ok(&mut self) {
        self.reason.clear();
        self.plan.push_back(Planned::Reply(ReplyStatus::Ok));
    }

    /// A header was read (and its tag checked): its form, its op count and
    /// its grant decide whether its op list is read.
    fn on_header(&mut self, now: Instant) -> State {
        let header = (self.decode)(&self.header_bytes);
        let fields: HeaderFields = header.into();
        let HeaderFields { well_formed, op_count: count, grant, .. } = fields;
        self.header = Some(header);
        self.fields = Some(fields);
        self.refusal = None;
        self.reason.clear();
        if !well_formed {
            return State::Failed(Fault::Malformed);
        }
        let max = self.limits.max_ops;
        let Some(buffer) = OpListBuffer::within(count, max) else {
            return State::Failed(Fault::TooManyOps { count, max });
        };
        // A batch for a grant that is not live is refused before its op
        // list is buffered.
        match self.memory.check_grant(&grant, now) {
            Ok(()) => {}
            Err(DestinationError::Closed) => return State::Failed(Fault::Closed),
            Err(refusal) => return self.refuse(Refusal::Grant(refusal), Some(buffer.count()), None),
        }
        let by = now.checked_add(self.limits.op_list_timeout).unwrap_or(now);
        self.op_list_step(buffer, by, now)
    }

    /// The op list's next step: charge the next growth, or hand out the
    /// next chunk to read, or, once it is whole, its tag or its admission.
    fn op_list_step(&mut self, mut buffer: OpListBuffer, by: Instant, now: Instant) -> State {
        if buffer.is_complete() {
            let list = buffer.into_entries();
            return if self.session().is_some() { State::OpListTag { list } } else { self.admit(list, now) };
        }
        let charge = buffer.growth();
        if charge == 0 {
            buffer.next_chunk();
        }
        State::OpList { buffer, by, charge }
    }

    /// The grant check: every op inside the named, live grant, before a
    /// payload byte is read.
    fn admit(&mut self, list: Vec<OpEntry>, now: Instant) -> State {
        let Some((grant, total, precheck, batch_id)) =
            self.fields.as_ref().map(|h| (h.grant, h.total_bytes, h.precheck, h.batch_id))
        else {
            return State::Failed(Fault::Closed);
        };
        match AdmittedBatch::admit(self.memory, &grant, list, total, now) {
            Ok(batch) => {
                self.admitted = Some(batch);
                if self.tagged_payloads() {
                    self.payload_tag = self.session().map(|session| session.recv.begin_streamed(batch_id));
                }
                if precheck {
                    self.reply_ok();
                }
                State::Payload
            }
            Err((_, DestinationError::LengthMismatch { declared, sum })) => {
                State::Failed(Fault::LengthMismatch { declared, sum })
            }
            Err((_, DestinationError::Closed)) => State::Failed(Fault::Closed),
            Err((list, refusal)) => {
                drop(list);
                self.plan.push_back(Planned::Release);
                self.refuse(Refusal::Grant(refusal), None, None)
            }
        }
    }

    /// Plans a refusal: the reason, then what is left of the batch dropped
    /// (`unread_ops` entries of its op list and their tag; its payload,
    /// `payload` bytes and whether a tag follows them, or all of it unless
    /// the sender asked first), then the reply.
    fn refuse(&mut self, refusal: Refusal, unread_ops: Option<usize>, payload: Option<(u64, bool)>) -> State {
        let Some((grant, ops, total, precheck)) =
            self.fields.as_ref().map(|h| (h.grant, h.op_count, h.total_bytes, h.precheck))
        else {
            return State::Failed(Fault::Closed);
        };
        self.reason = match refusal {
            Refusal::Grant(error) => error.to_string(),
            Refusal::NoRoom(no_room) => no_room.reason(ops, self.limits.op_list_budget, self.limits.op_list_timeout),
            Refusal::Revoked { .. } => format!("grant {grant} was revoked during the batch"),
        };
        self.refusal = Some(refusal);
        self.plan.push_back(Planned::Refused);
        let tagged_payloads = self.tagged_payloads();
        let connection = match &self.framing {
            Framing::StreamPerBatch => None,
            Framing::Connection { session, .. } => Some(session.is_some()),
        };
        match connection {
            None => self.plan.push_back(Planned::Stop),
            Some(authenticated) => {
                if let Some(unread) = unread_ops {
                    self.discard((unread as u64).saturating_mul(OP_LEN as u64), false);
                    if authenticated {
                        self.discard(FRAME_TAG_LEN as u64, true);
                    }
                }
                let (bytes, tagged) = payload.unwrap_or(if precheck { (0, false) } else { (total, tagged_payloads) });
                self.discard(bytes, false);
                if tagged {
                    self.discard(FRAME_TAG_LEN as u64, true);
                }
            }
        }
        self.plan.push_back(Planned::Reply(ReplyStatus::Refused));
        self.after_batch()
    }

    fn discard(&mut self, bytes: u64, frame: bool) {
        if bytes > 0 {
            self.plan.push_back(Planned::Discard { bytes, frame });
        }
    }
}

/// Checks `tag` as the next frame received on an authenticated connection
/// (nothing to check otherwise).
fn open(framing: &mut Framing, parts: &[&[u8]], tag: &FrameTag) -> Result<(), BadTag> {
    match framing {
        Framing::Connection { session: Some(session), .. } => session.recv.open(parts, tag),
        _ => Ok(()),
    }
}
