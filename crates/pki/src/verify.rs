//! rustls certificate verifiers that add Starling's identity checks on top of the usual
//! webpki chain and validity checks. The chain check always runs first: an identity read
//! from a certificate the CA did not sign means nothing.

use std::fmt;
use std::sync::{Arc, Mutex};

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{verify_tls12_signature, verify_tls13_signature, CryptoProvider};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::{ParsedCertificate, WebPkiClientVerifier};
use rustls::{DigitallySignedStruct, DistinguishedName, RootCertStore, SignatureScheme};

use crate::error::Error;
use crate::identity::{Identity, Role};
use crate::trust::CaPin;

/// Verifies a server that must be one particular Starling identity (a peer agent,
/// `starling:node:<name>`), regardless of the host name or address that was dialled:
/// peers are known by node name, and a node's address can change or be shared.
pub(crate) struct IdentityServerVerifier {
    roots: Arc<RootCertStore>,
    expected: Identity,
    provider: Arc<CryptoProvider>,
}

impl IdentityServerVerifier {
    pub(crate) fn new(
        roots: Arc<RootCertStore>,
        expected: Identity,
        provider: Arc<CryptoProvider>,
    ) -> Self {
        IdentityServerVerifier {
            roots,
            expected,
            provider,
        }
    }
}

impl fmt::Debug for IdentityServerVerifier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdentityServerVerifier")
            .field("expected", &self.expected.to_uri())
            .finish_non_exhaustive()
    }
}

impl ServerCertVerifier for IdentityServerVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let parsed = ParsedCertificate::try_from(end_entity)?;
        rustls::client::verify_server_cert_signed_by_trust_anchor(
            &parsed,
            &self.roots,
            intermediates,
            now,
            self.provider.signature_verification_algorithms.all,
        )?;
        let found = Identity::from_cert_der(end_entity).map_err(Error::into_certificate_error)?;
        if found != self.expected {
            return Err(Error::WrongIdentity {
                expected: self.expected.to_uri(),
                found: found.to_uri(),
            }
            .into_certificate_error());
        }
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// First contact with the tracker: trusts exactly the CA whose key matches the pin, taken
/// from the certificates the tracker sends, then verifies the tracker's certificate
/// against it with ordinary host name checks. The CA found is kept so that the joining
/// agent can save it as its `ca.crt`.
pub(crate) struct PinnedCaVerifier {
    pin: CaPin,
    provider: Arc<CryptoProvider>,
    learned: Arc<Mutex<Option<CertificateDer<'static>>>>,
}

impl PinnedCaVerifier {
    pub(crate) fn new(
        pin: CaPin,
        provider: Arc<CryptoProvider>,
        learned: Arc<Mutex<Option<CertificateDer<'static>>>>,
    ) -> Self {
        PinnedCaVerifier {
            pin,
            provider,
            learned,
        }
    }
}

impl fmt::Debug for PinnedCaVerifier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PinnedCaVerifier")
            .field("pin", &self.pin)
            .finish_non_exhaustive()
    }
}

impl ServerCertVerifier for PinnedCaVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let pin_mismatch = || {
            Error::PinMismatch {
                pin: self.pin.to_string(),
            }
            .into_certificate_error()
        };
        let ca = intermediates
            .iter()
            .find(|der| self.pin.matches_cert_der(der))
            .ok_or_else(pin_mismatch)?;
        let mut roots = RootCertStore::empty();
        roots
            .add(ca.clone().into_owned())
            .map_err(|_| pin_mismatch())?;
        let others: Vec<CertificateDer<'_>> = intermediates
            .iter()
            .filter(|der| !self.pin.matches_cert_der(der))
            .cloned()
            .collect();
        let parsed = ParsedCertificate::try_from(end_entity)?;
        rustls::client::verify_server_cert_signed_by_trust_anchor(
            &parsed,
            &roots,
            &others,
            now,
            self.provider.signature_verification_algorithms.all,
        )?;
        rustls::client::verify_server_name(&parsed, server_name)?;
        if let Ok(mut learned) = self.learned.lock() {
            *learned = Some(ca.clone().into_owned());
        }
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// Client certificates: webpki chain to the cluster CA and validity, then a readable
/// Starling identity whose role is one of `allowed`.
pub(crate) struct RoleClientVerifier {
    inner: Arc<dyn ClientCertVerifier>,
    allowed: Vec<Role>,
    mandatory: bool,
}

