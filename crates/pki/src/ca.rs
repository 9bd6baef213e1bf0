//! The cluster CA: creating it, keeping it on disk, issuing certificates and signing the
//! CSRs agents send when they join or renew.

use std::fmt;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose, PublicKeyData, SanType, SerialNumber,
};
use ring::rand::SecureRandom;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, CertificateSigningRequestDer};
use x509_parser::certification_request::X509CertificationRequest;
use x509_parser::prelude::FromDer;

use crate::error::{Error, Result};
use crate::files;
use crate::identity::{parse_cert, CertInfo, Identity, Role};
use crate::trust::{der_to_pem, CaPin, ClusterTrust};

/// File name of the CA certificate in a PKI directory.
pub const CA_CERT_FILE: &str = "ca.crt";
/// File name of the CA private key (mode 0600).
pub const CA_KEY_FILE: &str = "ca.key";

const DAY: Duration = Duration::from_secs(24 * 3600);
/// Default lifetime of the cluster CA.
pub const DEFAULT_CA_LIFETIME: Duration = Duration::from_secs(10 * 365 * 24 * 3600);
/// Default lifetime of node certificates: short, because expiry is how a node's access is
/// revoked (there is no CRL), and agents renew on their own.
pub const DEFAULT_NODE_LIFETIME: Duration = DAY;
/// Default lifetime of operator and viewer certificates.
pub const DEFAULT_USER_LIFETIME: Duration = Duration::from_secs(90 * 24 * 3600);
/// Default lifetime of the tracker's server certificate.
pub const DEFAULT_TRACKER_LIFETIME: Duration = Duration::from_secs(365 * 24 * 3600);
/// How far `notBefore` is set in the past, so that a node whose clock is a little behind
/// the tracker's accepts a certificate issued a second ago.
pub const CLOCK_SKEW_ALLOWANCE: Duration = Duration::from_secs(5 * 60);

/// The default lifetime of a certificate for `role`.
pub fn default_lifetime(role: Role) -> Duration {
    match role {
        Role::Node => DEFAULT_NODE_LIFETIME,
        Role::Operator | Role::Viewer => DEFAULT_USER_LIFETIME,
        Role::Tracker => DEFAULT_TRACKER_LIFETIME,
    }
}

/// The validity period of a certificate to issue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Validity {
    /// Start (inclusive).
    pub not_before: SystemTime,
    /// End (inclusive).
    pub not_after: SystemTime,
}

impl Validity {
    /// From now (minus [`CLOCK_SKEW_ALLOWANCE`]) for `lifetime`.
    pub fn starting_now(lifetime: Duration) -> Self {
        let now = SystemTime::now();
        Validity {
            not_before: now - CLOCK_SKEW_ALLOWANCE,
            not_after: now + lifetime,
        }
    }

    /// Explicit dates; `not_after` must be after `not_before`. Dates in the past are
    /// allowed (tests issue expired certificates this way).
    pub fn between(not_before: SystemTime, not_after: SystemTime) -> Result<Self> {
        if not_after <= not_before {
            return Err(Error::bad("validity", "notAfter is not after notBefore"));
        }
        Ok(Validity {
            not_before,
            not_after,
        })
    }
}

/// What to put in a certificate. The identity comes from the caller, never from a CSR.
#[derive(Debug, Clone)]
pub struct CertRequest {
    /// Whom the certificate is for.
    pub identity: Identity,
    /// DNS SANs (tracker and node certificates only).
    pub dns_names: Vec<String>,
    /// IP address SANs (tracker and node certificates only).
    pub ip_addresses: Vec<IpAddr>,
    /// Validity period; the default is [`default_lifetime`] of the role from now.
    pub validity: Validity,
}

impl CertRequest {
    /// A request with the role's default lifetime starting now and no extra SANs.
    pub fn new(identity: Identity) -> Self {
        let validity = Validity::starting_now(default_lifetime(identity.role()));
        CertRequest {
            identity,
            dns_names: Vec::new(),
            ip_addresses: Vec::new(),
            validity,
        }
    }

    /// Adds a DNS SAN.
    pub fn dns_name(mut self, name: impl Into<String>) -> Self {
        self.dns_names.push(name.into());
        self
    }

    /// Adds an IP address SAN.
    pub fn ip_address(mut self, ip: IpAddr) -> Self {
        self.ip_addresses.push(ip);
        self
    }

    /// Sets the lifetime, starting now.
    pub fn lifetime(mut self, lifetime: Duration) -> Self {
        self.validity = Validity::starting_now(lifetime);
        self
    }

