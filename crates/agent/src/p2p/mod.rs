//! The agent as a swarm peer: announcing to the tracker, serving verified pieces to
//! other agents over long-lived peer connections, and downloading blobs piece by piece
//! from peers (and, when elected, from the registry).

mod conn;
mod download;
mod serve;
mod wire_io;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use ratelimit::TokenBucket;
use swarm::scheduler::SchedulerConfig;
use swarm::upload::{RequestBudget, UploadConfig, UploadQueue};
use swarm::{AnnounceRequest, AnnounceResponse, PieceHash, Topology};

pub(crate) use download::{start, start_from_holders, Start, Want};

use crate::config::AgentConfig;
use crate::metrics::ReasonLabels;
use crate::Error;

pub struct P2pMetrics {
    pub peer_bytes: Counter,
    pub registry_bytes: Counter,
    pub upload_bytes: Counter,
    pub pieces_rejected: Counter,
    pub pieces_from_peers: Counter,
    pub pieces_hashed_from_disk: Counter,
    pub uploads_refused: Counter,
    pub uploads_active: Gauge,
    pub tracker_errors: Counter,
    pub swarm_peers: Gauge,
    pub source_roles: Counter,
    pub swarm_size_corrections: Counter,
    pub peer_auth_failures: Counter,
    pub tls_handshakes_refused: Family<ReasonLabels, Counter>,
    pub peers_stalled: Counter,
    pub stall_cancels: Counter,
    pub haves_sent: Counter,
    pub haves_filtered: Counter,
    pub have_filters_received: Counter,
    pub stripes_distrusted: Counter,
    pub peers_unreachable: Counter,
    pub peers_silent: Counter,
    pub readers_stalled: Counter,
    pub store_write_seconds: Counter<f64, std::sync::atomic::AtomicU64>,
}

impl P2pMetrics {
    fn register(r: &mut prometheus_client::registry::Registry) -> Self {
        let m = Self {
            peer_bytes: Counter::default(),
            registry_bytes: Counter::default(),
            upload_bytes: Counter::default(),
            pieces_rejected: Counter::default(),
            pieces_from_peers: Counter::default(),
            pieces_hashed_from_disk: Counter::default(),
            uploads_refused: Counter::default(),
            uploads_active: Gauge::default(),
            tracker_errors: Counter::default(),
            swarm_peers: Gauge::default(),
            source_roles: Counter::default(),
            swarm_size_corrections: Counter::default(),
            peer_auth_failures: Counter::default(),
            tls_handshakes_refused: Family::default(),
            peers_stalled: Counter::default(),
            stall_cancels: Counter::default(),
            haves_sent: Counter::default(),
            haves_filtered: Counter::default(),
            have_filters_received: Counter::default(),
            stripes_distrusted: Counter::default(),
            peers_unreachable: Counter::default(),
            peers_silent: Counter::default(),
            readers_stalled: Counter::default(),
            store_write_seconds: Counter::default(),
        };
        r.register(
            "p2p_peer_bytes",
            "Blob bytes received from peers (registry bytes saved)",
            m.peer_bytes.clone(),
        );
        r.register(
            "p2p_registry_bytes",
            "Blob bytes this agent fetched from the registry as a swarm source",
            m.registry_bytes.clone(),
        );
        r.register(
            "p2p_upload_bytes",
            "Piece bytes served to peers",
            m.upload_bytes.clone(),
        );
        r.register(
            "p2p_pieces_rejected",
            "Pieces from peers that failed their hash",
            m.pieces_rejected.clone(),
        );
        r.register(
            "p2p_pieces_from_peers",
            "Verified pieces received from peers",
            m.pieces_from_peers.clone(),
        );
        r.register(
            "p2p_pieces_hashed_from_disk",
            "Pieces from peers hashed by reading them back (the hash before them was not known when they were asked for)",
            m.pieces_hashed_from_disk.clone(),
        );
        r.register(
            "p2p_uploads_refused",
            "Piece requests answered busy because the upload line was full",
            m.uploads_refused.clone(),
        );
        r.register(
            "p2p_uploads_active",
            "Pieces being sent to peers right now",
            m.uploads_active.clone(),
        );
        r.register(
            "p2p_tracker_errors",
            "Failed tracker requests",
            m.tracker_errors.clone(),
        );
        r.register(
            "p2p_swarm_peers",
            "Peers in the most recent tracker answer",
            m.swarm_peers.clone(),
        );
        r.register(
            "p2p_source_roles",
            "Times this agent was elected to fetch a blob from the registry",
            m.source_roles.clone(),
        );
        r.register(
            "p2p_swarm_size_corrections",
            "Swarm downloads laid out by a size the blob does not have (a member said it \
             first), started over at the registry's",
            m.swarm_size_corrections.clone(),
        );
        r.register(
            "p2p_peer_auth_failures",
            "Peer connections that failed the cluster-token challenge or mutual TLS",
            m.peer_auth_failures.clone(),
        );
        r.register(
            "p2p_tls_handshakes_refused",
            "Incoming peer TLS handshakes that failed, by reason (unknown_ca, expired, timeout, ...)",
            m.tls_handshakes_refused.clone(),
        );
        r.register(
            "p2p_store_write_seconds",
            "Time spent writing received piece bytes into the page cache",
            m.store_write_seconds.clone(),
        );
        r.register(
            "p2p_peers_stalled",
            "Peer connections dropped because they sent nothing while holding requests",
            m.peers_stalled.clone(),
        );
        r.register(
            "p2p_stall_cancels",
            "Piece requests cancelled because a holder kept them waiting past the stall timeout",
            m.stall_cancels.clone(),
        );
        r.register(
            "p2p_haves_sent",
            "HAVE frames sent to downloaders (one per piece completed, per open channel that admits it)",
            m.haves_sent.clone(),
        );
        r.register(
            "p2p_haves_filtered",
            "HAVEs not sent because the downloader's HAVE_FILTER excludes the piece (a far peer in a striped swarm)",
            m.haves_filtered.clone(),
        );
        r.register(
            "p2p_have_filters_received",
            "HAVE_FILTER frames received from downloaders",
            m.have_filters_received.clone(),
        );
        r.register(
            "p2p_stripes_distrusted",
            "Downloads that heard nothing from their rack stripe for a while and asked far holders for every piece again",
            m.stripes_distrusted.clone(),
        );
        r.register(
            "p2p_peers_unreachable",
            "Peers reported to the tracker after dials to them failed 3 times in a row",
            m.peers_unreachable.clone(),
        );
        r.register(
            "p2p_peers_silent",
            "Peers reported to the tracker after they were asked for pieces and sent \
             nothing for 30 s",
            m.peers_silent.clone(),
        );
        r.register(
            "p2p_readers_stalled",
            "Downloaders disconnected because nothing sent to them went through for 20 s",
            m.readers_stalled.clone(),
        );
        m
    }
}

