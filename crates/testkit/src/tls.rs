//! Throwaway certificate authorities for TLS tests (`rcgen`): a CA, server
//! certificates for loopback, client certificates, and the settings a
//! [`Registry`](crate::Registry) needs to serve HTTPS (optionally requiring client
//! certificates, docker-registry's `http.tls.clientcas`).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{anyhow, Context, Result};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// A certificate authority that lives as long as the test.
pub struct TestCa {
    name: String,
    key: KeyPair,
    cert: rcgen::Certificate,
}

/// A certificate and its private key, PEM.
#[derive(Clone)]
pub struct CertPair {
    pub cert_pem: String,
    pub key_pem: String,
}

impl std::fmt::Debug for CertPair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CertPair").finish_non_exhaustive()
    }
}

impl CertPair {
    /// Writes `<stem>.crt` and `<stem>.key` into `dir`; returns their paths.
    pub fn write(&self, dir: &Path, stem: &str) -> Result<(PathBuf, PathBuf)> {
        std::fs::create_dir_all(dir)?;
        let cert = dir.join(format!("{stem}.crt"));
        let key = dir.join(format!("{stem}.key"));
        std::fs::write(&cert, &self.cert_pem)
            .with_context(|| format!("writing {}", cert.display()))?;
        std::fs::write(&key, &self.key_pem)
            .with_context(|| format!("writing {}", key.display()))?;
        Ok((cert, key))
    }
}

impl TestCa {
    /// A new CA (ECDSA P-256) named `name`.
    pub fn new(name: &str) -> Result<TestCa> {
        let key = KeyPair::generate().context("generating CA key")?;
        let mut params = CertificateParams::default();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        params
            .distinguished_name
            .push(DnType::CommonName, format!("testkit CA {name}"));
        let cert = params.self_signed(&key).context("self-signing the CA")?;
        Ok(TestCa {
            name: name.to_owned(),
            key,
            cert,
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The CA certificate, PEM.
    pub fn cert_pem(&self) -> String {
        self.cert.pem()
    }

    /// Writes the CA certificate (PEM) to `path`.
    pub fn write_cert(&self, path: &Path) -> Result<PathBuf> {
        if let Some(p) = path.parent() {
            std::fs::create_dir_all(p)?;
        }
        std::fs::write(path, self.cert_pem())
            .with_context(|| format!("writing {}", path.display()))?;
        Ok(path.to_owned())
    }

    fn issue(&self, names: &[&str], usage: ExtendedKeyUsagePurpose) -> Result<CertPair> {
        let key = KeyPair::generate().context("generating key")?;
        let mut params =
            CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
                .context("certificate names")?;
        params.distinguished_name.push(
            DnType::CommonName,
            names.first().copied().unwrap_or("testkit"),
        );
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![usage];
        let cert = params
            .signed_by(&key, &self.cert, &self.key)
            .context("signing certificate")?;
        Ok(CertPair {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }

    /// A server certificate for `names` (DNS names or IP addresses).
    pub fn server_cert(&self, names: &[&str]) -> Result<CertPair> {
        self.issue(names, ExtendedKeyUsagePurpose::ServerAuth)
    }

    /// A client certificate whose common name is `name`.
    pub fn client_cert(&self, name: &str) -> Result<CertPair> {
        self.issue(&[name], ExtendedKeyUsagePurpose::ClientAuth)
    }
}

/// What a [`Registry`](crate::Registry) needs to serve HTTPS.
#[derive(Clone, Debug)]
pub struct RegistryTls {
    /// The registry's certificate (for `127.0.0.1` and `localhost`).
    pub server: CertPair,
    /// The CA that signed it: what clients must trust.
    pub ca_pem: String,
    /// When set, the registry requires client certificates signed by this CA.
    pub client_ca_pem: Option<String>,
    /// A client certificate testkit itself presents (readiness checks, pushes).
    pub client: Option<CertPair>,
}

impl RegistryTls {
    /// HTTPS with a certificate from `ca` for 127.0.0.1 and localhost.
    pub fn new(ca: &TestCa) -> Result<RegistryTls> {
        Ok(RegistryTls {
            server: ca.server_cert(&["127.0.0.1", "localhost"])?,
            ca_pem: ca.cert_pem(),
            client_ca_pem: None,
            client: None,
        })
    }

    /// Also require client certificates signed by `client_ca`.
    pub fn require_client_certs(mut self, client_ca: &TestCa) -> Result<RegistryTls> {
        self.client_ca_pem = Some(client_ca.cert_pem());
        self.client = Some(client_ca.client_cert("testkit")?);
        Ok(self)
    }

    /// A rustls client configuration that trusts `ca_pem` and presents `client`.
    pub(crate) fn client_config(&self) -> Result<Arc<rustls::ClientConfig>> {
        let mut roots = rustls::RootCertStore::empty();
        for c in CertificateDer::pem_slice_iter(self.ca_pem.as_bytes()) {
            roots.add(c.context("CA PEM")?).context("CA certificate")?;
        }
        let builder = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .context("TLS versions")?
        .with_root_certificates(roots);
        let cfg = match &self.client {
            None => builder.with_no_client_auth(),
            Some(pair) => {
                let chain = CertificateDer::pem_slice_iter(pair.cert_pem.as_bytes())
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| anyhow!("client certificate PEM: {e}"))?;
                let key = PrivateKeyDer::from_pem_slice(pair.key_pem.as_bytes())
                    .map_err(|e| anyhow!("client key PEM: {e}"))?;
                builder
                    .with_client_auth_cert(chain, key)
                    .context("client certificate")?
            }
        };
        Ok(Arc::new(cfg))
    }
}
