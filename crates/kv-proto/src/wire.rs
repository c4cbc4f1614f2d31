//! Side-channel messages between a decode worker (client) and a prefill
//! worker (server).
//!
//! A connection opens with [`Hello`] from D and a [`HelloReply`] from P that
//! checks what must agree before any request is served (when P requires a
//! shared secret, a challenge and [`SideMessage::AuthProof`] come between,
//! see [`crate::auth`]); then D sends
//! [`XferRequest`]s and P answers each with an [`XferReply`] carrying one
//! outcome per request, matched by `xfer_id` (replies may come out of order).
//! Between pulls D renews P's hold on the requests it still means to pull
//! with [`KeepAlive`] (no reply), so P can keep a finished request's blocks
//! on a short lease instead of the whole abort timeout.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::cause::FailureCause;
use crate::grant::Grant;
use crate::identity::ModelIdentity;
use crate::ids::{BlockId, EngineId, ReqId};
use crate::renewal_key::RenewalKey;
use crate::topology::{HeadRange, RankTopology, TokenLayout};
use crate::writer::{Endpoint, Protocol};

/// How a KV cache is laid out in registered regions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum LayoutKind {
    /// Separate K and V regions per layer (the reference's `split_k_and_v`).
    SplitKv,
    /// One region per layer holding K and V together in each block.
    Fused,
    /// One region per layer holding MLA's compressed latent.
    Mla,
    /// One region per layer whose blocks hold, for each head and token, one
    /// row of K then V (vLLM's later `(blocks, heads, block_size, 2 x
    /// head_size)`): heads and tokens map as whole rows; K and V are never
    /// apart, so it maps only to a peer laid out the same way.
    FusedRows,
}

/// The shape of a registered KV cache that P and D must agree on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct CacheLayout {
    /// How layers map to regions.
    pub kind: LayoutKind,
    /// Number of registered regions (layers, times two for `SplitKv`).
    pub region_count: u32,
    /// Bytes of one block in one region.
    pub block_len: u64,
    /// Tokens per block.
    pub block_tokens: u32,
    /// Bytes per element (2 for bf16); 0 when the engine did not declare it.
    pub dtype_bytes: u32,
    /// How tokens and heads are ordered in a block's K, V or latent plane
    /// (undeclared: blocks are only ever copied whole).
    pub token_layout: TokenLayout,
    /// KV heads in one block (MLA: 1); 0 when undeclared.
    pub block_heads: u32,
}

impl CacheLayout {
    /// What differs between this layout (`ours`, named `our_name`) and a
    /// peer's, each difference naming both values; empty when they agree.
    /// An undeclared dtype (0), token layout or head count on either side is
    /// not compared.
    pub fn mismatches(&self, our_name: &str, theirs: &CacheLayout, their_name: &str) -> Vec<String> {
        let mut out = Vec::new();
        let mut differ = |what: &str, ours: String, other: String| {
            if ours != other {
                out.push(format!("{what}: {our_name} has {ours}, {their_name} has {other}"));
            }
        };
        differ("K/V layout", format!("{:?}", self.kind), format!("{:?}", theirs.kind));
        differ("region count", self.region_count.to_string(), theirs.region_count.to_string());
        differ("bytes per block", self.block_len.to_string(), theirs.block_len.to_string());
        differ("tokens per block", self.block_tokens.to_string(), theirs.block_tokens.to_string());
        if self.dtype_bytes != 0 && theirs.dtype_bytes != 0 {
            differ("bytes per element", self.dtype_bytes.to_string(), theirs.dtype_bytes.to_string());
        }
        if self.token_layout != TokenLayout::Undeclared && theirs.token_layout != TokenLayout::Undeclared {
            differ("token layout", self.token_layout.to_string(), theirs.token_layout.to_string());
        }
        if self.block_heads != 0 && theirs.block_heads != 0 {
            differ("heads per block", self.block_heads.to_string(), theirs.block_heads.to_string());
        }
        out
    }
}

