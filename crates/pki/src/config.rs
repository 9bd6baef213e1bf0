//! The rustls configurations of each connection in the cluster.
//!
//! Common to all of them:
//! - the crypto provider is *ring*, passed explicitly ([`provider`]), never the process
//!   default, so nothing depends on which rustls features other crates turn on;
//! - TLS 1.3 only: both ends are Starling, curl, or another modern client;
//! - no session resumption: a resumed session is authenticated by the certificate of the
//!   session it resumes, which may since have expired or been rotated — with 24 h node
//!   certificates and expiry as the only revocation, every connection should show a
//!   current certificate. Connections are long-lived (HTTP keep-alive), so the cost is
//!   one full ECDHE handshake per connection;
//! - the own certificate comes from a [`CertSource`], read at every handshake.
//!
//! Configs are returned by value so the HTTP layer can set ALPN before wrapping them in
//! an `Arc`.

use std::sync::{Arc, Mutex, OnceLock};

use rustls::client::Resumption;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::CertificateDer;
use rustls::server::NoServerSessionStorage;
use rustls::{ClientConfig, ServerConfig};

use crate::error::{Error, Result};
use crate::identity::{Identity, Role};
use crate::reload::CertSource;
use crate::trust::{CaPin, ClusterTrust};
use crate::verify::{IdentityServerVerifier, PinnedCaVerifier, RoleClientVerifier};

/// The crypto provider of every configuration: rustls' *ring* provider. ring is already
/// how this workspace signs (rcgen) and how its HTTPS client talks to registries, and it
/// builds without cmake or a C toolchain for aws-lc.
pub fn provider() -> Arc<CryptoProvider> {
    static PROVIDER: OnceLock<Arc<CryptoProvider>> = OnceLock::new();
    Arc::clone(PROVIDER.get_or_init(|| Arc::new(rustls::crypto::ring::default_provider())))
}

const VERSIONS: &[&rustls::SupportedProtocolVersion] = &[&rustls::version::TLS13];

/// Which client certificates a server asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientAuth {
    /// Roles accepted; a certificate of another role fails the handshake.
    pub roles: Vec<Role>,
    /// Whether a client without a certificate is refused.
    pub required: bool,
}

impl ClientAuth {
    /// A certificate of one of `roles` must be presented.
    pub fn required(roles: &[Role]) -> Self {
        ClientAuth {
            roles: roles.to_vec(),
            required: true,
        }
    }

    /// A certificate is asked for; when one is presented it must be of one of `roles`.
    pub fn optional(roles: &[Role]) -> Self {
        ClientAuth {
            roles: roles.to_vec(),
            required: false,
        }
    }
}

/// A server presenting `cert` and checking client certificates against the cluster CA
/// as `client_auth` says.
pub fn server_config(
    cert: &CertSource,
    trust: &ClusterTrust,
    client_auth: &ClientAuth,
) -> Result<ServerConfig> {
    let verifier = RoleClientVerifier::new(
        trust.roots(),
        &client_auth.roles,
        client_auth.required,
        provider(),
    )?;
    let mut config = ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(VERSIONS)
        .map_err(Error::Tls)?
        .with_client_cert_verifier(Arc::new(verifier))
        .with_cert_resolver(Arc::new(cert.clone()));
    config.session_storage = Arc::new(NoServerSessionStorage {});
    config.send_tls13_tickets = 0;
    Ok(config)
}

/// The tracker's listener: presents the tracker certificate; asks for a client
/// certificate but does not require one (operators may use bearer tokens instead, which
/// the HTTP layer checks). A certificate that is presented must chain to the CA and be a
/// node, operator or viewer; get it per connection with [`crate::peer_identity`].
pub fn tracker_server_config(cert: &CertSource, trust: &ClusterTrust) -> Result<ServerConfig> {
    server_config(
        cert,
        trust,
        &ClientAuth::optional(&[Role::Node, Role::Operator, Role::Viewer]),
    )
}

