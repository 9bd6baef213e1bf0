//! tokio-rustls glue: acceptors, connectors, and the peer identity of a connection.

use std::sync::Arc;

use rustls::pki_types::ServerName;
use rustls::{ClientConfig, ServerConfig};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_rustls::{client, server, TlsAcceptor, TlsConnector};

use crate::config::peer_client_config;
use crate::error::{Error, Result};
use crate::identity::Identity;
use crate::reload::CertSource;
use crate::trust::ClusterTrust;

/// A tokio-rustls acceptor for a configuration from [`crate::config`].
pub fn acceptor(config: ServerConfig) -> TlsAcceptor {
    TlsAcceptor::from(Arc::new(config))
}

/// A tokio-rustls connector for a configuration from [`crate::config`].
pub fn connector(config: ClientConfig) -> TlsConnector {
    TlsConnector::from(Arc::new(config))
}

/// Runs the server side of a handshake and returns the stream with the client's verified
/// identity (`None` when the configuration allows clients without a certificate and this
/// one sent none). Handshake failures are classified ([`Error::from_handshake`]).
pub async fn accept<IO>(
    acceptor: &TlsAcceptor,
    io: IO,
) -> Result<(server::TlsStream<IO>, Option<Identity>)>
where
    IO: AsyncRead + AsyncWrite + Unpin,
{
    let stream = acceptor.accept(io).await.map_err(Error::from_handshake)?;
    let identity = peer_identity(&stream)?;
    Ok((stream, identity))
}

/// The identity of the client of an accepted connection. The verifier already checked the
/// chain and the role during the handshake; this reads the identity out again for the
/// HTTP layer.
pub fn peer_identity<IO>(stream: &server::TlsStream<IO>) -> Result<Option<Identity>> {
    identity_of(stream.get_ref().1.peer_certificates())
}

/// The identity of the server of an established client connection.
pub fn server_identity<IO>(stream: &client::TlsStream<IO>) -> Result<Option<Identity>> {
    identity_of(stream.get_ref().1.peer_certificates())
}

fn identity_of(
    certs: Option<&[rustls::pki_types::CertificateDer<'static>]>,
) -> Result<Option<Identity>> {
    match certs.and_then(|chain| chain.first()) {
        Some(leaf) => Identity::from_cert_der(leaf).map(Some),
        None => Ok(None),
    }
}

/// Connects with a tracker client configuration: `server_name` is the host name or IP
/// address the tracker certificate must be valid for.
///
/// With TLS 1.3 the client finishes its handshake before the server has judged the
/// client certificate; a refusal of ours shows up as an error on the first read.
pub async fn connect<IO>(
    connector: &TlsConnector,
    server_name: &str,
    io: IO,
) -> Result<client::TlsStream<IO>>
where
    IO: AsyncRead + AsyncWrite + Unpin,
{
    let name =
        ServerName::try_from(server_name.to_owned()).map_err(|e| Error::bad("server name", e))?;
    connector
        .connect(name, io)
        .await
        .map_err(Error::from_handshake)
}

/// Connections from this agent to other agents: each one requires the server to be the
/// node it was meant to reach.
#[derive(Debug, Clone)]
pub struct PeerConnector {
    cert: CertSource,
    trust: ClusterTrust,
}

impl PeerConnector {
    /// Presents `cert` (this node's, reloadable) and trusts `trust`.
    pub fn new(cert: CertSource, trust: ClusterTrust) -> Self {
        PeerConnector { cert, trust }
    }

    /// TLS over `io` to the agent named `expected_node`; fails unless its certificate
    /// chains to the CA and says `starling:node:<expected_node>`.
    pub async fn connect<IO>(&self, expected_node: &str, io: IO) -> Result<client::TlsStream<IO>>
    where
        IO: AsyncRead + AsyncWrite + Unpin,
    {
        let config = peer_client_config(&self.cert, &self.trust, expected_node)?;
        // The verifier ignores the name and SNI is off; rustls still wants one. The node
        // name is one when it parses as a DNS name or address, which keeps rustls' logs
        // readable; otherwise any placeholder does.
        let name = ServerName::try_from(expected_node.to_owned()).unwrap_or(ServerName::IpAddress(
            std::net::IpAddr::from(std::net::Ipv4Addr::UNSPECIFIED).into(),
        ));
        connector(config)
            .connect(name, io)
            .await
            .map_err(Error::from_handshake)
    }
}