/// First message on a side-channel connection, from D.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    /// Fresh random value P's authentication proof must cover (see
    /// [`crate::auth`]); unused when P requires no authentication.
    pub client_nonce: crate::auth::Nonce,
    /// D's engine id.
    pub engine_id: EngineId,
    /// D's data-plane transport.
    pub protocol: Protocol,
    /// D's cache layout.
    pub layout: CacheLayout,
    /// D's model, KV storage, topology and versions.
    pub identity: ModelIdentity,
    /// Where this decode worker sits in its instance, and the heads it holds.
    pub topology: RankTopology,
}

impl Hello {
    /// The hello's encoding, bound into both side-channel proofs (see
    /// [`crate::auth::Transcript::context`]) so that it cannot be swapped.
    pub fn auth_context(&self) -> Vec<u8> {
        let mut out = Vec::new();
        // A hello always encodes (plain fields); an empty context on a
        // failure would still bind channel, roles and nonces.
        let _ = crate::codec::encode_into(self, &mut out);
        out
    }
}

/// P's answer to [`Hello`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum HelloReply {
    /// Everything agrees; requests may follow.
    Accepted {
        /// P's engine id.
        engine_id: EngineId,
        /// P closes a connection idle this long (no transfer request in
        /// progress); D retires its connection before that.
        idle_timeout: Duration,
        /// How long one [`KeepAlive`] holds a request on P (zero: P wants
        /// none). D renews each request it still means to pull well within
        /// it; a request it stops renewing is freed when this runs out,
        /// never later than P's abort timeout after it finished.
        lease_renewal: Duration,
        /// Where this prefill worker sits in its instance: D learns from
        /// it which of P's workers hold its heads.
        topology: RankTopology,
        /// This prefill worker's cache layout: D learns from it whether
        /// blocks copy whole or heads and tokens must be mapped.
        layout: CacheLayout,
    },
    /// P requires the shared secret: it proves it knows it, and D must
    /// answer with [`SideMessage::AuthProof`] before anything else.
    Challenge {
        /// Fresh random value D's proof must cover.
        server_nonce: crate::auth::Nonce,
        /// [`crate::auth::server_proof`] over both nonces.
        server_proof: crate::auth::Proof,
    },
    /// Something disagrees; the reason names both values. P closes the
    /// connection after sending it.
    Rejected {
        /// What disagrees (at most [`crate::MAX_TEXT_LEN`] bytes).
        #[serde(deserialize_with = "crate::bounded::text")]
        reason: String,
    },
}

/// The blocks one request's KV must land in on D.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestBlocks {
    /// The request, as P names it (P's `remote_request_id`, not D's id).
    pub req_id: ReqId,
    /// D's own id of the request (for P's logs, so one request can be
    /// followed in both instances' logs); `None` if D does not say.
    pub decode_req_id: Option<ReqId>,
    /// The prefill engine D means (P's `remote_engine_id`); P refuses the
    /// request if it is another engine's. `None` when D's params named none.
    pub prefill_engine_id: Option<EngineId>,
    /// D's blocks, in prompt order; may be shorter than P's (partial prefix
    /// hit: P sends its last blocks) or empty (P only frees). At most
    /// [`crate::MAX_BLOCKS_PER_REQUEST`].
    #[serde(deserialize_with = "crate::bounded::vec::<_, _, { crate::bounded::MAX_BLOCKS_PER_REQUEST }>")]
    pub block_ids: Vec<BlockId>,
    /// The prompt token D's blocks start from (what D's prefix cache
    /// already held); `None`: D's blocks are the last of P's, block for
    /// block (then both sides' blocks must hold as many tokens).
    pub first_token: Option<u64>,
    /// Named by a router-made transfer id (the bootstrap flow), where D may
    /// ask before P has even seen the request: P holds a pull for a request
    /// it does not know yet, within its own bound and D's wait budget,
    /// instead of refusing it at once.
    pub may_precede_prefill: bool,
}

