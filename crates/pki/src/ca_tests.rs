use std::os::unix::fs::PermissionsExt;

use rustls::pki_types::UnixTime;
use rustls::server::ParsedCertificate;

use super::*;

fn ca() -> ClusterCa {
    ClusterCa::init("test", DEFAULT_CA_LIFETIME).expect("CA")
}

/// Chain validation the way the TLS layer does it (webpki, EKU serverAuth).
fn chains_to(cert: &CertificateDer<'_>, trust: &ClusterTrust) -> Result<(), rustls::Error> {
    let parsed = ParsedCertificate::try_from(cert)?;
    rustls::client::verify_server_cert_signed_by_trust_anchor(
        &parsed,
        &trust.roots(),
        &[],
        UnixTime::now(),
        rustls::crypto::ring::default_provider()
            .signature_verification_algorithms
            .all,
    )
}

fn mode(path: &Path) -> u32 {
    std::fs::metadata(path).expect("stat").permissions().mode() & 0o777
}

#[test]
fn init_save_load_round_trip() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pki = dir.path().join("pki");
    let ca = ca();
    ca.save(&pki).expect("save");
    assert_eq!(mode(&pki.join(CA_KEY_FILE)), 0o600);
    assert_eq!(mode(&pki.join(CA_CERT_FILE)), 0o644);
    assert_eq!(mode(&pki), 0o700);

    let loaded = ClusterCa::load(&pki).expect("load");
    assert_eq!(loaded.cert_der(), ca.cert_der());
    assert_eq!(loaded.pin(), ca.pin());
    assert_eq!(ca.pin(), CaPin::of_cert_der(ca.cert_der()).expect("pin"));
    assert_eq!(ca.pin(), CaPin::of_cert_pem(ca.cert_pem()).expect("pin"));

    // A certificate issued by the reloaded CA chains to the original certificate: the
    // subject name and key identifier survived the reload byte for byte.
    let issued = loaded
        .issue(&CertRequest::new(Identity::node("n1").expect("name")))
        .expect("issue");
    chains_to(issued.cert_der(), &ca.trust().expect("trust")).expect("chains");
}

#[test]
fn save_never_overwrites_a_ca() {
    let dir = tempfile::tempdir().expect("tempdir");
    ca().save(dir.path()).expect("first");
    let before = std::fs::read(dir.path().join(CA_KEY_FILE)).expect("read");
    assert!(matches!(
        ca().save(dir.path()),
        Err(Error::AlreadyExists { .. })
    ));
    assert_eq!(
        std::fs::read(dir.path().join(CA_KEY_FILE)).expect("read"),
        before
    );
}

#[test]
fn load_errors_name_the_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let err = ClusterCa::load(dir.path()).expect_err("nothing there");
    assert!(matches!(err, Error::Io { .. }));
    assert!(err.to_string().contains("ca.crt"), "{err}");
}

#[test]
fn from_pem_refuses_a_foreign_key_and_a_leaf() {
    let a = ca();
    let b = ca();
    let b_key = b.key.serialize_pem();
    assert!(matches!(
        ClusterCa::from_pem(a.cert_pem(), &b_key),
        Err(Error::BadInput { what: "CA key", .. })
    ));
    let leaf = a
        .issue(&CertRequest::new(Identity::node("n1").expect("name")))
        .expect("issue");
    let leaf_key = leaf.key_pem().expect("key");
    assert!(matches!(
        ClusterCa::from_pem(leaf.cert_pem(), leaf_key),
        Err(Error::BadInput {
            what: "CA certificate",
            ..
        })
    ));
    assert!(ClusterCa::from_pem("garbage", &b_key).is_err());
    assert!(ClusterCa::from_pem(a.cert_pem(), "garbage").is_err());
}