impl RoleClientVerifier {
    pub(crate) fn new(
        roots: Arc<RootCertStore>,
        allowed: &[Role],
        mandatory: bool,
        provider: Arc<CryptoProvider>,
    ) -> Result<Self, Error> {
        let builder = WebPkiClientVerifier::builder_with_provider(roots, provider);
        let builder = if mandatory {
            builder
        } else {
            builder.allow_unauthenticated()
        };
        let inner = builder
            .build()
            .map_err(|e| Error::bad("client verifier", e))?;
        Ok(RoleClientVerifier {
            inner,
            allowed: allowed.to_vec(),
            mandatory,
        })
    }

    fn allowed_list(&self) -> String {
        self.allowed
            .iter()
            .map(|r| r.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    }
}

impl fmt::Debug for RoleClientVerifier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RoleClientVerifier")
            .field("allowed", &self.allowed)
            .field("mandatory", &self.mandatory)
            .finish_non_exhaustive()
    }
}

impl ClientCertVerifier for RoleClientVerifier {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        self.mandatory
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        self.inner.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        self.inner
            .verify_client_cert(end_entity, intermediates, now)?;
        let identity =
            Identity::from_cert_der(end_entity).map_err(Error::into_certificate_error)?;
        if !self.allowed.contains(&identity.role()) {
            return Err(Error::WrongRole {
                found: identity.role(),
                allowed: self.allowed_list(),
            }
            .into_certificate_error());
        }
        Ok(ClientCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::ca::{CertRequest, ClusterCa, IssuedCert, DEFAULT_CA_LIFETIME};
    use crate::config::provider;

    fn ca() -> ClusterCa {
        ClusterCa::init("test", DEFAULT_CA_LIFETIME).expect("CA")
    }

    fn issue(ca: &ClusterCa, request: CertRequest) -> IssuedCert {
        ca.issue(&request).expect("issue")
    }

    fn node(ca: &ClusterCa, name: &str) -> IssuedCert {
        issue(ca, CertRequest::new(Identity::node(name).expect("name")))
    }

    fn later(days: u64) -> UnixTime {
        UnixTime::since_unix_epoch(Duration::from_secs(
            UnixTime::now().as_secs() + days * 24 * 3600,
        ))
    }

    fn any_name() -> ServerName<'static> {
        ServerName::try_from("ignored.example").expect("name")
    }

    fn classify<T>(result: Result<T, rustls::Error>) -> Error {
        match result {
            Ok(_) => panic!("expected a refusal"),
            Err(e) => Error::from(e),
        }
    }

    #[test]
    fn identity_server_verifier() {
        let ca = ca();
        let other = super::tests::ca();
        let roots = ca.trust().expect("trust").roots();
        let verifier =
            IdentityServerVerifier::new(roots, Identity::node("a").expect("name"), provider());
        let a = node(&ca, "a");
        let verify = |cert: &IssuedCert, now| {
            verifier.verify_server_cert(cert.cert_der(), &[], &any_name(), &[], now)
        };
        assert!(verify(&a, UnixTime::now()).is_ok());
        assert!(matches!(
            classify(verify(&node(&ca, "b"), UnixTime::now())),
            Error::WrongIdentity { .. }
        ));
        assert!(matches!(
            classify(verify(&node(&other, "a"), UnixTime::now())),
            Error::UnknownCa
        ));
        // Past its 24 h.
        assert!(matches!(classify(verify(&a, later(2))), Error::Expired));
        // Same name, wrong role.
        let tracker_a = issue(&ca, CertRequest::new(Identity::tracker("a").expect("name")));
        assert!(matches!(
            classify(verify(&tracker_a, UnixTime::now())),
            Error::WrongIdentity { .. }
        ));
        // An operator certificate cannot act as a server at all (EKU).
        let operator_a = issue(
            &ca,
            CertRequest::new(Identity::operator("a").expect("name")),
        );
        assert!(verify(&operator_a, UnixTime::now()).is_err());
    }