/// D asks P to write requests' KV into D's memory (the reference's
/// `MooncakeAgentMetadata`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct XferRequest {
    /// Chosen by D, echoed in the reply.
    pub xfer_id: u64,
    /// D's data-plane endpoint.
    pub endpoint: Endpoint,
    /// The grant D issued for exactly these requests' blocks: every batch P
    /// writes names it, and D revokes it when the pull ends.
    pub grant: Grant,
    /// How long D waits for the reply, from when it sent this request. P
    /// does not start writing once this has passed (D will have revoked the
    /// grant and reported the blocks failed).
    pub wait_budget: Duration,
    /// Base address of each of D's regions, in registration order (at most
    /// [`crate::MAX_REGIONS`]).
    #[serde(deserialize_with = "crate::bounded::vec::<_, _, { crate::bounded::MAX_REGIONS }>")]
    pub region_base_addrs: Vec<u64>,
    /// The requests and their D blocks (at most [`crate::MAX_REQUESTS_PER_TRANSFER`]).
    #[serde(deserialize_with = "crate::bounded::vec::<_, _, { crate::bounded::MAX_REQUESTS_PER_TRANSFER }>")]
    pub requests: Vec<RequestBlocks>,
    /// `None`: P copies its blocks whole (both caches are laid out alike).
    /// Otherwise the model's KV heads P writes, each head row into its
    /// place in D's blocks, mapped by token (empty: P writes nothing and
    /// only releases the requests; another of P's workers sends the KV).
    pub heads: Option<HeadRange>,
    /// D's progress pieces: with `n > 0`, P writes each request in pieces
    /// of at most `n` of D's blocks, in D's order, says after each one that
    /// it landed ([`XferProgress`]), and says each request's outcome as soon
    /// as it is known; a decode that stages copies each landed piece on
    /// while the rest is on the wire. 0: no progress messages. With
    /// [`XferRequest::heads`], a piece is still counted in D's blocks: P
    /// writes its heads of the tokens those blocks hold (a D pulling a
    /// request in parts copies a block on only once every part landed it).
    pub piece_blocks: u32,
}

/// P → D, while a transfer request is served (only when D asked for
/// pieces, [`XferRequest::piece_blocks`]): how far one request got. The
/// reply still carries every outcome; where the two differ, the first one
/// P said wins.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct XferProgress {
    /// The transfer request's `xfer_id`.
    pub xfer_id: u64,
    /// The request, as P names it (the [`RequestBlocks::req_id`] D sent).
    pub req_id: ReqId,
    /// The first `landed` of D's blocks of it (in the order D listed
    /// them) are in D's memory: written with remote completion, and never
    /// written again by this transfer (with [`XferRequest::heads`]: the
    /// heads it asks for, of the tokens P holds).
    pub landed: u32,
    /// Its outcome, once known (P writes nothing more of it then).
    pub outcome: Option<Outcome>,
}

/// D → P, no reply: D still means to pull these requests (it has seen them
/// and not yet sent their transfer request). P holds each one another
/// [`HelloReply::Accepted::lease_renewal`] from now, capped by its abort
/// timeout; a request P does not hold, or named without its renewal key,
/// is ignored.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeepAlive {
    /// The requests (at most [`crate::MAX_REQUESTS_PER_TRANSFER`]).
    #[serde(deserialize_with = "crate::bounded::vec::<_, _, { crate::bounded::MAX_REQUESTS_PER_TRANSFER }>")]
    pub renewals: Vec<Renewing>,
}

/// One request of a [`KeepAlive`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Renewing {
    /// The request, as P names it.
    pub req_id: ReqId,
    /// Its renewal key, from the request's params ([`RenewalKey`]).
    pub key: RenewalKey,
}

/// What happened to one request of an [`XferRequest`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Outcome {
    /// Every byte of the requested blocks is in D's memory (or none was
    /// asked for) and P has released the request.
    Done,
    /// The KV was not (entirely) written; D must treat the blocks as lost.
    Failed {
        /// Why, as one of the causes failures are counted under.
        cause: FailureCause,
        /// Why, for logs (at most [`crate::MAX_TEXT_LEN`] bytes).
        #[serde(deserialize_with = "crate::bounded::text")]
        reason: String,
    },
}

