//! Upstream TLS: the trust every registry connection starts from, and per-registry
//! settings as containerd's `hosts.toml` has them (`ca`, `client`, `skip_verify`).
//!
//! Default trust is the system store (`rustls-native-certs`: `SSL_CERT_FILE` /
//! `SSL_CERT_DIR` when set, else the distribution's bundle, on Debian
//! `/etc/ssl/certs/ca-certificates.crt`). The bundled Mozilla roots (`webpki-roots`)
//! are used only when the system store is empty or unreadable, and that is logged.
//!
//! Why `rustls-native-certs` rather than `rustls-platform-verifier`: agents run on
//! Linux, where the platform verifier is itself webpki over the same PEM bundle, so it
//! adds nothing there; what we need is an explicit root store we can count (the
//! fallback rule and its log line), extend per registry with `ca_file`, and build a
//! rustls `ClientConfig` from for reqwest's `use_preconfigured_tls`.
//!
//! A registry with settings gets a rustls configuration of its own: the default roots
//! plus its `ca_file`, its client certificate, or no verification at all
//! (`skip_verify`). [`Upstream`](super::Upstream) keeps one reqwest client per distinct
//! configuration and uses a registry's client only for hosts of that registry (its
//! endpoint and its own name); any other host a redirect or a token realm leads to
//! gets the default trust.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{CertificateError, DigitallySignedStruct, RootCertStore, SignatureScheme};

use crate::Error;

/// TLS settings for one registry. All unset: the default trust, no client certificate.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct RegistryTls {
    /// PEM file with one or more CA certificates trusted for this registry only, on
    /// top of the default roots (containerd's `ca`).
    pub ca_file: Option<PathBuf>,
    /// PEM certificate (chain) presented to the registry (containerd's `client`).
    pub client_cert: Option<PathBuf>,
    /// PEM private key (PKCS#8, PKCS#1 or SEC1) of `client_cert`.
    pub client_key: Option<PathBuf>,
    /// Accept any certificate from this registry. Dangerous: whoever sits between
    /// this node and the registry can impersonate it, answer tags with digests of
    /// their choice and read the credentials sent to it.
    pub skip_verify: bool,
}

impl RegistryTls {
    /// Whether these settings change nothing (default trust, no client certificate).
    pub fn is_default(&self) -> bool {
        *self == Self::default()
    }
}

/// Where the default roots came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RootsSource {
    /// The system trust store: certificates taken, and problems met while reading it
    /// (unreadable files, certificates rustls cannot use).
    System { roots: usize, problems: Vec<String> },
    /// The bundled Mozilla roots, because the system store gave none.
    Bundled { reason: String },
}

/// The trust every upstream connection starts from.
#[derive(Clone)]
pub(crate) struct DefaultRoots {
    pub store: Arc<RootCertStore>,
    pub source: RootsSource,
}

impl DefaultRoots {
    /// Reads the system trust store (falls back to the bundled roots when it is empty).
    pub fn load() -> Self {
        let native = rustls_native_certs::load_native_certs();
        let problems = native.errors.iter().map(|e| e.to_string()).collect();
        Self::from_system(native.certs, problems)
    }

    /// The roots for what the system store gave: those certificates, or the bundled
    /// roots when none is usable.
    pub fn from_system(certs: Vec<CertificateDer<'static>>, mut problems: Vec<String>) -> Self {
        let mut store = RootCertStore::empty();
        let (added, ignored) = store.add_parsable_certificates(certs);
        if ignored > 0 {
            problems.push(format!("{ignored} certificates could not be used as roots"));
        }
        if added > 0 {
            return Self {
                store: Arc::new(store),
                source: RootsSource::System {
                    roots: added,
                    problems,
                },
            };
        }
        let reason = if problems.is_empty() {
            "the system trust store has no certificates".to_owned()
        } else {
            format!(
                "the system trust store gave no usable certificate: {}",
                problems.join("; ")
            )
        };
        Self {
            store: Arc::new(RootCertStore {
                roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
            }),
            source: RootsSource::Bundled { reason },
        }
    }
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn config_error(registry: &str, message: impl Into<String>) -> Error {
    Error::TlsConfig {
        registry: registry.to_owned(),
        message: message.into(),
    }
}

/// Certificates in a PEM file, at least one.
pub(crate) fn read_certs(
    registry: &str,
    what: &str,
    path: &Path,
) -> Result<Vec<CertificateDer<'static>>, Error> {
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|it| it.collect::<Result<Vec<_>, _>>())
        .map_err(|e| config_error(registry, format!("{what} {}: {e}", path.display())))?;
    if certs.is_empty() {
        return Err(config_error(
            registry,
            format!("{what} {}: no PEM certificate in it", path.display()),
        ));
    }
    Ok(certs)
}