#[test]
fn issued_node_certificate_carries_identity_sans_and_default_lifetime() {
    let ca = ca();
    let ip: IpAddr = "10.1.2.3".parse().expect("ip");
    let request = CertRequest::new(Identity::node("gpu-017").expect("name"))
        .dns_name("gpu-017.cluster.local")
        .ip_address(ip);
    let issued = ca.issue(&request).expect("issue");
    let info = issued.info();
    assert_eq!(info.identity, Identity::node("gpu-017").expect("name"));
    assert_eq!(info.dns_names, vec!["gpu-017.cluster.local".to_owned()]);
    assert_eq!(info.ip_addresses, vec![ip]);
    let lifetime = info.lifetime();
    assert!(
        lifetime >= DEFAULT_NODE_LIFETIME
            && lifetime <= DEFAULT_NODE_LIFETIME + CLOCK_SKEW_ALLOWANCE + Duration::from_secs(2),
        "{lifetime:?}"
    );
    assert!(info.not_before <= SystemTime::now() - Duration::from_secs(60));
    assert_eq!(
        Identity::from_cert_der(issued.cert_der()).expect("id"),
        info.identity
    );
    assert!(issued.key_pem().is_some_and(|k| k.contains("PRIVATE KEY")));
    assert!(issued.chain_pem().ends_with(ca.cert_pem()));
    chains_to(issued.cert_der(), &ca.trust().expect("trust")).expect("chains");
}

#[test]
fn default_lifetimes_per_role() {
    let ca = ca();
    for (role, expected) in [
        (Role::Operator, DEFAULT_USER_LIFETIME),
        (Role::Viewer, DEFAULT_USER_LIFETIME),
        (Role::Tracker, DEFAULT_TRACKER_LIFETIME),
    ] {
        let issued = ca
            .issue(&CertRequest::new(Identity::new(role, "x").expect("name")))
            .expect("issue");
        let lifetime = issued.info().lifetime();
        assert!(
            lifetime >= expected
                && lifetime <= expected + CLOCK_SKEW_ALLOWANCE + Duration::from_secs(2),
            "{role}: {lifetime:?}"
        );
    }
}

#[test]
fn operator_certificates_cannot_serve_tls() {
    // EKU clientAuth only: the webpki server check refuses it even though the CA signed it.
    let ca = ca();
    let issued = ca
        .issue(&CertRequest::new(
            Identity::operator("alice").expect("name"),
        ))
        .expect("issue");
    let err = chains_to(issued.cert_der(), &ca.trust().expect("trust")).expect_err("no serverAuth");
    assert!(
        format!("{err:?}").contains("Usage") || format!("{err:?}").contains("Purpose"),
        "{err:?}"
    );
}

#[test]
fn host_sans_only_for_nodes_and_trackers() {
    let ca = ca();
    let viewer = CertRequest::new(Identity::viewer("bob").expect("name")).dns_name("bob.example");
    assert!(matches!(ca.issue(&viewer), Err(Error::BadInput { .. })));
    let bad_dns = CertRequest::new(Identity::tracker("t").expect("name")).dns_name("Not_A_Host");
    assert!(matches!(ca.issue(&bad_dns), Err(Error::InvalidName { .. })));
    let tracker = CertRequest::new(Identity::tracker("t").expect("name"))
        .dns_name("tracker.starling.svc")
        .ip_address("127.0.0.1".parse().expect("ip"));
    assert!(ca.issue(&tracker).is_ok());
}

#[test]
fn validity_is_checked() {
    let now = SystemTime::now();
    assert!(Validity::between(now, now).is_err());
    assert!(Validity::between(now, now - Duration::from_secs(1)).is_err());
    let ca = ca();
    let too_long =
        CertRequest::new(Identity::node("n").expect("name")).lifetime(DEFAULT_CA_LIFETIME + DAY);
    assert!(matches!(
        ca.issue(&too_long),
        Err(Error::BadInput {
            what: "validity",
            ..
        })
    ));
    // Expired certificates can be issued on purpose (tests of the refusal paths).
    let past = Validity::between(now - 3 * DAY, now - DAY).expect("valid range");
    let expired = ca
        .issue(&CertRequest::new(Identity::node("n").expect("name")).validity(past))
        .expect("issue");
    assert!(expired.info().not_after < now);
}

#[test]
fn serials_are_random_and_positive() {
    let ca = ca();
    let request = CertRequest::new(Identity::node("n").expect("name"));
    let a = ca.issue(&request).expect("issue");
    let b = ca.issue(&request).expect("issue");
    assert_ne!(a.info().serial, b.info().serial);
    for issued in [&a, &b] {
        assert_eq!(issued.info().serial.len(), 16);
        assert!(issued.info().serial[0] & 0x80 == 0 && issued.info().serial[0] != 0);
    }
}