/// The listener's acceptor and the dialer's connector for peer connections under TLS.
/// Both read the node certificate at every handshake, so a renewal applies at once.
pub(crate) struct PeerTls {
    pub(crate) acceptor: pki::tokio_rustls::TlsAcceptor,
    pub(crate) connector: pki::PeerConnector,
}

impl PeerTls {
    fn new(id: &crate::identity::NodeIdentity) -> Result<Self, Error> {
        let config = pki::peer_server_config(&id.cert, &id.trust)
            .map_err(|e| Error::Config(format!("peer TLS: {e}")))?;
        Ok(PeerTls {
            acceptor: pki::acceptor(config),
            connector: pki::PeerConnector::new(id.cert.clone(), id.trust.clone()),
        })
    }
}

/// A blob's piece hashes, shared by the connections that serve them.
pub(crate) type PieceHashList = Arc<Vec<PieceHash>>;

pub struct P2p {
    pub node: String,
    /// Where peers reach this agent's peer listener, `host:port`.
    pub addr: String,
    pub topology: Topology,
    trackers: Arc<crate::tracker_endpoints::TrackerEndpoints>,
    token: Option<String>,
    pub(crate) http: reqwest::Client,
    /// This node's certificate and the cluster CA, with an https:// tracker: `http`
    /// presents it to the tracker.
    pub(crate) identity: Option<crate::identity::NodeIdentity>,
    /// Mutual TLS between agents, when this node has a certificate: the peer's identity
    /// is its certificate's node name, and the token handshake is not used.
    pub(crate) peer_tls: Option<PeerTls>,
    pub(crate) upload: Option<TokenBucket>,
    /// The node's download limit (shared with the registry path).
    pub(crate) download: Option<Arc<TokenBucket>>,
    /// The link speed the piece-size rule plans for (the tighter configured limit).
    pub(crate) link_bytes_per_sec: Option<u64>,
    /// The upload line shared by every peer connection, and the signal that a slot or
    /// a request is there.
    pub(crate) uploads: parking_lot::Mutex<UploadQueue<u64>>,
    pub(crate) upload_ready: tokio::sync::Notify,
    pub(crate) holders: parking_lot::Mutex<HashMap<u64, Arc<serve::HolderConn>>>,
    /// Piece requests in flight across all blobs.
    pub(crate) budget: RequestBudget,
    pub(crate) pool: conn::PeerPool,
    /// Running swarm downloads, by blob: where to tell one about a peer that opened a
    /// channel on its blob.
    pub(crate) downloads:
        parking_lot::Mutex<HashMap<oci::Digest, tokio::sync::mpsc::Sender<conn::PeerEvent>>>,
    pub(crate) sched_cfg: SchedulerConfig,
    /// Piece hashes computed from complete blobs, by (digest, piece size).
    pub(crate) hash_cache: parking_lot::Mutex<HashMap<(oci::Digest, u64), PieceHashList>>,
    pub threshold: u64,
    /// A fixed piece size to propose instead of the rule's.
    pub(crate) piece_size: Option<u64>,
    /// Registry connections a source may use for one large blob.
    pub(crate) registry_streams: u32,
    pub(crate) corrupt: bool,
    /// Test mode: piece requests are taken and never sent.
    pub(crate) withhold: bool,
    /// Test mode: the same for this blob only.
    pub(crate) withhold_blob: Option<String>,
    /// Test mode: of `withhold_blob`, only this piece.
    pub(crate) withhold_piece: Option<u32>,
    pub metrics: P2pMetrics,
}