/// An agent's peer listener: a client certificate is required, must chain to the CA and
/// must be a node's.
pub fn peer_server_config(cert: &CertSource, trust: &ClusterTrust) -> Result<ServerConfig> {
    server_config(cert, trust, &ClientAuth::required(&[Role::Node]))
}

/// A client that presents `cert` and accepts only a server whose certificate chains to
/// the CA and carries exactly `expected` — whatever host name or address was dialled.
pub fn identity_client_config(
    cert: &CertSource,
    trust: &ClusterTrust,
    expected: Identity,
) -> Result<ClientConfig> {
    let verifier = IdentityServerVerifier::new(trust.roots(), expected, provider());
    let mut config = ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(VERSIONS)
        .map_err(Error::Tls)?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(verifier))
        .with_client_cert_resolver(Arc::new(cert.clone()));
    config.resumption = Resumption::disabled();
    // The name dialled is not what is checked, so it need not be sent either.
    config.enable_sni = false;
    Ok(config)
}

/// An agent connecting to the peer agent `expected_node`: presents the node certificate
/// and requires the server to be `starling:node:<expected_node>`. One config per peer
/// (building one is cheap next to the handshake); [`crate::PeerConnector`] does it per
/// connection.
pub fn peer_client_config(
    cert: &CertSource,
    trust: &ClusterTrust,
    expected_node: &str,
) -> Result<ClientConfig> {
    identity_client_config(cert, trust, Identity::node(expected_node)?)
}

/// An agent or the CLI connecting to the tracker: ordinary host name verification
/// against the cluster CA (the tracker certificate carries its DNS names and IPs),
/// presenting `cert` when given (nodes, operators with a certificate) and nothing
/// otherwise (an operator using a bearer token).
pub fn tracker_client_config(
    trust: &ClusterTrust,
    cert: Option<&CertSource>,
) -> Result<ClientConfig> {
    let builder = ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(VERSIONS)
        .map_err(Error::Tls)?
        .with_root_certificates(trust.roots());
    let mut config = match cert {
        Some(cert) => builder.with_client_cert_resolver(Arc::new(cert.clone())),
        None => builder.with_no_client_auth(),
    };
    config.resumption = Resumption::disabled();
    Ok(config)
}

/// The CA a pinned bootstrap connection found, once its handshake has succeeded.
#[derive(Debug, Clone, Default)]
pub struct LearnedCa(Arc<Mutex<Option<CertificateDer<'static>>>>);

impl LearnedCa {
    /// The CA certificate matching the pin, after a successful handshake.
    pub fn cert(&self) -> Option<CertificateDer<'static>> {
        self.0.lock().ok().and_then(|ca| ca.clone())
    }

    /// The learned CA as a trust store, to save as `ca.crt` ([`ClusterTrust::to_pem`])
    /// and to use for every later connection.
    pub fn trust(&self) -> Option<Result<ClusterTrust>> {
        self.cert().map(|der| ClusterTrust::from_der(vec![der]))
    }
}

/// First contact of a joining agent with the tracker, knowing only the tracker's URL, a
/// bootstrap token and the CA pin (kubeadm's discovery hash): the tracker must send the
/// CA certificate in its chain; the CA whose key matches `pin` becomes the only trust
/// anchor, and the tracker's certificate is verified against it with ordinary host name
/// checks. No client certificate (the agent has none yet; the token authenticates it).
/// After the handshake, [`LearnedCa`] holds the CA.
pub fn bootstrap_client_config(pin: CaPin) -> Result<(ClientConfig, LearnedCa)> {
    let learned = LearnedCa::default();
    let verifier = PinnedCaVerifier::new(pin, provider(), Arc::clone(&learned.0));
    let mut config = ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(VERSIONS)
        .map_err(Error::Tls)?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(verifier))
        .with_no_client_auth();
    config.resumption = Resumption::disabled();
    Ok((config, learned))
}