#[test]
fn csr_contributes_only_its_key() {
    let ca = ca();
    let (key_pem, csr_pem) = generate_node_csr("evil-wants-this-name").expect("csr");
    let request = CertRequest::new(Identity::node("gpu-3").expect("name"));
    let issued = ca.sign_csr(&csr_pem, &request).expect("sign");
    assert_eq!(
        issued.info().identity,
        Identity::node("gpu-3").expect("name")
    );
    assert!(issued.key_pem().is_none());
    // The certificate carries the requester's key.
    let key = KeyPair::from_pem(&key_pem).expect("key");
    let cert = parse_cert(issued.cert_der()).expect("parse");
    assert_eq!(
        cert.tbs_certificate.subject_pki.raw,
        key.public_key_der().as_slice()
    );
    chains_to(issued.cert_der(), &ca.trust().expect("trust")).expect("chains");
}

#[test]
fn csr_extensions_are_ignored_not_copied() {
    // A CSR asking for extra host names, code signing and an unknown extension: the
    // signature is fine, so it is signed, but none of what it asks for is granted.
    let ca = ca();
    let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).expect("key");
    let mut params = CertificateParams::new(vec!["evil.example".to_owned()]).expect("params");
    params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::CodeSigning];
    params
        .custom_extensions
        .push(rcgen::CustomExtension::from_oid_content(
            &[1, 2, 3, 4],
            vec![0x05, 0x00],
        ));
    let csr = params
        .serialize_request(&key)
        .expect("csr")
        .pem()
        .expect("pem");
    let issued = ca
        .sign_csr(&csr, &CertRequest::new(Identity::node("n1").expect("name")))
        .expect("sign");
    assert!(issued.info().dns_names.is_empty());
    let cert = parse_cert(issued.cert_der()).expect("parse");
    assert!(!cert.is_ca());
    assert!(cert
        .extensions()
        .iter()
        .all(|e| e.oid.to_id_string() != "1.2.3.4"));
    let eku = cert
        .extended_key_usage()
        .expect("eku")
        .expect("present")
        .value;
    assert!(!eku.code_signing && eku.server_auth && eku.client_auth);
}

#[test]
fn csr_for_another_role_still_yields_the_callers_identity() {
    let ca = ca();
    let (_key, csr) = generate_csr(&Identity::operator("root").expect("name")).expect("csr");
    let issued = ca
        .sign_csr(&csr, &CertRequest::new(Identity::node("n7").expect("name")))
        .expect("sign");
    assert_eq!(issued.info().identity.role(), Role::Node);
}

#[test]
fn csr_with_a_bad_signature_is_refused() {
    let ca = ca();
    let (_key, csr_pem) = generate_node_csr("n1").expect("csr");
    let mut der = CertificateSigningRequestDer::from_pem_slice(csr_pem.as_bytes())
        .expect("pem")
        .as_ref()
        .to_vec();
    let last = der.len() - 1;
    der[last] ^= 0x01;
    let tampered = der_to_pem("CERTIFICATE REQUEST", &der);
    let err = ca
        .sign_csr(
            &tampered,
            &CertRequest::new(Identity::node("n1").expect("name")),
        )
        .expect_err("tampered");
    assert!(
        matches!(&err, Error::BadInput { what: "CSR", reason } if reason.contains("signature")),
        "{err}"
    );

    // The public key swapped for another one: the signature no longer matches it.
    let (_other_key, other_csr) = generate_node_csr("n1").expect("csr");
    let other_der = CertificateSigningRequestDer::from_pem_slice(other_csr.as_bytes())
        .expect("pem")
        .as_ref()
        .to_vec();
    let spki = |d: &[u8]| {
        X509CertificationRequest::from_der(d)
            .expect("csr")
            .1
            .certification_request_info
            .subject_pki
            .raw
            .to_vec()
    };
    let (mine, theirs) = (spki(&der), spki(&other_der));
    let original = CertificateSigningRequestDer::from_pem_slice(csr_pem.as_bytes())
        .expect("pem")
        .as_ref()
        .to_vec();
    let pos = original
        .windows(mine.len())
        .position(|w| w == mine.as_slice())
        .expect("spki inside");
    let mut swapped = original.clone();
    swapped[pos..pos + mine.len()].copy_from_slice(&theirs);
    let swapped = der_to_pem("CERTIFICATE REQUEST", &swapped);
    let err = ca
        .sign_csr(
            &swapped,
            &CertRequest::new(Identity::node("n1").expect("name")),
        )
        .expect_err("key swapped");
    assert!(
        matches!(&err, Error::BadInput { what: "CSR", reason } if reason.contains("signature")),
        "{err}"
    );
}

