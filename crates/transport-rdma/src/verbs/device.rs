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

/// Which of a port's GIDs (source addresses) the queue pairs use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GidChoice {
    /// This index of the port's GID table.
    Index(u8),
    /// The IPv4-mapped GID of this address (RoCE v2 over that interface),
    /// else the first IPv4-mapped GID of the port.
    Ipv4(std::net::Ipv4Addr),
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
        Self::open_with(Some(name), port, GidChoice::Index(gid_index))
    }

    /// The names of the devices present (none without libibverbs or a device).
    pub fn list() -> Vec<String> {
        DeviceList::new().map(|list| list.iter().map(|device| device.name()).collect()).unwrap_or_default()
    }

    /// Opens the device called `name` (the first one present if `None`) on
    /// `port`, with the source GID `gid` chooses.
    pub fn open_with(name: Option<&str>, port: u8, gid: GidChoice) -> Result<Arc<Self>, VerbsError> {
        let list = DeviceList::new().map_err(|err| VerbsError::sideway("ibv_get_device_list", err))?;
        let device = list.iter().find(|device| name.is_none_or(|name| device.name() == name)).ok_or_else(|| {
            VerbsError::NoSuchDevice {
                name: name.unwrap_or("(any)").to_owned(),
                present: list.iter().map(|device| device.name()).collect(),
            }
        })?;
        let name = device.name();
        let name = name.as_str();
        let context = device.open().map_err(|err| VerbsError::sideway("ibv_open_device", err))?;
        let attr = context.query_device().map_err(|err| VerbsError::sideway("ibv_query_device", err))?;
        let port_attr = context.query_port(port).map_err(|err| VerbsError::sideway("ibv_query_port", err))?;
        let gid_index = match gid {
            GidChoice::Index(index) => index,
            GidChoice::Ipv4(ip) => {
                let table = u32::try_from(port_attr.gid_tbl_len()).unwrap_or(0).min(256);
                let mapped = |index: u32| {
                    let raw = context.query_gid(port, index).ok()?.raw;
                    (raw[..10].iter().all(|&b| b == 0) && raw[10..12] == [0xff, 0xff]).then_some(raw)
                };
                let exact = (0..table).find(|&index| mapped(index).is_some_and(|raw| raw[12..] == ip.octets()));
                let any = || (0..table).find(|&index| mapped(index).is_some());
                let index = exact.or_else(any).ok_or_else(|| {
                    VerbsError::OutOfRange(format!("{name} port {port} has no IPv4-mapped GID (for {ip})"))
                })?;
                u8::try_from(index).unwrap_or(0)
            }
        };
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