/// One request's outcome.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestOutcome {
    /// The request, as P names it (the [`RequestBlocks::req_id`] D sent).
    pub req_id: ReqId,
    /// What happened.
    pub outcome: Outcome,
}

/// P's answer to an [`XferRequest`]: one outcome per request, never a bare "done".
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct XferReply {
    /// The request's `xfer_id`.
    pub xfer_id: u64,
    /// One entry per request of the transfer request.
    #[serde(deserialize_with = "crate::bounded::vec::<_, _, { crate::bounded::MAX_REQUESTS_PER_TRANSFER }>")]
    pub outcomes: Vec<RequestOutcome>,
}

/// Every message of the side channel.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum SideMessage {
    /// D → P, first.
    Hello(Hello),
    /// P → D, answer to `Hello` (and, after a challenge, to `AuthProof`).
    HelloReply(HelloReply),
    /// D → P.
    XferRequest(XferRequest),
    /// P → D.
    XferReply(XferReply),
    /// D → P, answer to [`HelloReply::Challenge`]: [`crate::auth::client_proof`].
    AuthProof(crate::auth::Proof),
    /// P → D, instead of an [`XferReply`]: the transfer request is refused
    /// whole (e.g. its reply could not fit in a frame); nothing was written
    /// and every request of it has failed.
    XferRefused {
        /// The request's `xfer_id`.
        xfer_id: u64,
        /// Why (at most [`crate::MAX_TEXT_LEN`] bytes).
        #[serde(deserialize_with = "crate::bounded::text")]
        reason: String,
    },
    /// D → P: renews P's hold on requests D still means to pull.
    KeepAlive(KeepAlive),
    /// P → D: how far one request of a transfer request got, before the reply.
    XferProgress(XferProgress),
}

impl XferRequest {
    /// The most bytes this request's [`XferReply`] can take once encoded
    /// (every request failed with a reason of the longest length), so a
    /// server can refuse a request whose reply would not fit in a frame
    /// before doing any work for it.
    pub fn reply_bound(&self) -> usize {
        // xfer_id, vector length, and per outcome: id length prefix, enum
        // tag, reason length prefix (varints of at most 9 bytes each).
        const FIXED: usize = 9 + 9;
        const PER_OUTCOME: usize = 9 + 1 + 9 + crate::bounded::MAX_TEXT_LEN;
        self.requests.iter().fold(FIXED, |sum, r| sum.saturating_add(PER_OUTCOME + r.req_id.as_str().len()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_mismatches_name_both_values() {
        let ours = CacheLayout {
            kind: LayoutKind::SplitKv,
            region_count: 64,
            block_len: 32768,
            block_tokens: 16,
            dtype_bytes: 2,
            token_layout: TokenLayout::Nhd,
            block_heads: 8,
        };
        assert!(ours.mismatches("p", &ours, "d").is_empty());
        let theirs = CacheLayout { kind: LayoutKind::Fused, block_tokens: 32, dtype_bytes: 1, ..ours };
        let found = ours.mismatches("p", &theirs, "d");
        assert_eq!(
            found,
            [
                "K/V layout: p has SplitKv, d has Fused",
                "tokens per block: p has 16, d has 32",
                "bytes per element: p has 2, d has 1"
            ]
        );
        let undeclared = CacheLayout { dtype_bytes: 0, token_layout: TokenLayout::Undeclared, block_heads: 0, ..ours };
        assert!(ours.mismatches("p", &undeclared, "d").is_empty(), "undeclared fields are not compared");
        let hnd = CacheLayout { token_layout: TokenLayout::Hnd, block_heads: 4, ..ours };
        assert_eq!(
            ours.mismatches("p", &hnd, "d"),
            ["token layout: p has NHD, d has HND", "heads per block: p has 8, d has 4"]
        );
    }
}
