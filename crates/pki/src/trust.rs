//! What a process trusts: the cluster CA certificate(s), and the pin that lets a joining
//! node recognise the CA before it has a copy.

use std::fmt;
use std::path::Path;
use std::str::FromStr;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;
use rustls::RootCertStore;

use crate::error::{Error, Result};
use crate::files;
use crate::identity::parse_cert;

/// The SHA-256 of a CA certificate's DER SubjectPublicKeyInfo, written `sha256:<hex>`.
///
/// Same construction as kubeadm's `--discovery-token-ca-cert-hash`: it names the CA's
/// key, not the certificate, so re-issuing the CA certificate with the same key (to
/// extend it) keeps the pin valid, and `openssl x509 -pubkey | openssl pkey -pubin
/// -outform der | sha256sum` computes the same value.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct CaPin([u8; 32]);

impl CaPin {
    /// The pin of a DER SubjectPublicKeyInfo.
    pub fn of_spki(spki_der: &[u8]) -> Self {
        let digest = ring::digest::digest(&ring::digest::SHA256, spki_der);
        let mut pin = [0u8; 32];
        pin.copy_from_slice(digest.as_ref());
        CaPin(pin)
    }

    /// The pin of a certificate (DER).
    pub fn of_cert_der(der: &[u8]) -> Result<Self> {
        let cert = parse_cert(der)?;
        Ok(CaPin::of_spki(cert.tbs_certificate.subject_pki.raw))
    }

    /// The pin of the first certificate in a PEM text.
    pub fn of_cert_pem(pem: &str) -> Result<Self> {
        let der = CertificateDer::from_pem_slice(pem.as_bytes())
            .map_err(|e| Error::bad("certificate PEM", e))?;
        CaPin::of_cert_der(&der)
    }

    /// Whether `der` is a certificate for the pinned key. Unparseable input is no match.
    pub fn matches_cert_der(&self, der: &[u8]) -> bool {
        CaPin::of_cert_der(der).is_ok_and(|pin| pin == *self)
    }

    /// The 32 digest bytes.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

impl fmt::Display for CaPin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sha256:{}", hex::encode(self.0))
    }
}

impl fmt::Debug for CaPin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CaPin({self})")
    }
}

impl FromStr for CaPin {
    type Err = Error;

    /// Accepts `sha256:` followed by 64 hex digits (either case).
    fn from_str(s: &str) -> Result<Self> {
        let hex_part = s
            .strip_prefix("sha256:")
            .ok_or_else(|| Error::bad("CA pin", "expected sha256:<64 hex digits>"))?;
        if hex_part.len() != 64 {
            return Err(Error::bad("CA pin", "expected 64 hex digits after sha256:"));
        }
        let mut pin = [0u8; 32];
        hex::decode_to_slice(hex_part, &mut pin).map_err(|e| Error::bad("CA pin", e))?;
        Ok(CaPin(pin))
    }
}

/// The CA certificates this process accepts as the cluster's roots. Usually one; two
/// while a CA is being replaced (old and new concatenated in `ca.crt`).
#[derive(Clone)]
pub struct ClusterTrust {
    certs: Vec<CertificateDer<'static>>,
    roots: Arc<RootCertStore>,
}

impl ClusterTrust {
    /// Trusts the given CA certificates. Each must be a CA certificate
    /// (basicConstraints CA:TRUE): a leaf in a CA bundle is a configuration mistake that
    /// would otherwise fail later, and less clearly.
    pub fn from_der(certs: Vec<CertificateDer<'static>>) -> Result<Self> {
        if certs.is_empty() {
            return Err(Error::bad("CA bundle", "no certificate in it"));
        }
        let mut roots = RootCertStore::empty();
        for der in &certs {
            let cert = parse_cert(der)?;
            if !cert.is_ca() {
                return Err(Error::bad("CA bundle", "a certificate in it is not a CA"));
            }
            roots
                .add(der.clone())
                .map_err(|e| Error::bad("CA certificate", e))?;
        }
        Ok(ClusterTrust {
            certs,
            roots: Arc::new(roots),
        })
    }

