//! Cluster identity and TLS for Starling.
//!
//! # The model
//!
//! One **cluster CA** (ECDSA P-256, self-signed, 10 years, path length 0) signs every
//! certificate in the cluster. It lives on the tracker host in a PKI directory:
//!
//! | file | what | mode |
//! |---|---|---|
//! | `ca.crt` | the CA certificate; every process trusts it | 0644 |
//! | `ca.key` | the CA key; only the tracker (it signs node CSRs) | 0600 |
//! | `bootstrap.key` | 32-byte secret that signs bootstrap tokens | 0600 |
//!
//! A certificate says **who** it is for in exactly one URI SAN,
//! `starling:<role>:<name>` ([`Identity`]):
//!
//! | role | used by | EKU | default lifetime | extra SANs |
//! |---|---|---|---|---|
//! | `node` | an agent, to the tracker and to other agents (both directions) | server + client | 24 h | DNS/IP allowed |
//! | `operator` | people/automation that change the cluster | client | 90 days | none |
//! | `viewer` | read-only users | client | 90 days | none |
//! | `tracker` | the tracker's listener | server + client | 1 year | its DNS names/IPs |
//!
//! Names follow one grammar ([`validate_name`]): lowercase RFC 1123 subdomains (labels of
//! `[a-z0-9-]`, ≤ 63 each, ≤ 253 in all) — what Kubernetes accepts as node names. A
//! certificate with no or several `starling:` URI SANs has no identity and is refused.
//! The subject DN is decoration; nothing reads it.
//!
//! Node certificates are short-lived because **expiry is the revocation mechanism**
//! (there is no CRL): a node removed from the cluster stops being accepted within a day.
//! Agents renew at 2/3 of the lifetime ([`CertInfo::needs_renewal`]) by sending a new CSR
//! over their current mutual-TLS connection to the tracker, and swap the result in
//! without restarting ([`CertSource`]).
//!
//! # Joining a node (like `kubeadm join`, one command per step)
//!
//! 1. Operator, once: `starling certs init` — [`ClusterCa::init`] + [`ClusterCa::save`],
//!    [`BootstrapKey::generate`] + [`BootstrapKey::save`]; it prints the CA pin
//!    ([`ClusterCa::pin`], `sha256:<hex of the CA's SubjectPublicKeyInfo>`).
//! 2. Operator, per batch of nodes: `starling certs token --ttl 1h [--name 'gpu-*']` —
//!    [`BootstrapKey::create_token`]. Tokens are stateless (`stb1.<id>.<expiry>.
//!    <pattern>.<mac>`, HMAC-SHA256 keyed by `bootstrap.key`), at most 7 days long, and
//!    may be bound to a node-name pattern.
//! 3. On the node: `starling agent --tracker https://tracker:7070 --token … --ca-pin
//!    sha256:…` (or `--ca-cert ca.crt`). The agent generates its key and a CSR
//!    ([`generate_node_csr`]) and calls the tracker with [`bootstrap_client_config`]: the
//!    tracker sends its certificate chain including the CA; the agent accepts the CA whose
//!    key matches the pin and checks the tracker's host name against it. It keeps the CA
//!    ([`LearnedCa`]) as its `ca.crt`.
//! 4. The tracker verifies the token ([`BootstrapKey::verify`]), decides the node name
//!    ([`TokenClaims::authorize`] checks it against the token's pattern) and signs the CSR
//!    with *that* identity ([`ClusterCa::sign_csr`]): the CSR contributes only its public
//!    key, after its signature has been checked.
//!
//! # Connections
//!
//! | connection | server config | client config | checks |
//! |---|---|---|---|
//! | agent/CLI → tracker | [`tracker_server_config`] | [`tracker_client_config`] | server: chain + host name; client cert optional, role node/operator/viewer |
//! | agent → agent | [`peer_server_config`] | [`peer_client_config`] / [`PeerConnector`] | both: chain to the CA; server: identity is `starling:node:<expected>`; client: role node, required |
//! | new agent → tracker | [`tracker_server_config`] | [`bootstrap_client_config`] | server: chain to the pinned CA + host name |
//!
//! All configurations use rustls' *ring* provider ([`provider`]) — already in the
//! workspace through rcgen and the registry client, and no C/cmake build as aws-lc
//! needs — TLS 1.3 only, and no session resumption (see [`config`]). The HTTP layer gets
//! the verified client identity of a connection from [`accept`] / [`peer_identity`]
//! and decides what that role may do.
//!
//! # In code
//!
//! ```
//! # fn main() -> Result<(), pki::Error> {
//! use std::time::Duration;
//! use pki::{BootstrapKey, CertRequest, CertSource, ClusterCa, NamePattern};
//!
//! // Operator (normally `init_pki_dir` once, then `ClusterCa::load` / `BootstrapKey::load`).
//! let ca = ClusterCa::init("prod", pki::DEFAULT_CA_LIFETIME)?;
//! let bootstrap = BootstrapKey::generate()?;
//! let pin = ca.pin().to_string(); // sha256:…, printed for the join command
//! let token = bootstrap.create_token(Duration::from_secs(3600), Some(&NamePattern::new("gpu-*")?))?;
//!
//! // Joining node: a key that never leaves it, and a CSR.
//! let (key_pem, csr_pem) = pki::generate_node_csr("gpu-017")?;
//!
//! // Tracker: the token decides what the node may be called; the CSR gives only its key.
//! let identity = bootstrap.verify(&token)?.authorize("gpu-017")?;
//! let issued = ca.sign_csr(&csr_pem, &CertRequest::new(identity))?;
//! assert_eq!(issued.info().identity.to_uri(), "starling:node:gpu-017");
//!
//! // Node: its certificate (reloadable) in the peer configurations.
//! let me = CertSource::from_pem(&issued.chain_pem(), &key_pem)?;
//! let trust = ca.trust()?;
//! let listener = pki::peer_server_config(&me, &trust)?;
//! let to_gpu_018 = pki::peer_client_config(&me, &trust, "gpu-018")?;
//! # let _ = (pin, listener, to_gpu_018);
//! # Ok(()) }
//! ```
//!
//! Errors are one enum, [`Error`], whose variants say where a failure came from; handshake
//! failures are classified back into it ([`Error::from_handshake`]): [`Error::Expired`],
//! [`Error::UnknownCa`], [`Error::WrongIdentity`], [`Error::WrongRole`], ...

