//! Shared fixtures for the handshake tests: a cluster CA, certificate sources, and a
//! loopback TLS server that reports every handshake it sees.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::time::{Duration, SystemTime};

use pki::rustls::ServerConfig;
use pki::tokio_rustls::client;
use pki::{CertInfo, CertRequest, CertSource, ClusterCa, ClusterTrust, Error, Identity, Validity};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

pub const TIMEOUT: Duration = Duration::from_secs(10);
pub const GREETING: &[u8] = b"hello\n";

pub struct Cluster {
    pub ca: ClusterCa,
    pub trust: ClusterTrust,
}

impl Cluster {
    pub fn new(name: &str) -> Self {
        let ca = ClusterCa::init(name, pki::DEFAULT_CA_LIFETIME).expect("CA");
        let trust = ca.trust().expect("trust");
        Cluster { ca, trust }
    }

    pub fn source(&self, request: &CertRequest) -> CertSource {
        CertSource::from_issued(&self.ca.issue(request).expect("issue")).expect("source")
    }

    pub fn node(&self, name: &str) -> CertSource {
        self.source(&CertRequest::new(Identity::node(name).expect("name")))
    }

    pub fn expired_node(&self, name: &str) -> CertSource {
        let now = SystemTime::now();
        let past = Validity::between(
            now - Duration::from_secs(48 * 3600),
            now - Duration::from_secs(3600),
        )
        .expect("range");
        self.source(&CertRequest::new(Identity::node(name).expect("name")).validity(past))
    }

    pub fn tracker(&self) -> CertSource {
        self.source(
            &CertRequest::new(Identity::tracker("tracker").expect("name"))
                .dns_name("tracker.test")
                .ip_address("127.0.0.1".parse().expect("ip")),
        )
    }
}

/// What the server saw of one handshake.
#[derive(Debug)]
pub struct Seen {
    pub identity: Option<Identity>,
    pub client_cert: Option<CertInfo>,
}

/// A TLS server on loopback: for every connection, runs [`pki::accept`], reports the
/// outcome, sends [`GREETING`] and echoes until EOF.
pub struct Server {
    pub addr: SocketAddr,
    events: mpsc::UnboundedReceiver<Result<Seen, Error>>,
    task: tokio::task::JoinHandle<()>,
}

impl Server {
    pub async fn start(config: ServerConfig) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let acceptor = pki::acceptor(config);
        let (tx, events) = mpsc::unbounded_channel();
        let task = tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    return;
                };
                let acceptor = acceptor.clone();
                let tx = tx.clone();
                tokio::spawn(async move {
                    match pki::accept(&acceptor, tcp).await {
                        Err(e) => {
                            let _ = tx.send(Err(e));
                        }
                        Ok((mut tls, identity)) => {
                            // The identity again through the public helper, as the HTTP
                            // layer would call it.
                            assert_eq!(pki::peer_identity(&tls).expect("identity"), identity);
                            let client_cert = tls
                                .get_ref()
                                .1
                                .peer_certificates()
                                .and_then(|c| c.first())
                                .map(|der| CertInfo::from_der(der).expect("info"));
                            let _ = tx.send(Ok(Seen {
                                identity,
                                client_cert,
                            }));
                            if tls.write_all(GREETING).await.is_err() {
                                return;
                            }
                            let mut buf = [0u8; 1024];
                            loop {
                                match tls.read(&mut buf).await {
                                    Ok(0) | Err(_) => return,
                                    Ok(n) => {
                                        if tls.write_all(&buf[..n]).await.is_err() {
                                            return;
                                        }
                                    }
                                }
                            }
                        }
                    }
                });
            }
        });
        Server { addr, events, task }
    }

    /// The outcome of the next handshake.
    pub async fn next(&mut self) -> Result<Seen, Error> {
        tokio::time::timeout(TIMEOUT, self.events.recv())
            .await
            .expect("server handshake within the timeout")
            .expect("server running")
    }

    pub async fn tcp(&self) -> TcpStream {
        TcpStream::connect(self.addr).await.expect("connect")
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Reads the greeting: with TLS 1.3 this is where a client learns that the server
/// refused its certificate.
pub async fn greeting(tls: &mut client::TlsStream<TcpStream>) -> Result<(), Error> {
    let mut buf = [0u8; GREETING.len()];
    tokio::time::timeout(TIMEOUT, tls.read_exact(&mut buf))
        .await
        .expect("greeting within the timeout")
        .map_err(Error::from_handshake)?;
    assert_eq!(&buf, GREETING);
    Ok(())
}

/// Connect, then read the greeting; the first error either way.
pub async fn full<F>(connect: F) -> Result<client::TlsStream<TcpStream>, Error>
where
    F: std::future::Future<Output = Result<client::TlsStream<TcpStream>, Error>>,
{
    let mut tls = tokio::time::timeout(TIMEOUT, connect)
        .await
        .expect("handshake within the timeout")?;
    greeting(&mut tls).await?;
    Ok(tls)
}
