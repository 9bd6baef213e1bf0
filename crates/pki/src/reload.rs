//! A certificate and key that can be replaced while servers and clients keep running.
//!
//! Every rustls configuration built by this crate reads its own certificate through a
//! [`CertSource`] at each handshake, so renewing a node's 24 h certificate is: write the
//! new files, call [`CertSource::reload_from_files`]. New handshakes present the new
//! certificate; established connections keep the session they have.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::SystemTime;

use arc_swap::ArcSwap;
use rustls::client::ResolvesClientCert;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls::SignatureScheme;

use crate::ca::IssuedCert;
use crate::error::{Error, Result};
use crate::files;
use crate::identity::{CertInfo, Identity};

struct Loaded {
    key: Arc<CertifiedKey>,
    info: CertInfo,
}

/// This process's own certificate chain and key, swappable at run time. Cheap to clone
/// (clones share the slot), and usable directly as a rustls server or client certificate
/// resolver.
#[derive(Clone)]
pub struct CertSource {
    current: Arc<ArcSwap<Loaded>>,
    files: Option<Arc<(PathBuf, PathBuf)>>,
}

impl CertSource {
    /// From a PEM chain (end-entity first, as [`IssuedCert::chain_pem`] writes it) and a
    /// PEM private key.
    pub fn from_pem(chain_pem: &str, key_pem: &str) -> Result<Self> {
        let loaded = load(chain_pem, key_pem)?;
        Ok(CertSource {
            current: Arc::new(ArcSwap::from_pointee(loaded)),
            files: None,
        })
    }

    /// From a certificate the CA just issued together with its key.
    pub fn from_issued(issued: &IssuedCert) -> Result<Self> {
        let key = issued
            .key_pem()
            .ok_or_else(|| Error::bad("issued certificate", "has no private key (signed CSR)"))?;
        CertSource::from_pem(&issued.chain_pem(), key)
    }

    /// From two files; [`CertSource::reload_from_files`] reads the same paths again.
    pub fn from_files(cert_path: &Path, key_path: &Path) -> Result<Self> {
        let loaded = load_files(cert_path, key_path)?;
        Ok(CertSource {
            current: Arc::new(ArcSwap::from_pointee(loaded)),
            files: Some(Arc::new((cert_path.to_owned(), key_path.to_owned()))),
        })
    }

    /// Re-reads the files given to [`CertSource::from_files`] and swaps them in. On any
    /// error (unreadable, key not matching — e.g. read between the writes of the two
    /// files —, another identity) the current certificate stays in place.
    pub fn reload_from_files(&self) -> Result<CertInfo> {
        let Some(paths) = &self.files else {
            return Err(Error::bad(
                "reload",
                "this certificate source was not loaded from files",
            ));
        };
        let loaded = load_files(&paths.0, &paths.1)?;
        self.swap(loaded)
    }

    /// Swaps in a new chain and key given as PEM (same rules as a reload).
    pub fn replace_pem(&self, chain_pem: &str, key_pem: &str) -> Result<CertInfo> {
        self.swap(load(chain_pem, key_pem)?)
    }

    /// The identity cannot change: peers and the tracker know this process by it, and a
    /// reload that picks up another node's files is a mistake to report, not to serve.
    fn swap(&self, loaded: Loaded) -> Result<CertInfo> {
        let current = self.current.load();
        if loaded.info.identity != current.info.identity {
            return Err(Error::WrongIdentity {
                expected: current.info.identity.to_uri(),
                found: loaded.info.identity.to_uri(),
            });
        }
        let info = loaded.info.clone();
        self.current.store(Arc::new(loaded));
        Ok(info)
    }

    /// The chain and key handshakes use right now.
    pub fn certified_key(&self) -> Arc<CertifiedKey> {
        Arc::clone(&self.current.load().key)
    }

    /// Identity, serial and dates of the current certificate.
    pub fn info(&self) -> CertInfo {
        self.current.load().info.clone()
    }

    /// The identity this source presents.
    pub fn identity(&self) -> Identity {
        self.current.load().info.identity.clone()
    }

    /// Whether the current certificate has reached 2/3 of its lifetime at `now`
    /// ([`CertInfo::needs_renewal`]).
    pub fn needs_renewal(&self, now: SystemTime) -> bool {
        self.current.load().info.needs_renewal(now)
    }

    /// How long a renewal loop sleeps before it looks at [`CertSource::needs_renewal`]
    /// again: until the renewal time, but at least every minute (clock jumps, suspended
    /// VMs) and never less than 2 s, so a certificate that is due at once after renewal
    /// (a lifetime shorter than the clock-skew backdating) renews every few seconds
    /// instead of spinning.
    pub fn next_check(&self, now: SystemTime) -> std::time::Duration {
        use std::time::Duration;
        self.current
            .load()
            .info
            .renew_at()
            .duration_since(now)
            .unwrap_or_default()
            .clamp(Duration::from_secs(2), Duration::from_secs(60))
    }
}

impl fmt::Debug for CertSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let loaded = self.current.load();
        f.debug_struct("CertSource")
            .field("identity", &loaded.info.identity.to_uri())
            .field("serial", &loaded.info.serial_hex())
            .field("not_after", &loaded.info.not_after)
            .finish()
    }
}

impl ResolvesServerCert for CertSource {
    fn resolve(&self, _client_hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.certified_key())
    }
}

impl ResolvesClientCert for CertSource {
    fn resolve(
        &self,
        _root_hint_subjects: &[&[u8]],
        _sigschemes: &[SignatureScheme],
    ) -> Option<Arc<CertifiedKey>> {
        Some(self.certified_key())
    }

    fn has_certs(&self) -> bool {
        true
    }
}