    /// Sets explicit dates.
    pub fn validity(mut self, validity: Validity) -> Self {
        self.validity = validity;
        self
    }

    fn to_params(&self, serial: SerialNumber) -> Result<CertificateParams> {
        let role = self.identity.role();
        let has_host_sans = !self.dns_names.is_empty() || !self.ip_addresses.is_empty();
        if has_host_sans && !matches!(role, Role::Node | Role::Tracker) {
            return Err(Error::bad(
                "certificate request",
                format!("{role} certificates carry no DNS/IP names"),
            ));
        }
        let mut params = CertificateParams::default();
        let uri = self.identity.to_uri();
        let mut sans = vec![SanType::URI(
            uri.clone()
                .try_into()
                .map_err(|e| Error::bad("identity", e))?,
        )];
        for dns in &self.dns_names {
            crate::identity::validate_name(dns)?;
            sans.push(SanType::DnsName(
                dns.clone()
                    .try_into()
                    .map_err(|e| Error::bad("DNS name", e))?,
            ));
        }
        sans.extend(self.ip_addresses.iter().copied().map(SanType::IpAddress));
        params.subject_alt_names = sans;
        let mut dn = DistinguishedName::new();
        // The subject is for people reading `openssl x509 -text`; nothing trusts it.
        dn.push(DnType::CommonName, uri);
        dn.push(DnType::OrganizationName, "starling");
        params.distinguished_name = dn;
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        // webpki checks these: an operator certificate cannot serve TLS, so it cannot
        // impersonate a node or the tracker even though the same CA signed it.
        params.extended_key_usages = match role {
            Role::Node | Role::Tracker => vec![
                ExtendedKeyUsagePurpose::ServerAuth,
                ExtendedKeyUsagePurpose::ClientAuth,
            ],
            Role::Operator | Role::Viewer => vec![ExtendedKeyUsagePurpose::ClientAuth],
        };
        params.use_authority_key_identifier_extension = true;
        params.serial_number = Some(serial);
        params.not_before = self.validity.not_before.into();
        params.not_after = self.validity.not_after.into();
        Ok(params)
    }
}

/// A certificate the CA issued, with its private key when the CA generated it.
#[derive(Clone)]
pub struct IssuedCert {
    cert_der: CertificateDer<'static>,
    cert_pem: String,
    ca_pem: String,
    key_pem: Option<String>,
    info: CertInfo,
}

impl IssuedCert {
    /// The certificate (DER).
    pub fn cert_der(&self) -> &CertificateDer<'static> {
        &self.cert_der
    }

    /// The certificate alone (PEM).
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// The certificate followed by the CA certificate: what a server presents, so a
    /// joining agent can find the CA matching its pin in the handshake.
    pub fn chain_pem(&self) -> String {
        format!("{}{}", self.cert_pem, self.ca_pem)
    }

    /// The private key (PKCS#8 PEM), when [`ClusterCa::issue`] generated it; `None` for a
    /// signed CSR (the key never left the requester).
    pub fn key_pem(&self) -> Option<&str> {
        self.key_pem.as_deref()
    }

    /// Identity, serial and dates of the certificate.
    pub fn info(&self) -> &CertInfo {
        &self.info
    }

    /// Writes `<stem>.crt` (the chain) and, when there is one, `<stem>.key` (0600) into
    /// `dir`, replacing older files atomically. Returns the two paths.
    pub fn save(&self, dir: &Path, stem: &str) -> Result<(PathBuf, PathBuf)> {
        files::ensure_dir(dir)?;
        let cert_path = dir.join(format!("{stem}.crt"));
        let key_path = dir.join(format!("{stem}.key"));
        // Key first: a reader that sees the new certificate must find the matching key.
        if let Some(key) = &self.key_pem {
            files::write_replace(&key_path, key.as_bytes(), files::SECRET_MODE)?;
        }
        files::write_replace(&cert_path, self.chain_pem().as_bytes(), files::PUBLIC_MODE)?;
        Ok((cert_path, key_path))
    }
}