impl P2p {
    pub(crate) fn from_config(
        cfg: &AgentConfig,
        advertised: String,
        download: Option<Arc<TokenBucket>>,
        registry: &mut prometheus_client::registry::Registry,
    ) -> Result<Option<Arc<Self>>, Error> {
        let Some(tracker) = &cfg.tracker else {
            return Ok(None);
        };
        let (up, down) = (
            cfg.upload_limit.map(|b| b.bytes()),
            cfg.download_limit.map(|b| b.bytes()),
        );
        let link = match (up, down) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        let identity = crate::identity::load(cfg)?;
        let http = match &identity {
            Some(id) => crate::identity::tracker_client(id)?,
            None => reqwest::Client::builder()
                .connect_timeout(Duration::from_secs(2))
                .pool_max_idle_per_host(8)
                .tcp_nodelay(true)
                .build()
                .map_err(|e| Error::Config(format!("http client: {e}")))?,
        };
        Ok(Some(Arc::new(Self {
            node: cfg.node_name.clone(),
            addr: advertised,
            topology: Topology {
                zone: cfg.zone.clone(),
                rack: cfg.rack.clone(),
            },
            trackers: Arc::new(crate::tracker_endpoints::TrackerEndpoints::parse(tracker)?),
            token: cfg.cluster_token.clone(),
            http,
            peer_tls: identity.as_ref().map(PeerTls::new).transpose()?,
            identity,
            upload: up.map(TokenBucket::new),
            download,
            link_bytes_per_sec: link,
            uploads: parking_lot::Mutex::new(UploadQueue::new(UploadConfig {
                max_active: cfg.max_uploads.max(1),
                max_queued_per_conn: cfg.upload_queue.max(1),
                ..UploadConfig::default()
            })),
            upload_ready: tokio::sync::Notify::new(),
            holders: parking_lot::Mutex::new(HashMap::new()),
            budget: RequestBudget::new(cfg.max_piece_requests.max(1) as u32),
            pool: conn::PeerPool::default(),
            downloads: parking_lot::Mutex::new(HashMap::new()),
            sched_cfg: SchedulerConfig::default(),
            hash_cache: parking_lot::Mutex::new(HashMap::new()),
            threshold: cfg.p2p_threshold.bytes(),
            registry_streams: cfg.registry_streams.clamp(1, 16) as u32,
            piece_size: cfg.piece_size.bytes(),
            corrupt: cfg.corrupt_pieces,
            withhold: cfg.withhold_pieces,
            withhold_blob: cfg.withhold_pieces_of.clone(),
            withhold_piece: cfg.withhold_piece,
            metrics: P2pMetrics::register(registry),
        })))
    }

    /// The piece size this node proposes for a blob of `size`: the configured one, else
    /// the rule for its link.
    pub(crate) fn piece_size_for(&self, size: u64) -> u64 {
        self.piece_size
            .unwrap_or_else(|| swarm::pieces::piece_size_for(size, self.link_bytes_per_sec))
    }

    /// Puts `size` in an announce with the piece size this node proposes for it (none
    /// when the operator's fixed piece size does not fit the blob).
    pub(crate) fn say_size(&self, req: &mut AnnounceRequest, size: u64) {
        req.size = Some(size);
        req.piece_size = Some(self.piece_size_for(size))
            .filter(|&p| swarm::pieces::validate_geometry(size, p).is_ok());
    }

