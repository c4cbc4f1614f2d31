//! The worker metrics of `kvlink serve --metrics` and `kvlink bench
//! --metrics`: a [`MetricsHub`] of the process's workers (what shut-down
//! workers counted kept), rendered as the Prometheus text format at scrape
//! time ([`Exposition`]) and served on a bounded HTTP endpoint
//! ([`MetricsEndpoint`]); and the bench's check of its own totals against
//! its workers' ([`agreement`]).

pub mod agreement;
mod exposition;
mod http;
mod hub;
mod request;
mod totals;

pub use exposition::{Exposition, RenderError, CONTENT_TYPE};
pub use http::{
    EndpointError, MetricsEndpoint, RunningEndpoint, CONNECTION_DEADLINE, LINGER, MAX_CONNECTIONS,
    MAX_CONNECTIONS_PER_HOST, MAX_REQUEST_BYTES,
};
pub use hub::{Exposed, MetricsHub, WorkerLabels};
