//! The physical model: nodes, racks, zones and their links as max-min resources, the
//! registry and the shared cache; and reading layer sizes from an OCI layout.

use std::path::Path;

use swarm::Topology;

use crate::flow::{FlowPath, ResId};
use crate::scenario::{Layer, Scenario, Transport};
use crate::Error;

/// Where a flow's bytes come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Origin {
    Registry,
    Cache,
    Node(u32),
}

pub struct Network {
    pub caps: Vec<f64>,
    pub nodes: usize,
    rack_of: Vec<u32>,
    zone_of_rack: Vec<u32>,
    racks: usize,
    zones: usize,
    has_racks: bool,
    has_zones: bool,
    pub per_connection: f64,
    pub topology: Vec<Topology>,
    /// The shared-host resource, when modelled.
    host: Option<ResId>,
    /// First of the per-node upload token buckets (P2P with `starling.upload_limit`).
    upload_buckets: Option<ResId>,
    /// The link the agent's piece-size rule plans for (bytes/s): the tighter of its
    /// limits, or the NIC when it has none.
    pub link_rate: u64,
}

const REGISTRY: ResId = 0;
const CACHE: ResId = 1;

impl Network {
    /// Resources: registry egress, cache egress, per node up and down, per rack up and
    /// down, per zone up and down, the shared host, per node upload bucket.
    /// `transport` decides whether Starling's own limits apply.
    pub fn build(sc: &Scenario, transport: Transport) -> Self {
        let n = sc.cluster_nodes();
        let c = &sc.cluster;
        let per_rack = if c.nodes_per_rack == 0 {
            n.max(1)
        } else {
            c.nodes_per_rack
        };
        let racks = n.div_ceil(per_rack).max(1);
        let per_zone = if c.racks_per_zone == 0 {
            racks
        } else {
            c.racks_per_zone
        };
        let zones = racks.div_ceil(per_zone).max(1);
        let up = c.nic_up.0;
        let mut down = c.nic_down.0;
        if let Some(d) = c.disk_write {
            down = down.min(d.0);
        }
        // The holder paces what it writes into the socket with its upload bucket
        // (serve.rs `send_piece`), so that limit is a stage of its own (a stream's
        // writer, see `upload_bucket`), not part of the network path. The download
        // bucket paces what the receiver reads (p2p/conn/receive.rs) and the source's registry
        // stream: it is part of the node's downlink.
        let p2p = transport == Transport::P2p;
        let upload_limit = sc.starling.upload_limit.filter(|_| p2p);
        if p2p {
            if let Some(l) = sc.starling.download_limit {
                down = down.min(l.0);
            }
        }
        let mut caps = vec![sc.registry.egress.0, sc.cache.egress.0];
        caps.extend(std::iter::repeat_n(up, n));
        caps.extend(std::iter::repeat_n(down, n));
        let rack = c.rack_uplink.map_or(f64::INFINITY, |r| r.0);
        let zone = c.zone_uplink.map_or(f64::INFINITY, |r| r.0);
        caps.extend(std::iter::repeat_n(rack, 2 * racks));
        caps.extend(std::iter::repeat_n(zone, 2 * zones));
        let host = c.shared_host.map(|h| {
            caps.push(h.0);
            (caps.len() - 1) as ResId
        });
        let upload_buckets = upload_limit.map(|l| {
            let first = caps.len() as ResId;
            caps.extend(std::iter::repeat_n(l.0, n));
            first
        });
        // As `P2p::from_config`: both limits → the smaller, one → that one; none →
        // the NIC (the agent itself assumes 10 Gbit/s then: see the scenario docs).
        let st = &sc.starling;
        let link_rate = match (st.upload_limit, st.download_limit) {
            (Some(a), Some(b)) => a.0.min(b.0),
            (Some(a), None) | (None, Some(a)) => a.0,
            (None, None) => c.nic_up.0.min(c.nic_down.0),
        } as u64;
        let rack_of: Vec<u32> = (0..n).map(|i| (i / per_rack) as u32).collect();
        let zone_of_rack: Vec<u32> = (0..racks).map(|r| (r / per_zone) as u32).collect();
        let has_racks = c.nodes_per_rack > 0;
        let has_zones = c.racks_per_zone > 0;
        let topology = (0..n)
            .map(|i| {
                if has_racks {
                    let r = rack_of[i];
                    Topology {
                        zone: Some(format!("z{}", zone_of_rack[r as usize])),
                        rack: Some(format!("r{r}")),
                    }
                } else {
                    Topology::default()
                }
            })
            .collect();
        Self {
            caps,
            nodes: n,
            rack_of,
            zone_of_rack,
            racks,
            zones,
            has_racks,
            has_zones,
            per_connection: sc.registry.per_connection.map_or(f64::INFINITY, |r| r.0),
            topology,
            host,
            upload_buckets,
            link_rate,
        }
    }

    /// Racks in the model (1 without topology).
    pub fn racks(&self) -> usize {
        if self.has_racks {
            self.racks
        } else {
            1
        }
    }

    /// The upload token bucket of node `i` as a one-resource path, if uploads are limited.
    pub fn upload_bucket(&self, i: u32) -> Option<FlowPath> {
        self.upload_buckets
            .map(|b| FlowPath::new(&[b + i], f64::INFINITY))
    }