fn load_files(cert_path: &Path, key_path: &Path) -> Result<Loaded> {
    let chain = files::read_string(cert_path)?;
    let key = files::read_string(key_path)?;
    load(&chain, &key).map_err(|e| match e {
        Error::BadInput { what, reason } => Error::BadInput {
            what,
            reason: format!("{} / {}: {reason}", cert_path.display(), key_path.display()),
        },
        other => other,
    })
}

fn load(chain_pem: &str, key_pem: &str) -> Result<Loaded> {
    let chain = CertificateDer::pem_slice_iter(chain_pem.as_bytes())
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| Error::bad("certificate PEM", e))?;
    let leaf = chain
        .first()
        .ok_or_else(|| Error::bad("certificate PEM", "no certificate in it"))?;
    let info = CertInfo::from_der(leaf)?;
    let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes())
        .map_err(|e| Error::bad("private key PEM", e))?;
    let signing_key = crate::config::provider()
        .key_provider
        .load_private_key(key)
        .map_err(|e| Error::bad("private key", e))?;
    let certified = CertifiedKey::new(chain, signing_key);
    certified.keys_match().map_err(|e| {
        Error::bad(
            "private key",
            format!("does not match the certificate: {e}"),
        )
    })?;
    Ok(Loaded {
        key: Arc::new(certified),
        info,
    })
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::ca::{CertRequest, ClusterCa, DEFAULT_CA_LIFETIME};

    fn ca() -> ClusterCa {
        ClusterCa::init("test", DEFAULT_CA_LIFETIME).expect("CA")
    }

    fn node(ca: &ClusterCa, name: &str) -> IssuedCert {
        ca.issue(&CertRequest::new(Identity::node(name).expect("name")))
            .expect("issue")
    }

    #[test]
    fn swap_changes_what_resolvers_return() {
        let ca = ca();
        let first = node(&ca, "n1");
        let source = CertSource::from_issued(&first).expect("source");
        let clone = source.clone();
        assert_eq!(source.info().serial, first.info().serial);
        assert_eq!(source.certified_key().cert.len(), 2, "leaf and CA");

        let second = node(&ca, "n1");
        let info = source
            .replace_pem(&second.chain_pem(), second.key_pem().expect("key"))
            .expect("swap");
        assert_eq!(info.serial, second.info().serial);
        // Clones share the slot: a config holding a clone sees the new certificate.
        assert_eq!(clone.certified_key().cert[0], *second.cert_der());
        let from_resolver = ResolvesClientCert::resolve(&clone, &[], &[]).expect("a certificate");
        assert_eq!(from_resolver.cert[0], *second.cert_der());
    }

    #[test]
    fn swap_refuses_another_identity_and_mismatched_keys() {
        let ca = ca();
        let source = CertSource::from_issued(&node(&ca, "n1")).expect("source");
        let before = source.info();
        let other = node(&ca, "n2");
        assert!(matches!(
            source.replace_pem(&other.chain_pem(), other.key_pem().expect("key")),
            Err(Error::WrongIdentity { .. })
        ));
        let same_name = node(&ca, "n1");
        assert!(matches!(
            source.replace_pem(&same_name.chain_pem(), other.key_pem().expect("key")),
            Err(Error::BadInput {
                what: "private key",
                ..
            })
        ));
        assert!(source.replace_pem("", "").is_err());
        assert_eq!(
            source.info(),
            before,
            "a failed swap keeps the old certificate"
        );
    }

    #[test]
    fn reload_from_files() {
        let dir = tempfile::tempdir().expect("tempdir");
        let ca = ca();
        let first = node(&ca, "n1");
        let (cert_path, key_path) = first.save(dir.path(), "node").expect("save");
        let source = CertSource::from_files(&cert_path, &key_path).expect("source");
        assert_eq!(source.info().serial, first.info().serial);

        let second = node(&ca, "n1");
        second.save(dir.path(), "node").expect("save");
        let info = source.reload_from_files().expect("reload");
        assert_eq!(info.serial, second.info().serial);
        assert_eq!(source.info().serial, second.info().serial);

        // Half-written state (new certificate, old key): refused, old one kept.
        let third = node(&ca, "n1");
        std::fs::write(&cert_path, third.chain_pem()).expect("write");
        assert!(source.reload_from_files().is_err());
        assert_eq!(source.info().serial, second.info().serial);

        std::fs::remove_file(&key_path).expect("rm");
        let err = source.reload_from_files().expect_err("missing key");
        assert!(err.to_string().contains("node.key"), "{err}");

        let not_from_files = CertSource::from_issued(&first).expect("source");
        assert!(not_from_files.reload_from_files().is_err());
    }

    #[test]
    fn renewal_is_due_at_two_thirds() {
        let ca = ca();
        let source = CertSource::from_issued(&node(&ca, "n1")).expect("source");
        let info = source.info();
        assert!(!source.needs_renewal(SystemTime::now()));
        assert!(!source.needs_renewal(info.renew_at() - Duration::from_secs(1)));
        assert!(source.needs_renewal(info.renew_at()));
        let expected = info.not_before
            + (info
                .not_after
                .duration_since(info.not_before)
                .expect("order")
                * 2
                / 3);
        assert_eq!(info.renew_at(), expected);
    }

    #[test]
    fn a_signed_csr_needs_its_own_key() {
        let ca = ca();
        let (key_pem, csr_pem) = crate::ca::generate_node_csr("n1").expect("csr");
        let issued = ca
            .sign_csr(
                &csr_pem,
                &CertRequest::new(Identity::node("n1").expect("name")),
            )
            .expect("sign");
        assert!(CertSource::from_issued(&issued).is_err());
        let source = CertSource::from_pem(&issued.chain_pem(), &key_pem).expect("source");
        assert_eq!(source.identity(), Identity::node("n1").expect("name"));
    }
}