impl fmt::Debug for IssuedCert {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IssuedCert")
            .field("info", &self.info)
            .field("key_pem", &self.key_pem.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

/// The cluster certificate authority: ECDSA P-256, self-signed, path length 0 (it signs
/// end-entity certificates only).
pub struct ClusterCa {
    key: KeyPair,
    /// rcgen's view of the CA, used only as the issuer when signing.
    issuer: rcgen::Certificate,
    cert_der: CertificateDer<'static>,
    cert_pem: String,
    not_after: SystemTime,
}

impl ClusterCa {
    /// Creates a new CA. `cluster_name` (name grammar) goes into the subject so that
    /// operators can tell clusters' CAs apart.
    pub fn init(cluster_name: &str, lifetime: Duration) -> Result<Self> {
        crate::identity::validate_name(cluster_name)?;
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?;
        let mut params = CertificateParams::default();
        let mut dn = DistinguishedName::new();
        dn.push(
            DnType::CommonName,
            format!("starling cluster CA {cluster_name}"),
        );
        dn.push(DnType::OrganizationName, "starling");
        params.distinguished_name = dn;
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        params.serial_number = Some(random_serial()?);
        let validity = Validity::starting_now(lifetime);
        params.not_before = validity.not_before.into();
        params.not_after = validity.not_after.into();
        let cert = params.self_signed(&key)?;
        // Go through the same path as a CA loaded from disk, so that what is tested after
        // `init` is what runs after a restart.
        ClusterCa::from_pem(&cert.pem(), &key.serialize_pem())
    }

    /// Loads `ca.crt` and `ca.key` from `dir`.
    pub fn load(dir: &Path) -> Result<Self> {
        let cert_path = dir.join(CA_CERT_FILE);
        let key_path = dir.join(CA_KEY_FILE);
        let cert_pem = files::read_string(&cert_path)?;
        let key_pem = files::read_string(&key_path)?;
        ClusterCa::from_pem(&cert_pem, &key_pem).map_err(|e| match e {
            Error::BadInput { what, reason } => Error::BadInput {
                what,
                reason: format!("{}: {reason}", dir.display()),
            },
            other => other,
        })
    }

    /// A CA from its certificate and key (PEM). The key must belong to the certificate
    /// and the certificate must be a CA.
    pub fn from_pem(cert_pem: &str, key_pem: &str) -> Result<Self> {
        let cert_der = CertificateDer::from_pem_slice(cert_pem.as_bytes())
            .map_err(|e| Error::bad("CA certificate PEM", e))?;
        let key = KeyPair::from_pem(key_pem).map_err(|e| Error::bad("CA key PEM", e))?;
        let (not_after, spki_matches) = {
            let cert = parse_cert(&cert_der)?;
            if !cert.is_ca() {
                return Err(Error::bad("CA certificate", "not a CA certificate"));
            }
            (
                crate::identity::unix_to_system(cert.validity().not_after.timestamp()),
                cert.tbs_certificate.subject_pki.raw == key.public_key_der().as_slice(),
            )
        };
        if !spki_matches {
            return Err(Error::bad(
                "CA key",
                "does not belong to the CA certificate",
            ));
        }
        let params = CertificateParams::from_ca_cert_der(&cert_der)?;
        // Re-signing produces a different DER, but signing only reads the subject name,
        // key identifier and key usages from it, all taken from the original.
        let issuer = params.self_signed(&key)?;
        Ok(ClusterCa {
            key,
            issuer,
            cert_pem: der_to_pem("CERTIFICATE", &cert_der),
            cert_der,
            not_after,
        })
    }

    /// Writes `ca.crt` (0644) and `ca.key` (0600) into `dir` (created 0700 if missing).
    /// Refuses to overwrite either file.
    pub fn save(&self, dir: &Path) -> Result<()> {
        files::ensure_dir(dir)?;
        let key_path = dir.join(CA_KEY_FILE);
        let cert_path = dir.join(CA_CERT_FILE);
        if cert_path.exists() {
            return Err(Error::AlreadyExists { path: cert_path });
        }
        files::write_new(
            &key_path,
            self.key.serialize_pem().as_bytes(),
            files::SECRET_MODE,
        )?;
        files::write_new(&cert_path, self.cert_pem.as_bytes(), files::PUBLIC_MODE)
    }

    /// The CA certificate (DER).
    pub fn cert_der(&self) -> &CertificateDer<'static> {
        &self.cert_der
    }

    /// The CA certificate (PEM), the contents of `ca.crt`.
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// The pin joining nodes check the CA against.
    pub fn pin(&self) -> CaPin {
        // `from_pem` checked that this is byte for byte the certificate's
        // SubjectPublicKeyInfo, which is what joining nodes hash.
        CaPin::of_spki(&self.key.public_key_der())
    }

    /// A trust store holding just this CA.
    pub fn trust(&self) -> Result<ClusterTrust> {
        ClusterTrust::from_der(vec![self.cert_der.clone()])
    }

    /// Issues a certificate with a freshly generated ECDSA P-256 key.
    pub fn issue(&self, request: &CertRequest) -> Result<IssuedCert> {
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?;
        let mut issued = self.sign(request, &key)?;
        issued.key_pem = Some(key.serialize_pem());
        Ok(issued)
    }

    /// Signs a CSR (PEM). Only the CSR's public key is used: its signature is checked
    /// (proof that the requester holds the key), its subject and requested extensions are
    /// ignored, and the identity, SANs and validity come from `request`, which the tracker
    /// derives from the bootstrap token or the authenticated connection. Accepted keys:
    /// ECDSA P-256, ECDSA P-384, Ed25519.
    pub fn sign_csr(&self, csr_pem: &str, request: &CertRequest) -> Result<IssuedCert> {
        let csr_der = CertificateSigningRequestDer::from_pem_slice(csr_pem.as_bytes())
            .map_err(|e| Error::bad("CSR PEM", e))?;
        let public_key = csr_public_key(csr_der.as_ref())?;
        self.sign(request, &public_key)
    }

    fn sign(&self, request: &CertRequest, public_key: &impl PublicKeyData) -> Result<IssuedCert> {
        if request.validity.not_after > self.not_after {
            return Err(Error::bad(
                "validity",
                "the certificate would outlive the CA; renew the CA first",
            ));
        }
        let params = request.to_params(random_serial()?)?;
        let cert = params.signed_by(public_key, &self.issuer, &self.key)?;
        let cert_der = cert.der().clone();
        let info = CertInfo::from_der(&cert_der)?;
        Ok(IssuedCert {
            cert_pem: der_to_pem("CERTIFICATE", &cert_der),
            cert_der,
            ca_pem: self.cert_pem.clone(),
            key_pem: None,
            info,
        })
    }
}

impl fmt::Debug for ClusterCa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClusterCa")
            .field("pin", &self.pin())
            .field("not_after", &self.not_after)
            .finish_non_exhaustive()
    }
}