    /// A peer opened a channel on a blob: if this node is downloading it too, that
    /// download learns of the peer (and may connect back) now.
    pub(crate) fn discovered(&self, d: &oci::Digest, node: &str, addr: &str) {
        if node == self.node || addr.is_empty() || addr.len() > 255 {
            return;
        }
        if let Some(tx) = self.downloads.lock().get(d) {
            let _ = tx.try_send(conn::PeerEvent::Discovered {
                peer: node.to_owned(),
                addr: addr.to_owned(),
            });
        }
    }

    /// Starts the peer listener and the upload dispatcher.
    pub(crate) fn spawn_server(
        self: &Arc<Self>,
        agent: crate::Agent,
        listener: tokio::net::TcpListener,
    ) {
        tokio::spawn(serve::serve_peers(agent, self.clone(), listener));
    }

    /// The trackers, and the one calls go to now (every tracker call goes through it).
    pub(crate) fn trackers(&self) -> &Arc<crate::tracker_endpoints::TrackerEndpoints> {
        &self.trackers
    }

    pub(crate) fn authed(&self, rb: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        match &self.token {
            Some(t) => rb.bearer_auth(t),
            None => rb,
        }
    }

    /// This node's answer to a peer's handshake nonce (zeros without a token, and under
    /// TLS, where the certificates authenticate both ends).
    pub(crate) fn proof(&self, role: u8, nonce: &[u8; 16], prover: &str) -> [u8; 32] {
        match &self.token {
            Some(t) if self.peer_tls.is_none() => {
                swarm::wire::handshake_proof(t.as_bytes(), role, nonce, prover)
            }
            _ => [0; 32],
        }
    }

    pub(crate) fn proof_ok(
        &self,
        proof: &[u8; 32],
        role: u8,
        nonce: &[u8; 16],
        prover: &str,
    ) -> bool {
        swarm::wire::proofs_equal(proof, &self.proof(role, nonce, prover))
    }

    pub(crate) async fn announce(&self, req: &AnnounceRequest) -> Result<AnnounceResponse, Error> {
        let tracker_err = |m: String| Error::Tracker { message: m };
        let r = self
            .trackers
            .send(|base| {
                self.authed(
                    self.http
                        .post(format!("{base}/swarm/v1/announce"))
                        .json(req),
                )
                .timeout(Duration::from_secs(2))
            })
            .await
            .map_err(|e| tracker_err(e.to_string()))?;
        if !r.status().is_success() {
            return Err(tracker_err(format!("tracker answered {}", r.status())));
        }
        let body = crate::read_bounded(r, 16 << 20)
            .await
            .map_err(|e| tracker_err(e.to_string()))?;
        serde_json::from_slice(&body).map_err(|e| tracker_err(format!("announce answer: {e}")))
    }

    /// Piece hashes the tracker holds for a blob, from piece `from` on.
    pub(crate) async fn tracker_hashes(
        &self,
        d: &oci::Digest,
        from: u32,
    ) -> Result<BTreeMap<u32, String>, Error> {
        let tracker_err = |m: String| Error::Tracker { message: m };
        let r = self
            .trackers
            .send(|base| {
                self.authed(
                    self.http
                        .get(format!("{base}/swarm/v1/hashes?digest={d}&from={from}")),
                )
                .timeout(Duration::from_secs(2))
            })
            .await
            .map_err(|e| tracker_err(e.to_string()))?;
        if !r.status().is_success() {
            return Err(tracker_err(format!("tracker answered {}", r.status())));
        }
        let body = crate::read_bounded(r, 8 << 20)
            .await
            .map_err(|e| tracker_err(e.to_string()))?;
        serde_json::from_slice(&body).map_err(|e| tracker_err(format!("hashes answer: {e}")))
    }

    /// Tells the tracker which complete blobs this node can serve.
    pub(crate) async fn seeding(&self, blobs: Vec<(oci::Digest, u64)>) -> Result<(), Error> {
        let body = serde_json::json!({
            "node": self.node, "addr": self.addr, "topology": self.topology,
            "blobs": blobs.iter().map(|(d, s)| serde_json::json!({"digest": d, "size": s})).collect::<Vec<_>>(),
        });
        let r = self
            .trackers
            .send(|base| {
                self.authed(
                    self.http
                        .post(format!("{base}/swarm/v1/seeding"))
                        .json(&body),
                )
                .timeout(Duration::from_secs(2))
            })
            .await
            .map_err(|e| Error::Tracker {
                message: e.to_string(),
            })?;
        if r.status().is_success() {
            Ok(())
        } else {
            Err(Error::Tracker {
                message: format!("tracker answered {}", r.status()),
            })
        }
    }
}