    /// Trusts every certificate in a PEM text (the contents of `ca.crt`).
    pub fn from_pem(pem: &str) -> Result<Self> {
        let certs = CertificateDer::pem_slice_iter(pem.as_bytes())
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| Error::bad("CA PEM", e))?;
        ClusterTrust::from_der(certs)
    }

    /// Reads `ca.crt` (or any PEM bundle of CA certificates).
    pub fn from_file(path: &Path) -> Result<Self> {
        let pem = files::read_string(path)?;
        ClusterTrust::from_pem(&pem).map_err(|e| match e {
            Error::BadInput { what, reason } => Error::BadInput {
                what,
                reason: format!("{}: {reason}", path.display()),
            },
            other => other,
        })
    }

    /// The CA certificates.
    pub fn certs(&self) -> &[CertificateDer<'static>] {
        &self.certs
    }

    /// The pins of the CA certificates, in order.
    pub fn pins(&self) -> Vec<CaPin> {
        // Every certificate parsed in the constructor, so none is skipped here.
        self.certs
            .iter()
            .filter_map(|der| CaPin::of_cert_der(der).ok())
            .collect()
    }

    /// The root store rustls verifies against.
    pub fn roots(&self) -> Arc<RootCertStore> {
        Arc::clone(&self.roots)
    }

    /// The bundle as PEM, e.g. to save the CA learned during a pinned bootstrap.
    pub fn to_pem(&self) -> String {
        self.certs
            .iter()
            .map(|der| der_to_pem("CERTIFICATE", der))
            .collect()
    }
}

impl fmt::Debug for ClusterTrust {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClusterTrust")
            .field("pins", &self.pins())
            .finish()
    }
}

pub(crate) fn der_to_pem(label: &str, der: &[u8]) -> String {
    use base64::Engine;
    let body = base64::engine::general_purpose::STANDARD.encode(der);
    let mut pem = format!("-----BEGIN {label}-----\n");
    for line in body.as_bytes().chunks(64) {
        // Base64 output is ASCII, so every chunk is valid UTF-8.
        pem.push_str(std::str::from_utf8(line).unwrap_or_default());
        pem.push('\n');
    }
    pem.push_str(&format!("-----END {label}-----\n"));
    pem
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pin_text_round_trip() {
        let pin = CaPin::of_spki(b"some key");
        let text = pin.to_string();
        assert!(text.starts_with("sha256:"));
        assert_eq!(text.len(), 7 + 64);
        assert_eq!(text.parse::<CaPin>().expect("parses"), pin);
        assert_eq!(
            text.to_uppercase()
                .replace("SHA256", "sha256")
                .parse::<CaPin>()
                .expect("upper hex"),
            pin
        );
    }

    #[test]
    fn malformed_pins_are_refused() {
        let good = CaPin::of_spki(b"k").to_string();
        for bad in [
            "",
            "sha256:",
            &good[7..],
            &good.replace("sha256:", "sha1:"),
            &good[..good.len() - 1],
            &format!("{good}0"),
            &good.replace(&good[7..9], "zz"),
        ] {
            assert!(
                matches!(bad.parse::<CaPin>(), Err(Error::BadInput { .. })),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn empty_or_garbage_bundles_are_refused() {
        assert!(ClusterTrust::from_pem("").is_err());
        assert!(ClusterTrust::from_pem(
            "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n"
        )
        .is_err());
        assert!(ClusterTrust::from_der(vec![]).is_err());
        assert!(CaPin::of_cert_pem("nothing here").is_err());
    }

    #[test]
    fn pem_encoding_wraps_at_64() {
        let pem = der_to_pem("CERTIFICATE", &[7u8; 100]);
        let lines: Vec<&str> = pem.lines().collect();
        assert_eq!(lines[0], "-----BEGIN CERTIFICATE-----");
        assert_eq!(lines[1].len(), 64);
        assert_eq!(lines.last().copied(), Some("-----END CERTIFICATE-----"));
        let back = CertificateDer::from_pem_slice(pem.as_bytes()).expect("decodes");
        assert_eq!(back.as_ref(), &[7u8; 100]);
    }
}