/// The rustls configuration for one registry's settings (or the default, for none).
pub(crate) fn client_config(
    registry: &str,
    roots: &DefaultRoots,
    tls: &RegistryTls,
) -> Result<rustls::ClientConfig, Error> {
    let provider = provider();
    let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| config_error(registry, e.to_string()))?;
    let builder = if tls.skip_verify {
        builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(NoVerification(provider)))
    } else if let Some(path) = &tls.ca_file {
        let mut store = (*roots.store).clone();
        for cert in read_certs(registry, "ca_file", path)? {
            store.add(cert).map_err(|e| {
                config_error(
                    registry,
                    format!(
                        "ca_file {}: not a usable CA certificate: {e}",
                        path.display()
                    ),
                )
            })?;
        }
        builder.with_root_certificates(store)
    } else {
        builder.with_root_certificates(roots.store.clone())
    };
    let mut config = match (&tls.client_cert, &tls.client_key) {
        (None, None) => builder.with_no_client_auth(),
        (Some(cert), Some(key)) => {
            let chain = read_certs(registry, "client_cert", cert)?;
            // The key's contents never reach an error message or a log line.
            let key_der = PrivateKeyDer::from_pem_file(key).map_err(|e| {
                config_error(
                    registry,
                    format!(
                        "client_key {}: {}",
                        key.display(),
                        match e {
                            rustls::pki_types::pem::Error::Io(io) => io.to_string(),
                            rustls::pki_types::pem::Error::NoItemsFound =>
                                "no PEM private key in it".to_owned(),
                            _ => "not a PEM private key (PKCS#8, PKCS#1 or SEC1)".to_owned(),
                        }
                    ),
                )
            })?;
            builder.with_client_auth_cert(chain, key_der).map_err(|e| {
                config_error(
                    registry,
                    format!(
                        "client_cert {} with client_key {}: {e}",
                        cert.display(),
                        key.display()
                    ),
                )
            })?
        }
        (Some(_), None) => {
            return Err(config_error(
                registry,
                "client_cert is set without client_key",
            ))
        }
        (None, Some(_)) => {
            return Err(config_error(
                registry,
                "client_key is set without client_cert",
            ))
        }
    };
    // HTTP/1.1 only, as over plain-HTTP endpoints: each blob stream has a connection
    // of its own, and a handshake the registry refuses after the fact (TLS 1.3 servers
    // reject a client certificate only once the client has finished) fails the request
    // that caused it with the alert, where HTTP/2 loses it in the connection task and
    // the request sees only "connection closed".
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(config)
}

/// The host names a registry's own TLS settings apply to: its endpoint's host and
/// its name's host (ports aside, so a token server on another port of the same host
/// is covered).
pub(crate) fn registry_hosts(registry: &str, base_url: &str) -> BTreeSet<String> {
    let mut hosts = BTreeSet::new();
    if let Some(h) = url::Url::parse(base_url).ok().as_ref().and_then(host_of) {
        hosts.insert(h);
    }
    if let Some(h) = url::Url::parse(&format!("https://{registry}/"))
        .ok()
        .as_ref()
        .and_then(host_of)
    {
        hosts.insert(h);
    }
    hosts
}

/// A URL's host as [`registry_hosts`] names it (lower case, no trailing dot).
pub(crate) fn host_of(url: &url::Url) -> Option<String> {
    Some(match url.host()? {
        url::Host::Domain(d) => d.trim_end_matches('.').to_ascii_lowercase(),
        url::Host::Ipv4(ip) => ip.to_string(),
        url::Host::Ipv6(ip) => ip.to_string(),
    })
}