    #[test]
    fn role_client_verifier() {
        let ca = ca();
        let roots = ca.trust().expect("trust").roots();
        let nodes_only =
            RoleClientVerifier::new(Arc::clone(&roots), &[Role::Node], true, provider())
                .expect("verifier");
        assert!(nodes_only.client_auth_mandatory() && nodes_only.offer_client_auth());
        let verify = |v: &RoleClientVerifier, cert: &IssuedCert, now| {
            v.verify_client_cert(cert.cert_der(), &[], now)
        };
        assert!(verify(&nodes_only, &node(&ca, "a"), UnixTime::now()).is_ok());
        let viewer = issue(&ca, CertRequest::new(Identity::viewer("v").expect("name")));
        assert!(matches!(
            classify(verify(&nodes_only, &viewer, UnixTime::now())),
            Error::WrongRole {
                found: Role::Viewer,
                ..
            }
        ));
        assert!(matches!(
            classify(verify(&nodes_only, &node(&ca, "a"), later(2))),
            Error::Expired
        ));
        assert!(matches!(
            classify(verify(
                &nodes_only,
                &node(&super::tests::ca(), "a"),
                UnixTime::now()
            )),
            Error::UnknownCa
        ));

        let optional =
            RoleClientVerifier::new(roots, &[Role::Node, Role::Viewer], false, provider())
                .expect("verifier");
        assert!(!optional.client_auth_mandatory() && optional.offer_client_auth());
        assert!(verify(&optional, &viewer, UnixTime::now()).is_ok());
    }

    #[test]
    fn pinned_ca_verifier() {
        let ca = ca();
        let tracker = issue(
            &ca,
            CertRequest::new(Identity::tracker("t").expect("name")).dns_name("tracker.test"),
        );
        let chain = [ca.cert_der().clone()];
        let name = ServerName::try_from("tracker.test").expect("name");

        let learned = Arc::new(Mutex::new(None));
        let verifier = PinnedCaVerifier::new(ca.pin(), provider(), Arc::clone(&learned));
        assert!(verifier
            .verify_server_cert(tracker.cert_der(), &chain, &name, &[], UnixTime::now())
            .is_ok());
        assert_eq!(learned.lock().expect("lock").as_ref(), Some(ca.cert_der()));

        let fresh = Arc::new(Mutex::new(None));
        let wrong_pin =
            PinnedCaVerifier::new(super::tests::ca().pin(), provider(), Arc::clone(&fresh));
        assert!(matches!(
            classify(wrong_pin.verify_server_cert(
                tracker.cert_der(),
                &chain,
                &name,
                &[],
                UnixTime::now()
            )),
            Error::PinMismatch { .. }
        ));
        let other_name = ServerName::try_from("other.test").expect("name");
        let verifier = PinnedCaVerifier::new(ca.pin(), provider(), Arc::clone(&fresh));
        assert!(matches!(
            classify(verifier.verify_server_cert(
                tracker.cert_der(),
                &chain,
                &other_name,
                &[],
                UnixTime::now()
            )),
            Error::WrongName(_)
        ));
        assert!(matches!(
            classify(verifier.verify_server_cert(
                tracker.cert_der(),
                &chain,
                &name,
                &[],
                later(400)
            )),
            Error::Expired
        ));
        assert!(
            fresh.lock().expect("lock").is_none(),
            "nothing learned from refusals"
        );
    }
}
