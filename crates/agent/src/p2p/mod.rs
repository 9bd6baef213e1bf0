//! The agent as a swarm peer: announcing to the tracker, serving verified pieces to
//! other agents, and downloading blobs piece by piece from peers (and, when elected,
//! from the registry).

mod download;
mod serve;

use std::sync::Arc;
use std::time::Duration;

use origin::TokenBucket;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use swarm::{AnnounceRequest, AnnounceResponse, Topology};
use tokio::sync::Semaphore;

pub(crate) use download::{start, Start};
pub(crate) use serve::{hashes_handler, piece_handler};

use crate::config::{parse_size, AgentConfig};
use crate::Error;

/// Read-head requests in flight at once, over all blobs: one per layer a runtime pulls
/// at a time (containerd: 3; the pull client: 4).
pub(crate) const HEAD_REQUESTS: usize = 4;

pub struct P2pMetrics {
    pub peer_bytes: Counter,
    pub registry_bytes: Counter,
    pub upload_bytes: Counter,
    pub pieces_rejected: Counter,
    pub pieces_from_peers: Counter,
    pub uploads_refused: Counter,
    pub uploads_queued: Counter,
    pub uploads_active: Gauge,
    pub tracker_errors: Counter,
    pub swarm_peers: Gauge,
    pub source_roles: Counter,
}

impl P2pMetrics {
    fn register(r: &mut prometheus_client::registry::Registry) -> Self {
        let m = Self {
            peer_bytes: Counter::default(),
            registry_bytes: Counter::default(),
            upload_bytes: Counter::default(),
            pieces_rejected: Counter::default(),
            pieces_from_peers: Counter::default(),
            uploads_refused: Counter::default(),
            uploads_queued: Counter::default(),
            uploads_active: Gauge::default(),
            tracker_errors: Counter::default(),
            swarm_peers: Gauge::default(),
            source_roles: Counter::default(),
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
            "p2p_uploads_refused",
            "Piece requests refused because of the upload cap",
            m.uploads_refused.clone(),
        );
        r.register(
            "p2p_uploads_queued",
            "Piece requests that waited for an upload slot",
            m.uploads_queued.clone(),
        );
        r.register(
            "p2p_uploads_active",
            "Upload slots in use (a slot is held until the piece's last byte is in the socket)",
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
        m
    }
}

pub struct P2p {
    pub node: String,
    pub addr: String,
    pub topology: Topology,
    tracker: String,
    token: Option<String>,
    pub(crate) http: reqwest::Client,
    pub(crate) upload: Option<TokenBucket>,
    pub(crate) download: Option<TokenBucket>,
    /// Upload slots; a slot is held until the piece's last byte is in the socket.
    pub(crate) uploads: Arc<Semaphore>,
    /// Requests waiting for an upload slot, and how many may (`upload_queue`).
    pub(crate) upload_waiting: Arc<std::sync::atomic::AtomicUsize>,
    pub(crate) upload_queue: usize,
    pub(crate) upload_wait: Duration,
    pub(crate) requests: Arc<Semaphore>,
    /// A lane of its own for each blob's read head (its first missing piece): behind
    /// the shared line of up to 12 requests per blob it waited seconds, and each 503
    /// sent it to the back again, so a runtime reading the blob in order saw no byte
    /// for 20 s while later pieces kept arriving.
    pub(crate) head_requests: Arc<Semaphore>,
    /// Piece hashes computed from complete blobs, by (digest, piece size).
    pub(crate) hash_cache:
        parking_lot::Mutex<std::collections::HashMap<(oci::Digest, u64), Arc<Vec<String>>>>,
    /// Rate limits of prewarm assignments, by blob: prewarm never floods the network.
    pub(crate) prewarm_limits:
        parking_lot::Mutex<std::collections::HashMap<oci::Digest, Arc<TokenBucket>>>,
    pub threshold: u64,
    pub piece_size: u64,
    pub(crate) corrupt: bool,
    pub metrics: P2pMetrics,
}

impl P2p {
    pub(crate) fn from_config(
        cfg: &AgentConfig,
        registry: &mut prometheus_client::registry::Registry,
    ) -> Result<Option<Arc<Self>>, Error> {
        let Some(tracker) = &cfg.tracker else {
            return Ok(None);
        };
        let limit = |s: &Option<String>| -> Result<Option<TokenBucket>, Error> {
            s.as_deref()
                .map(|v| parse_size(v).map(TokenBucket::new).map_err(Error::Config))
                .transpose()
        };
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(2))
            .pool_max_idle_per_host(8)
            .tcp_nodelay(true)
            .build()
            .map_err(|e| Error::Config(format!("http client: {e}")))?;
        Ok(Some(Arc::new(Self {
            node: cfg.node_name.clone(),
            addr: cfg
                .advertise
                .clone()
                .unwrap_or_else(|| format!("http://{}", cfg.listen)),
            topology: Topology {
                zone: cfg.zone.clone(),
                rack: cfg.rack.clone(),
            },
            tracker: tracker.trim_end_matches('/').to_owned(),
            token: cfg.cluster_token.clone(),
            http,
            upload: limit(&cfg.upload_limit)?,
            download: limit(&cfg.download_limit)?,
            uploads: Arc::new(Semaphore::new(cfg.max_uploads.max(1))),
            upload_waiting: Arc::new(std::sync::atomic::AtomicUsize::new(0)),
            upload_queue: cfg.upload_queue,
            upload_wait: cfg.upload_wait,
            requests: Arc::new(Semaphore::new(cfg.max_piece_requests.max(1))),
            head_requests: Arc::new(Semaphore::new(HEAD_REQUESTS)),
            hash_cache: parking_lot::Mutex::new(std::collections::HashMap::new()),
            prewarm_limits: parking_lot::Mutex::new(std::collections::HashMap::new()),
            threshold: parse_size(&cfg.p2p_threshold).map_err(Error::Config)?,
            piece_size: parse_size(&cfg.piece_size).map_err(Error::Config)?,
            corrupt: cfg.corrupt_pieces,
            metrics: P2pMetrics::register(registry),
        })))
    }