/// `skip_verify`: every certificate is accepted, but the handshake signatures are
/// still checked (the peer holds the key of the certificate it sent).
#[derive(Debug)]
struct NoVerification(Arc<CryptoProvider>);

impl ServerCertVerifier for NoVerification {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// The rustls error behind a request failure, if TLS is what failed. `io::Error`
/// hides the error it wraps from `source()`, so it is opened by hand. An alert that
/// arrives after the handshake (TLS 1.3 servers refuse a client certificate only
/// then) reaches us as text only: `received fatal alert: <Name>`.
pub(crate) fn tls_failure(e: &(dyn std::error::Error + 'static)) -> Option<rustls::Error> {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if let Some(t) = err.downcast_ref::<rustls::Error>() {
            return Some(t.clone());
        }
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            if let Some(inner) = io.get_ref() {
                if let Some(t) = tls_failure(inner) {
                    return Some(t);
                }
                if let Some(name) = inner.to_string().strip_prefix("received fatal alert: ") {
                    return Some(rustls::Error::AlertReceived(alert_named(name.trim())));
                }
            }
        }
        cur = err.source();
    }
    None
}

/// The alert a rustls message names (`BadCertificate`), for the ones worth explaining.
fn alert_named(name: &str) -> rustls::AlertDescription {
    use rustls::AlertDescription as A;
    [
        A::HandshakeFailure,
        A::BadCertificate,
        A::UnsupportedCertificate,
        A::CertificateRevoked,
        A::CertificateExpired,
        A::CertificateUnknown,
        A::UnknownCA,
        A::AccessDenied,
        A::CertificateRequired,
        A::ProtocolVersion,
        A::InsufficientSecurity,
        A::InternalError,
        A::DecryptError,
        A::IllegalParameter,
    ]
    .into_iter()
    .find(|a| format!("{a:?}") == name)
    .unwrap_or(A::Unknown(0))
}