#[test]
fn csr_garbage_is_refused() {
    let ca = ca();
    let request = CertRequest::new(Identity::node("n1").expect("name"));
    for input in [
        "",
        "hello",
        "-----BEGIN CERTIFICATE REQUEST-----\nAAAA\n-----END CERTIFICATE REQUEST-----\n",
    ] {
        assert!(
            matches!(ca.sign_csr(input, &request), Err(Error::BadInput { .. })),
            "{input:?}"
        );
    }
    // A certificate is not a CSR.
    assert!(ca.sign_csr(ca.cert_pem(), &request).is_err());
}

#[test]
fn csr_keys_p384_and_ed25519_are_accepted() {
    let ca = ca();
    for alg in [&rcgen::PKCS_ECDSA_P384_SHA384, &rcgen::PKCS_ED25519] {
        let key = KeyPair::generate_for(alg).expect("key");
        let csr = CertificateParams::default()
            .serialize_request(&key)
            .expect("csr")
            .pem()
            .expect("pem");
        let issued = ca
            .sign_csr(&csr, &CertRequest::new(Identity::node("n").expect("name")))
            .expect("sign");
        let cert = parse_cert(issued.cert_der()).expect("parse");
        assert_eq!(
            cert.tbs_certificate.subject_pki.raw,
            key.public_key_der().as_slice()
        );
    }
}

#[test]
fn generate_node_csr_validates_the_name() {
    assert!(matches!(
        generate_node_csr("Bad Name"),
        Err(Error::InvalidName { .. })
    ));
    let (key, csr) = generate_node_csr("ok").expect("csr");
    assert!(key.contains("PRIVATE KEY"));
    assert!(csr.contains("CERTIFICATE REQUEST"));
}

#[test]
fn issued_cert_save_writes_chain_and_secret_key() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = ca();
    let issued = ca
        .issue(&CertRequest::new(Identity::node("n1").expect("name")))
        .expect("issue");
    let (cert_path, key_path) = issued.save(dir.path(), "node").expect("save");
    assert_eq!(mode(&key_path), 0o600);
    let chain = std::fs::read_to_string(&cert_path).expect("read");
    assert_eq!(CertificateDer::pem_slice_iter(chain.as_bytes()).count(), 2);
    assert!(!format!("{issued:?}").contains("PRIVATE"));
    // Saving again (renewal) replaces the files.
    let renewed = ca
        .issue(&CertRequest::new(Identity::node("n1").expect("name")))
        .expect("issue");
    renewed.save(dir.path(), "node").expect("save again");
    assert_eq!(
        std::fs::read_to_string(&cert_path).expect("read"),
        renewed.chain_pem()
    );
}

/// A self-signed certificate with the given URI SANs, to test identity extraction.
fn cert_with_uris(uris: &[&str]) -> CertificateDer<'static> {
    let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).expect("key");
    let mut params = CertificateParams::default();
    params.subject_alt_names = uris
        .iter()
        .map(|u| SanType::URI((*u).to_owned().try_into().expect("ia5")))
        .chain([SanType::DnsName(
            "host.example".to_owned().try_into().expect("dns"),
        )])
        .collect();
    params.self_signed(&key).expect("cert").der().clone()
}

#[test]
fn identity_needs_exactly_one_starling_san() {
    assert_eq!(
        Identity::from_cert_der(&cert_with_uris(&[
            "starling:node:a",
            "https://example.com/"
        ]))
        .expect("one"),
        Identity::node("a").expect("name")
    );
    assert!(matches!(
        Identity::from_cert_der(&cert_with_uris(&[])),
        Err(Error::NoIdentity)
    ));
    assert!(matches!(
        Identity::from_cert_der(&cert_with_uris(&["spiffe://cluster/ns/x"])),
        Err(Error::NoIdentity)
    ));
    assert!(matches!(
        Identity::from_cert_der(&cert_with_uris(&["starling:node:a", "starling:node:b"])),
        Err(Error::MultipleIdentities { count: 2 })
    ));
    // A second identity spelled with an upper-case scheme still counts.
    assert!(matches!(
        Identity::from_cert_der(&cert_with_uris(&["starling:node:a", "STARLING:operator:a"])),
        Err(Error::MultipleIdentities { count: 2 })
    ));
    // A malformed identity is not skipped in favour of nothing.
    assert!(matches!(
        Identity::from_cert_der(&cert_with_uris(&["starling:root:a"])),
        Err(Error::InvalidIdentity { .. })
    ));
}