/// Verifies a CSR's signature and returns its public key.
fn csr_public_key(der: &[u8]) -> Result<rcgen::SubjectPublicKeyInfo> {
    let (rest, csr) = X509CertificationRequest::from_der(der).map_err(|e| Error::bad("CSR", e))?;
    if !rest.is_empty() {
        return Err(Error::bad("CSR", "trailing bytes after the DER"));
    }
    csr.verify_signature()
        .map_err(|e| Error::bad("CSR", format!("signature does not verify: {e}")))?;
    let spki =
        rcgen::SubjectPublicKeyInfo::from_der(csr.certification_request_info.subject_pki.raw)
            .map_err(|e| Error::bad("CSR public key", e))?;
    let alg = spki.algorithm();
    let allowed = [
        &rcgen::PKCS_ECDSA_P256_SHA256,
        &rcgen::PKCS_ECDSA_P384_SHA384,
        &rcgen::PKCS_ED25519,
    ];
    if !allowed.contains(&alg) {
        return Err(Error::bad(
            "CSR public key",
            "unsupported key type (ECDSA P-256/P-384 or Ed25519 required)",
        ));
    }
    Ok(spki)
}

/// 127 random bits, positive and without a leading zero byte (RFC 5280 wants serials
/// unique and at most 20 bytes; random ones need no state in the CA).
fn random_serial() -> Result<SerialNumber> {
    let mut bytes = [0u8; 16];
    ring::rand::SystemRandom::new()
        .fill(&mut bytes)
        .map_err(|_| Error::Rng)?;
    bytes[0] = (bytes[0] & 0x7f).max(1);
    Ok(SerialNumber::from_slice(&bytes))
}

/// A new ECDSA P-256 key and a CSR for `identity` (PEM, PEM). The CSR names the identity
/// in its subject and SAN for the tracker's logs, but the tracker decides the identity of
/// the certificate it signs.
pub fn generate_csr(identity: &Identity) -> Result<(String, String)> {
    let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?;
    let mut params = CertificateParams::default();
    let uri = identity.to_uri();
    params.subject_alt_names = vec![SanType::URI(
        uri.clone()
            .try_into()
            .map_err(|e| Error::bad("identity", e))?,
    )];
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, uri);
    params.distinguished_name = dn;
    let csr = params.serialize_request(&key)?;
    Ok((key.serialize_pem(), csr.pem()?))
}

/// [`generate_csr`] for `starling:node:<name>`: what an agent runs before joining or
/// renewing.
pub fn generate_node_csr(name: &str) -> Result<(String, String)> {
    generate_csr(&Identity::node(name)?)
}

#[cfg(test)]
#[path = "ca_tests.rs"]
mod tests;