/// What to tell an operator about a TLS failure with `host` of `registry`.
pub(crate) fn explain(registry: &str, host: &str, tls: &RegistryTls, e: &rustls::Error) -> String {
    use rustls::AlertDescription as A;
    let what = match e {
        rustls::Error::InvalidCertificate(ce) => match ce {
            CertificateError::UnknownIssuer => format!(
                "the certificate of {host} is not trusted (unknown issuer): {}",
                if tls.ca_file.is_some() {
                    "it is not signed by the registry's ca_file either".to_owned()
                } else {
                    format!("set ca_file for {registry} (--registry-ca {registry}=PATH) or add its CA to the system trust store")
                }
            ),
            CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. } => {
                format!("the certificate of {host} is not valid for the name {host}")
            }
            CertificateError::Expired | CertificateError::ExpiredContext { .. } => {
                format!("the certificate of {host} has expired")
            }
            CertificateError::NotValidYet | CertificateError::NotValidYetContext { .. } => {
                format!("the certificate of {host} is not valid yet")
            }
            CertificateError::Revoked => format!("the certificate of {host} is revoked"),
            other => format!("the certificate of {host} was rejected ({other:?})"),
        },
        rustls::Error::AlertReceived(
            alert @ (A::CertificateRequired
            | A::BadCertificate
            | A::UnknownCA
            | A::CertificateUnknown
            | A::UnsupportedCertificate
            | A::CertificateExpired
            | A::CertificateRevoked
            | A::AccessDenied
            | A::HandshakeFailure),
        ) => {
            if tls.client_cert.is_some() {
                format!("{host} refused our client certificate (alert {alert:?})")
            } else {
                format!("{host} refused the TLS handshake (alert {alert:?}); it may require a client certificate: set client_cert and client_key for {registry}")
            }
        }
        other => format!("TLS handshake with {host} failed: {other}"),
    };
    format!("{what} [{e}]")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_system_store_falls_back_to_bundled_roots() {
        let r = DefaultRoots::from_system(Vec::new(), Vec::new());
        assert!(
            matches!(r.source, RootsSource::Bundled { .. }),
            "{:?}",
            r.source
        );
        assert!(r.store.len() > 100, "Mozilla roots: {}", r.store.len());
        // Garbage only: the same, and the reason says why.
        let r = DefaultRoots::from_system(
            vec![CertificateDer::from(vec![1, 2, 3])],
            vec!["/etc/ssl/certs: permission denied".into()],
        );
        match &r.source {
            RootsSource::Bundled { reason } => {
                assert!(reason.contains("permission denied"), "{reason}")
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn system_roots_are_used_when_present() {
        let key = rcgen_like_ca();
        let r = DefaultRoots::from_system(vec![key], Vec::new());
        assert_eq!(
            r.source,
            RootsSource::System {
                roots: 1,
                problems: Vec::new()
            }
        );
        assert_eq!(r.store.len(), 1);
    }

    /// One of the bundled roots, as DER (any valid CA certificate does).
    fn rcgen_like_ca() -> CertificateDer<'static> {
        let pem = include_str!("testdata/ca.pem");
        CertificateDer::from_pem_slice(pem.as_bytes()).expect("test CA")
    }

    #[test]
    fn failures_are_found_behind_io_errors_and_explained() {
        use rustls::AlertDescription as A;
        use std::io::{Error as IoError, ErrorKind};
        let unknown = rustls::Error::InvalidCertificate(CertificateError::UnknownIssuer);
        let io = IoError::new(ErrorKind::InvalidData, unknown.clone());
        assert_eq!(tls_failure(&io), Some(unknown.clone()));
        let io = IoError::new(
            ErrorKind::InvalidData,
            "received fatal alert: BadCertificate",
        );
        let alert = tls_failure(&io).expect("alert");
        assert_eq!(alert, rustls::Error::AlertReceived(A::BadCertificate));
        assert!(tls_failure(&IoError::new(ErrorKind::ConnectionReset, "reset")).is_none());

        let none = RegistryTls::default();
        let m = explain("reg.example.com", "reg.example.com:5000", &none, &unknown);
        assert!(
            m.contains("reg.example.com:5000 is not trusted")
                && m.contains("--registry-ca reg.example.com=PATH"),
            "{m}"
        );
        let m = explain("reg.example.com", "reg.example.com", &none, &alert);
        assert!(
            m.contains("may require a client certificate") && m.contains("client_key"),
            "{m}"
        );
        let with_cert = RegistryTls {
            client_cert: Some("/c.pem".into()),
            client_key: Some("/k.pem".into()),
            ..Default::default()
        };
        let m = explain("reg.example.com", "reg.example.com", &with_cert, &alert);
        assert!(m.contains("refused our client certificate"), "{m}");
        let name = rustls::Error::InvalidCertificate(CertificateError::NotValidForName);
        let m = explain("r", "cdn.example.net", &none, &name);
        assert!(m.contains("not valid for the name cdn.example.net"), "{m}");
    }

    #[test]
    fn hosts_of_a_registry() {
        let h = registry_hosts("reg.example.com:5000", "https://mirror.example.com:8443/");
        assert_eq!(
            h,
            BTreeSet::from([
                "mirror.example.com".to_owned(),
                "reg.example.com".to_owned()
            ])
        );
        let h = registry_hosts("127.0.0.1:5000", "https://127.0.0.1:5000");
        assert_eq!(h, BTreeSet::from(["127.0.0.1".to_owned()]));
        let u = url::Url::parse("https://REG.Example.COM./v2/").expect("url");
        assert_eq!(host_of(&u).as_deref(), Some("reg.example.com"));
    }

    #[test]
    fn bad_settings_name_the_registry_and_the_file() {
        let roots = DefaultRoots::from_system(Vec::new(), Vec::new());
        let dir = std::env::temp_dir().join(format!("oci-tls-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let empty = dir.join("empty.pem");
        std::fs::write(&empty, "not a certificate\n").expect("write");
        let key = dir.join("key.pem");
        std::fs::write(
            &key,
            "-----BEGIN PRIVATE KEY-----\nU0VDUkVULUtFWS1CWVRFUw==\n-----END PRIVATE KEY-----\n",
        )
        .expect("write");
        let cases = [
            (
                RegistryTls {
                    ca_file: Some(dir.join("missing.pem")),
                    ..Default::default()
                },
                "missing.pem",
            ),
            (
                RegistryTls {
                    ca_file: Some(empty.clone()),
                    ..Default::default()
                },
                "no PEM certificate",
            ),
            (
                RegistryTls {
                    client_cert: Some(empty.clone()),
                    ..Default::default()
                },
                "without client_key",
            ),
            (
                RegistryTls {
                    client_key: Some(key.clone()),
                    ..Default::default()
                },
                "without client_cert",
            ),
        ];
        for (tls, want) in cases {
            let e = client_config("reg.example.com", &roots, &tls).expect_err("bad settings");
            let s = e.to_string();
            assert!(s.contains("reg.example.com") && s.contains(want), "{s}");
        }
        // A key that does not parse: its bytes are never shown.
        let pem = include_str!("testdata/ca.pem");
        let cert = dir.join("cert.pem");
        std::fs::write(&cert, pem).expect("write");
        let e = client_config(
            "reg.example.com",
            &roots,
            &RegistryTls {
                client_cert: Some(cert),
                client_key: Some(key),
                ..Default::default()
            },
        )
        .expect_err("bad key");
        let s = e.to_string();
        assert!(!s.contains("U0VDUkVU") && s.contains("client_key"), "{s}");
        let _ = std::fs::remove_dir_all(&dir);
        // skip_verify alone is fine.
        client_config(
            "reg.example.com",
            &roots,
            &RegistryTls {
                skip_verify: true,
                ..Default::default()
            },
        )
        .expect("skip_verify");
    }
}

/// A registry's TLS settings against small HTTPS servers on loopback: they follow the
/// registry to its own host (other ports included: redirects, token realms) and
/// nowhere else.
#[cfg(test)]
mod client_tests {
    use std::net::SocketAddr;
    use std::sync::Arc;

    use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair};
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use crate::upstream::{RegistryTls, Upstream, UpstreamConfig};
    use crate::{Digest, Error};

    struct Ca {
        key: KeyPair,
        cert: rcgen::Certificate,
    }

    fn ca() -> Ca {
        let key = KeyPair::generate().expect("key");
        let mut p = CertificateParams::default();
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let cert = p.self_signed(&key).expect("CA");
        Ca { key, cert }
    }

    /// An HTTPS server with a certificate for 127.0.0.1 and localhost from `ca`; every
    /// request head goes to `respond`, whose raw response is sent back.
    async fn server(
        ca: &Ca,
        respond: impl Fn(&str) -> String + Send + Sync + 'static,
    ) -> SocketAddr {
        let key = KeyPair::generate().expect("key");
        let cert = CertificateParams::new(vec!["127.0.0.1".to_owned(), "localhost".to_owned()])
            .expect("params")
            .signed_by(&key, &ca.cert, &ca.key)
            .expect("cert");
        let cfg = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_no_client_auth()
        .with_single_cert(
            vec![CertificateDer::from(cert.der().to_vec())],
            PrivateKeyDer::from_pem_slice(key.serialize_pem().as_bytes()).expect("key"),
        )
        .expect("server config");
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(cfg));
        let l = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = l.local_addr().expect("addr");
        let respond = Arc::new(respond);
        tokio::spawn(async move {
            while let Ok((s, _)) = l.accept().await {
                let (acceptor, respond) = (acceptor.clone(), respond.clone());
                tokio::spawn(async move {
                    let Ok(mut tls) = acceptor.accept(s).await else {
                        return;
                    };
                    let mut head = Vec::new();
                    let mut buf = [0u8; 1024];
                    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                        match tls.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => head.extend_from_slice(&buf[..n]),
                        }
                    }
                    let reply = respond(&String::from_utf8_lossy(&head));
                    let _ = tls.write_all(reply.as_bytes()).await;
                    let _ = tls.shutdown().await;
                });
            }
        });
        addr
    }

    fn redirect(to: String) -> impl Fn(&str) -> String + Send + Sync + 'static {
        move |_| {
            format!("HTTP/1.1 307 Temporary Redirect\r\nLocation: {to}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        }
    }

    fn ok(_: &str) -> String {
        "HTTP/1.1 200 OK\r\nContent-Length: 3\r\nConnection: close\r\n\r\n".to_owned()
    }

    fn client(registry: &str, ca_file: &std::path::Path) -> Upstream {
        Upstream::new(UpstreamConfig {
            endpoints: [(registry.to_owned(), format!("https://{registry}"))].into(),
            tls: [(
                registry.to_owned(),
                RegistryTls {
                    ca_file: Some(ca_file.to_owned()),
                    ..Default::default()
                },
            )]
            .into(),
            max_attempts: 1,
            ..Default::default()
        })
        .expect("client")
    }

    #[tokio::test]
    async fn registry_trust_follows_its_host_and_no_other() {
        let ca = ca();
        let dir = tempfile_dir();
        let ca_file = dir.join("ca.pem");
        std::fs::write(&ca_file, ca.cert.pem()).expect("write");
        let d = Digest::of(b"abc");

        // Same host, another port: the registry's CA applies.
        let blob = server(&ca, ok).await;
        let reg = server(
            &ca,
            redirect(format!("https://127.0.0.1:{}/blob", blob.port())),
        )
        .await;
        let up = client(&reg.to_string(), &ca_file);
        assert_eq!(
            up.head_blob(&reg.to_string(), "a/b", &d)
                .await
                .expect("same host"),
            3
        );

        // Another host (a CDN), certificate from the same CA: default trust, refused.
        let cdn = server(&ca, ok).await;
        let reg2 = server(
            &ca,
            redirect(format!("https://localhost:{}/blob", cdn.port())),
        )
        .await;
        let up2 = client(&reg2.to_string(), &ca_file);
        let e = up2
            .head_blob(&reg2.to_string(), "a/b", &d)
            .await
            .expect_err("CA not trusted for another host");
        let msg = e.to_string();
        assert!(matches!(e, Error::Tls { .. }), "{e:?}");
        assert!(
            msg.contains(&format!("localhost:{}", cdn.port())) && msg.contains("not trusted"),
            "{msg}"
        );

        // A token realm on the registry's host: fetched with the registry's trust.
        let realm = server(&ca, |_| {
            let body = r#"{"token":"t0k"}"#;
            format!("HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len())
        })
        .await;
        let challenge = move |head: &str| {
            if head.contains("Bearer t0k") {
                ok(head)
            } else {
                format!("HTTP/1.1 401 Unauthorized\r\nWWW-Authenticate: Bearer realm=\"https://127.0.0.1:{}/token\",service=\"x\"\r\nContent-Length: 0\r\nConnection: close\r\n\r\n", realm.port())
            }
        };
        let reg3 = server(&ca, challenge).await;
        let up3 = client(&reg3.to_string(), &ca_file);
        assert_eq!(
            up3.head_blob(&reg3.to_string(), "a/b", &d)
                .await
                .expect("token realm"),
            3
        );

        // The same realm named "localhost": another host, so default trust and refused.
        let challenge = move |_: &str| {
            format!("HTTP/1.1 401 Unauthorized\r\nWWW-Authenticate: Bearer realm=\"https://localhost:{}/token\",service=\"x\"\r\nContent-Length: 0\r\nConnection: close\r\n\r\n", realm.port())
        };
        let reg4 = server(&ca, challenge).await;
        let up4 = client(&reg4.to_string(), &ca_file);
        let e = up4
            .head_blob(&reg4.to_string(), "a/b", &d)
            .await
            .expect_err("realm on another host");
        assert!(matches!(e, Error::Tls { .. }), "{e:?}");

        // And without the registry's settings, its own host is refused too.
        let plain = Upstream::new(UpstreamConfig {
            endpoints: [(reg.to_string(), format!("https://{reg}"))].into(),
            max_attempts: 1,
            ..Default::default()
        })
        .expect("client");
        let e = plain
            .head_blob(&reg.to_string(), "a/b", &d)
            .await
            .expect_err("default trust");
        assert!(e.to_string().contains("ca_file"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    fn tempfile_dir() -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!(
            "oci-tls-client-{}-{}",
            std::process::id(),
            rand::random::<u64>()
        ));
        std::fs::create_dir_all(&d).expect("dir");
        d
    }
}
