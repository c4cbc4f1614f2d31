//! An opened RDMA device, one of its ports and one GID of that port.

use std::sync::Arc;

use sideway::ibverbs::device::{DeviceInfo, DeviceList};
use sideway::ibverbs::device_context::{DeviceContext, Mtu};

use super::VerbsError;

/// What the device allows, read once at open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceLimits {
    /// Scatter-gather entries per send work request.
    pub max_sge: u32,
    /// Work requests per queue.
    pub max_qp_wr: u32,
    /// Entries per completion queue.
    pub max_cqe: u32,
    /// Bytes per message (per RDMA WRITE work request), from the port.
    pub max_msg_bytes: u32,
    /// Memory windows (0: none).
    pub max_mw: u32,
}

/// An opened device, bound to one port and one source GID.
pub struct Device {
    context: Arc<DeviceContext>,
    name: String,
    port: u8,
    gid_index: u8,
    gid: [u8; 16],
    active_mtu: Mtu,
    limits: DeviceLimits,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device")
            .field("name", &self.name)
            .field("port", &self.port)
            .field("gid_index", &self.gid_index)
            .field("limits", &self.limits)
            .finish_non_exhaustive()
    }
}

impl Device {
    /// Opens the device called `name` and reads `port`'s GID at `gid_index`
    /// (for RoCE, the index of the address the queue pairs will use).
    pub fn open(name: &str, port: u8, gid_index: u8) -> Result<Arc<Self>, VerbsError> {
        let list = DeviceList::new().map_err(|err| VerbsError::sideway("ibv_get_device_list", err))?;
        let device = list.iter().find(|device| device.name() == name).ok_or_else(|| VerbsError::NoSuchDevice {
            name: name.to_owned(),
            present: list.iter().map(|device| device.name()).collect(),
        })?;
        let context = device.open().map_err(|err| VerbsError::sideway("ibv_open_device", err))?;
        let attr = context.query_device().map_err(|err| VerbsError::sideway("ibv_query_device", err))?;
        let port_attr = context.query_port(port).map_err(|err| VerbsError::sideway("ibv_query_port", err))?;
        let gid =
            context.query_gid(port, u32::from(gid_index)).map_err(|err| VerbsError::sideway("ibv_query_gid", err))?;
        let count = |value: i32| u32::try_from(value).unwrap_or(0);
        let limits = DeviceLimits {
            max_sge: count(attr.max_sge()),
            max_qp_wr: count(attr.max_qp_wr()),
            max_cqe: count(attr.max_cqe()),
            max_msg_bytes: port_attr.attr.max_msg_sz,
            max_mw: count(attr.max_mw()),
        };
        tracing::debug!(device = name, port, gid_index, ?limits, "rdma device opened");
        Ok(Arc::new(Self {
            context,
            name: name.to_owned(),
            port,
            gid_index,
            gid: gid.raw,
            active_mtu: port_attr.active_mtu(),
            limits,
        }))
    }

    /// The device's name (e.g. `rxe0`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The port the queue pairs use.
    pub fn port(&self) -> u8 {
        self.port
    }

    /// Index of the source GID.
    pub fn gid_index(&self) -> u8 {
        self.gid_index
    }

    /// The source GID (what a peer puts in its address vector).
    pub fn gid(&self) -> [u8; 16] {
        self.gid
    }

    /// What the device allows.
    pub fn limits(&self) -> DeviceLimits {
        self.limits
    }

    pub(super) fn active_mtu(&self) -> Mtu {
        self.active_mtu
    }

    pub(super) fn context(&self) -> &Arc<DeviceContext> {
        &self.context
    }
}