    pub(crate) fn prewarm_limit(&self, d: &oci::Digest) -> Option<Arc<TokenBucket>> {
        self.prewarm_limits.lock().get(d).cloned()
    }

    pub(crate) fn tracker_url(&self) -> &str {
        &self.tracker
    }

    pub(crate) fn authed(&self, rb: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        match &self.token {
            Some(t) => rb.bearer_auth(t),
            None => rb,
        }
    }

    pub(crate) fn token_ok(&self, header: Option<&str>) -> bool {
        match &self.token {
            None => true,
            Some(want) => {
                let given = header.and_then(|h| h.strip_prefix("Bearer ")).unwrap_or("");
                given.len() == want.len()
                    && given
                        .bytes()
                        .zip(want.bytes())
                        .fold(0u8, |a, (x, y)| a | (x ^ y))
                        == 0
            }
        }
    }

    pub(crate) async fn announce(&self, req: &AnnounceRequest) -> Result<AnnounceResponse, String> {
        let r = self
            .authed(
                self.http
                    .post(format!("{}/swarm/v1/announce", self.tracker))
                    .json(req),
            )
            .timeout(Duration::from_secs(2))
            .send()
            .await
            .map_err(|e| e.to_string())?;
        if !r.status().is_success() {
            return Err(format!("tracker answered {}", r.status()));
        }
        r.json().await.map_err(|e| e.to_string())
    }

    /// Tells the tracker which complete blobs this node can serve.
    pub(crate) async fn seeding(&self, blobs: Vec<(oci::Digest, u64)>) -> Result<(), String> {
        let body = serde_json::json!({
            "node": self.node, "addr": self.addr, "topology": self.topology,
            "blobs": blobs.iter().map(|(d, s)| serde_json::json!({"digest": d, "size": s})).collect::<Vec<_>>(),
        });
        let r = self
            .authed(
                self.http
                    .post(format!("{}/swarm/v1/seeding", self.tracker))
                    .json(&body),
            )
            .timeout(Duration::from_secs(2))
            .send()
            .await
            .map_err(|e| e.to_string())?;
        if r.status().is_success() {
            Ok(())
        } else {
            Err(format!("tracker answered {}", r.status()))
        }
    }

    /// GET `{peer}/p2p/v1/blobs/{digest}/{what}` with the cluster token; non-2xx is an error.
    async fn peer_get(
        &self,
        peer_addr: &str,
        d: &oci::Digest,
        what: &str,
    ) -> Result<reqwest::Response, String> {
        let url = format!(
            "{}/p2p/v1/blobs/{d}/{what}",
            peer_addr.trim_end_matches('/')
        );
        let r = self
            .authed(self.http.get(url))
            .timeout(Duration::from_secs(30))
            .send()
            .await
            .map_err(|e| e.to_string())?;
        if !r.status().is_success() {
            return Err(format!("peer answered {}", r.status()));
        }
        Ok(r)
    }

    pub(crate) async fn fetch_hashes(
        &self,
        peer_addr: &str,
        d: &oci::Digest,
        piece_size: u64,
    ) -> Result<Vec<String>, String> {
        let r = self
            .peer_get(peer_addr, d, &format!("hashes?piece_size={piece_size}"))
            .await?;
        r.json().await.map_err(|e| e.to_string())
    }

    pub(crate) async fn fetch_piece(
        &self,
        peer_addr: &str,
        d: &oci::Digest,
        piece: u32,
        piece_size: u64,
        wait: bool,
    ) -> Result<bytes::Bytes, String> {
        use futures::StreamExt;
        let wait = if wait { "&wait=1" } else { "" };
        let r = self
            .peer_get(
                peer_addr,
                d,
                &format!("pieces/{piece}?piece_size={piece_size}{wait}"),
            )
            .await?;
        let mut buf = Vec::with_capacity(piece_size as usize);
        let mut s = r.bytes_stream();
        while let Some(c) = s.next().await {
            let c = c.map_err(|e| e.to_string())?;
            if let Some(l) = &self.download {
                l.acquire(c.len() as u64).await;
            }
            buf.extend_from_slice(&c);
            if buf.len() as u64 > piece_size {
                return Err("peer sent more than a piece".into());
            }
        }
        Ok(bytes::Bytes::from(buf))
    }
}