    fn up(&self, i: u32) -> ResId {
        2 + i
    }
    fn down(&self, i: u32) -> ResId {
        2 + self.nodes as u32 + i
    }
    fn rack_up(&self, r: u32) -> ResId {
        2 + 2 * self.nodes as u32 + r
    }
    fn rack_down(&self, r: u32) -> ResId {
        2 + 2 * self.nodes as u32 + self.racks as u32 + r
    }
    fn zone_up(&self, z: u32) -> ResId {
        2 + 2 * (self.nodes + self.racks) as u32 + z
    }
    fn zone_down(&self, z: u32) -> ResId {
        2 + 2 * (self.nodes + self.racks) as u32 + self.zones as u32 + z
    }

    pub fn rack(&self, i: u32) -> u32 {
        self.rack_of[i as usize]
    }

    /// Whether bytes from `o` to node `dst` cross into `dst`'s rack from outside it.
    pub fn cross_rack(&self, o: Origin, dst: u32) -> bool {
        match o {
            Origin::Node(s) => self.has_racks && self.rack(s) != self.rack(dst),
            // Registry and cache sit outside the racks.
            _ => self.has_racks,
        }
    }

    /// The resources a flow from `o` to node `dst` crosses, and its own cap.
    pub fn path(&self, o: Origin, dst: u32) -> FlowPath {
        let mut v: Vec<ResId> = Vec::with_capacity(7);
        let rd = self.rack(dst);
        let zd = self.zone_of_rack[rd as usize];
        let mut cap = f64::INFINITY;
        match o {
            Origin::Registry => {
                v.push(REGISTRY);
                cap = self.per_connection;
            }
            Origin::Cache => v.push(CACHE),
            Origin::Node(s) => v.push(self.up(s)),
        }
        v.push(self.down(dst));
        let (cross_rack, cross_zone, src_rack) = match o {
            Origin::Node(s) => {
                let rs = self.rack(s);
                (rs != rd, self.zone_of_rack[rs as usize] != zd, Some(rs))
            }
            _ => (true, true, None),
        };
        if self.has_racks && cross_rack {
            if let Some(rs) = src_rack {
                v.push(self.rack_up(rs));
            }
            v.push(self.rack_down(rd));
        }
        if self.has_zones && cross_zone {
            if let Some(rs) = src_rack {
                v.push(self.zone_up(self.zone_of_rack[rs as usize]));
            }
            v.push(self.zone_down(zd));
        }
        if let Some(h) = self.host {
            v.push(h);
        }
        FlowPath::new(&v, cap)
    }
}

/// Layer sizes of an image in an OCI layout (`index.json` → manifest → layers).
pub fn layers_from_oci_layout(dir: &Path, reference: Option<&str>) -> Result<Vec<Layer>, Error> {
    Ok(blobs_from_oci_layout(dir, reference)?.1)
}

/// The blobs a pull client fetches, in its order: the config, then the layers (as
/// `oci::pull` does with `Manifest::blobs`). The config is tiny, but it occupies one
/// of the client's concurrent fetches for a registry round trip, which staggers when
/// the next layer is announced.
pub fn pull_blobs_from_oci_layout(
    dir: &Path,
    reference: Option<&str>,
) -> Result<Vec<Layer>, Error> {
    let (config, layers) = blobs_from_oci_layout(dir, reference)?;
    Ok(config.into_iter().chain(layers).collect())
}

fn blobs_from_oci_layout(
    dir: &Path,
    reference: Option<&str>,
) -> Result<(Option<Layer>, Vec<Layer>), Error> {
    let scenario_err = |e: oci::Error| Error::Scenario(format!("{}: {e}", dir.display()));
    let layout = oci::layout::Layout::open(dir).map_err(scenario_err)?;
    let read = |d: &oci::Descriptor| -> Result<oci::Manifest, Error> {
        oci::Manifest::parse(&layout.read_json_blob(d).map_err(scenario_err)?).map_err(scenario_err)
    };
    let mut m = read(&layout.find(reference).map_err(scenario_err)?)?;
    // An index: take the first (linux/amd64 preferred) manifest.
    if m.is_index() {
        let pick = m
            .manifests
            .iter()
            .find(|x| {
                x.platform
                    .as_ref()
                    .is_some_and(|p| p.architecture == "amd64")
            })
            .or_else(|| m.manifests.first())
            .cloned()
            .ok_or_else(|| Error::Scenario("empty image index".into()))?;
        m = read(&pick)?;
    }
    if m.layers.is_empty() {
        return Err(Error::Scenario(format!(
            "{}: manifest has no layers",
            dir.display()
        )));
    }
    let config = m.config.as_ref().map(|c| Layer {
        name: "config".into(),
        size: crate::scenario::Bytes(c.size),
    });
    let layers = m
        .layers
        .iter()
        .enumerate()
        .map(|(i, l)| Layer {
            name: format!("{i}:{}", &l.digest.hex()[..12]),
            size: crate::scenario::Bytes(l.size),
        })
        .collect();
    Ok((config, layers))
}