#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod ca;
pub mod config;
mod error;
mod files;
mod identity;
mod net;
mod reload;
mod token;
mod trust;
mod verify;

pub use ca::{
    default_lifetime, generate_csr, generate_node_csr, CertRequest, ClusterCa, IssuedCert,
    Validity, CA_CERT_FILE, CA_KEY_FILE, CLOCK_SKEW_ALLOWANCE, DEFAULT_CA_LIFETIME,
    DEFAULT_NODE_LIFETIME, DEFAULT_TRACKER_LIFETIME, DEFAULT_USER_LIFETIME,
};
pub use config::{
    bootstrap_client_config, identity_client_config, peer_client_config, peer_server_config,
    provider, server_config, tracker_client_config, tracker_server_config, ClientAuth, LearnedCa,
};
pub use error::{Error, Result};
pub use identity::{
    validate_name, CertInfo, Identity, Role, IDENTITY_SCHEME, MAX_LABEL_LEN, MAX_NAME_LEN,
};
pub use net::{
    accept, acceptor, connect, connector, peer_identity, server_identity, PeerConnector,
};
pub use reload::CertSource;
pub use token::{
    secrets_equal, BootstrapKey, NamePattern, TokenClaims, BOOTSTRAP_KEY_FILE, MAX_TOKEN_TTL,
};
pub use trust::{CaPin, ClusterTrust};

/// Re-exported so users name the same versions this crate was built with.
pub use rustls;
pub use tokio_rustls;

/// Creates a PKI directory in one step: a new CA (`ca.crt`, `ca.key`) and a bootstrap
/// secret (`bootstrap.key`). Refuses to overwrite an existing CA or secret.
pub fn init_pki_dir(
    dir: &std::path::Path,
    cluster_name: &str,
    ca_lifetime: std::time::Duration,
) -> Result<(ClusterCa, BootstrapKey)> {
    let ca = ClusterCa::init(cluster_name, ca_lifetime)?;
    let key = BootstrapKey::generate()?;
    // Check both before writing either, so a refusal leaves the directory as it was.
    for file in [CA_CERT_FILE, CA_KEY_FILE, BOOTSTRAP_KEY_FILE] {
        let path = dir.join(file);
        if path.exists() {
            return Err(Error::AlreadyExists { path });
        }
    }
    ca.save(dir)?;
    key.save(dir)?;
    Ok((ca, key))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn init_pki_dir_creates_everything_once() {
        let dir = tempfile::tempdir().expect("tempdir");
        let pki = dir.path().join("pki");
        let (ca, key) = init_pki_dir(&pki, "prod", DEFAULT_CA_LIFETIME).expect("init");
        assert_eq!(ClusterCa::load(&pki).expect("load").pin(), ca.pin());
        let token = key
            .create_token(std::time::Duration::from_secs(60), None)
            .expect("token");
        assert!(BootstrapKey::load(&pki)
            .expect("load")
            .verify(&token)
            .is_ok());

        let before = std::fs::read(pki.join(CA_KEY_FILE)).expect("read");
        assert!(matches!(
            init_pki_dir(&pki, "prod", DEFAULT_CA_LIFETIME),
            Err(Error::AlreadyExists { .. })
        ));
        assert_eq!(std::fs::read(pki.join(CA_KEY_FILE)).expect("read"), before);
    }
}
