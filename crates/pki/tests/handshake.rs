//! Real TLS handshakes over loopback TCP with tokio-rustls: who gets in, who is refused,
//! and why.
#![allow(clippy::unwrap_used)] // a test that unwraps reports its failure by panicking

mod common;

use common::{full, Cluster, Server};
use pki::rustls::ClientConfig;
use pki::{CertRequest, Error, Identity, PeerConnector, Role};

fn node(name: &str) -> Identity {
    Identity::node(name).expect("name")
}

#[tokio::test]
async fn mutual_tls_between_two_nodes() {
    let cluster = Cluster::new("c1");
    let a = cluster.node("node-a");
    let b = cluster.node("node-b");
    let mut server =
        Server::start(pki::peer_server_config(&a, &cluster.trust).expect("config")).await;

    let connector = PeerConnector::new(b.clone(), cluster.trust.clone());
    let tls = full(connector.connect("node-a", server.tcp().await))
        .await
        .expect("mutual TLS");
    assert_eq!(
        pki::server_identity(&tls).expect("identity"),
        Some(node("node-a"))
    );
    let seen = server.next().await.expect("accepted");
    assert_eq!(seen.identity, Some(node("node-b")));
    assert_eq!(
        seen.client_cert.expect("client cert").serial,
        b.info().serial
    );
    assert_eq!(
        tls.get_ref().1.protocol_version(),
        Some(pki::rustls::ProtocolVersion::TLSv1_3)
    );
}

#[tokio::test]
async fn peer_answering_for_another_name_is_refused() {
    let cluster = Cluster::new("c1");
    let a = cluster.node("node-a");
    let mut server =
        Server::start(pki::peer_server_config(&a, &cluster.trust).expect("config")).await;
    let connector = PeerConnector::new(cluster.node("node-b"), cluster.trust.clone());

    let err = full(connector.connect("node-c", server.tcp().await))
        .await
        .expect_err("wrong node");
    match err {
        Error::WrongIdentity { expected, found } => {
            assert_eq!(expected, "starling:node:node-c");
            assert_eq!(found, "starling:node:node-a");
        }
        other => panic!("expected WrongIdentity, got {other:?}"),
    }
    assert!(
        server.next().await.is_err(),
        "the server saw the handshake fail too"
    );
}

#[tokio::test]
async fn peer_server_from_another_ca_is_refused() {
    let ours = Cluster::new("ours");
    let theirs = Cluster::new("theirs");
    // Same node name, same everything, different CA.
    let impostor = theirs.node("node-a");
    let mut server =
        Server::start(pki::peer_server_config(&impostor, &theirs.trust).expect("config")).await;
    let connector = PeerConnector::new(ours.node("node-b"), ours.trust.clone());
    let err = full(connector.connect("node-a", server.tcp().await))
        .await
        .expect_err("foreign CA");
    assert!(matches!(err, Error::UnknownCa), "{err:?}");
    let _ = server.next().await;
}

#[tokio::test]
async fn expired_peer_server_is_refused() {
    let cluster = Cluster::new("c1");
    let stale = cluster.expired_node("node-a");
    let mut server =
        Server::start(pki::peer_server_config(&stale, &cluster.trust).expect("config")).await;
    let connector = PeerConnector::new(cluster.node("node-b"), cluster.trust.clone());
    let err = full(connector.connect("node-a", server.tcp().await))
        .await
        .expect_err("expired");
    assert!(matches!(err, Error::Expired), "{err:?}");
    let _ = server.next().await;
}

#[tokio::test]
async fn peer_server_refuses_bad_client_certificates() {
    let cluster = Cluster::new("c1");
    let other = Cluster::new("other");
    let a = cluster.node("node-a");
    let mut server =
        Server::start(pki::peer_server_config(&a, &cluster.trust).expect("config")).await;

    type Case = (&'static str, pki::CertSource, fn(&Error) -> bool);
    let cases: Vec<Case> = vec![
        ("another CA", other.node("node-b"), |e| {
            matches!(e, Error::UnknownCa)
        }),
        ("expired", cluster.expired_node("node-b"), |e| {
            matches!(e, Error::Expired)
        }),
        (
            "viewer",
            cluster.source(&CertRequest::new(Identity::viewer("bob").expect("name"))),
            |e| {
                matches!(
                    e,
                    Error::WrongRole {
                        found: Role::Viewer,
                        ..
                    }
                )
            },
        ),
        (
            "operator",
            cluster.source(&CertRequest::new(
                Identity::operator("alice").expect("name"),
            )),
            |e| {
                matches!(
                    e,
                    Error::WrongRole {
                        found: Role::Operator,
                        ..
                    }
                )
            },
        ),
        ("tracker", cluster.tracker(), |e| {
            matches!(
                e,
                Error::WrongRole {
                    found: Role::Tracker,
                    ..
                }
            )
        }),
    ];
    for (case, client_cert, server_error) in cases {
        // The client side trusts the real CA, so only the server's check can refuse.
        let connector = PeerConnector::new(client_cert, cluster.trust.clone());
        let client = full(connector.connect("node-a", server.tcp().await)).await;
        let client_err = client.expect_err(case);
        assert!(
            matches!(client_err, Error::RefusedByPeer(_)),
            "{case}: client sees the refusal: {client_err:?}"
        );
        let err = server.next().await.expect_err(case);
        assert!(server_error(&err), "{case}: server error {err:?}");
    }
}

#[tokio::test]
async fn peer_server_requires_a_client_certificate() {
    let cluster = Cluster::new("c1");
    let a = cluster.source(&CertRequest::new(node("node-a")).dns_name("node-a.test"));
    let mut server =
        Server::start(pki::peer_server_config(&a, &cluster.trust).expect("config")).await;
    let anonymous = ClientConfig::builder_with_provider(pki::provider())
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_root_certificates(cluster.trust.roots())
        .with_no_client_auth();
    let err = full(pki::connect(
        &pki::connector(anonymous),
        "node-a.test",
        server.tcp().await,
    ))
    .await
    .expect_err("no certificate");
    assert!(matches!(err, Error::RefusedByPeer(_)), "{err:?}");
    let err = server.next().await.expect_err("refused");
    assert!(matches!(err, Error::NoPeerCertificate), "{err:?}");
}

#[tokio::test]
async fn tracker_accepts_nodes_operators_and_anonymous_clients() {
    let cluster = Cluster::new("c1");
    let tracker = cluster.tracker();
    let mut server =
        Server::start(pki::tracker_server_config(&tracker, &cluster.trust).expect("config")).await;

    let n1 = cluster.node("n1");
    let op = cluster.source(&CertRequest::new(
        Identity::operator("alice").expect("name"),
    ));
    let viewer = cluster.source(&CertRequest::new(Identity::viewer("bob").expect("name")));
    for (client, expected) in [
        (Some(&n1), Some(node("n1"))),
        (Some(&op), Some(Identity::operator("alice").expect("name"))),
        (Some(&viewer), Some(Identity::viewer("bob").expect("name"))),
        (None, None),
    ] {
        let connector =
            pki::connector(pki::tracker_client_config(&cluster.trust, client).expect("config"));
        // By IP address and by host name: both are in the tracker certificate.
        for name in ["127.0.0.1", "tracker.test"] {
            let tls = full(pki::connect(&connector, name, server.tcp().await))
                .await
                .expect("connected");
            assert_eq!(
                pki::server_identity(&tls).expect("identity"),
                Some(Identity::tracker("tracker").expect("name"))
            );
            let seen = server.next().await.expect("accepted");
            assert_eq!(seen.identity, expected);
        }
    }
}

#[tokio::test]
async fn tracker_client_refusals() {
    let cluster = Cluster::new("c1");
    let other = Cluster::new("other");
    let tracker = cluster.tracker();
    let mut server =
        Server::start(pki::tracker_server_config(&tracker, &cluster.trust).expect("config")).await;

    // Host name not in the tracker certificate.
    let connector =
        pki::connector(pki::tracker_client_config(&cluster.trust, None).expect("config"));
    let err = full(pki::connect(
        &connector,
        "elsewhere.test",
        server.tcp().await,
    ))
    .await
    .expect_err("wrong host");
    assert!(matches!(err, Error::WrongName(_)), "{err:?}");
    let _ = server.next().await;

    // A client that trusts another CA.
    let connector = pki::connector(pki::tracker_client_config(&other.trust, None).expect("config"));
    let err = full(pki::connect(&connector, "tracker.test", server.tcp().await))
        .await
        .expect_err("foreign tracker");
    assert!(matches!(err, Error::UnknownCa), "{err:?}");
    let _ = server.next().await;

    // Optional does not mean unchecked: a presented certificate must be valid.
    for (case, client) in [
        ("another CA", other.node("n1")),
        ("expired", cluster.expired_node("n1")),
    ] {
        let connector = pki::connector(
            pki::tracker_client_config(&cluster.trust, Some(&client)).expect("config"),
        );
        let err = full(pki::connect(&connector, "tracker.test", server.tcp().await))
            .await
            .expect_err(case);
        assert!(matches!(err, Error::RefusedByPeer(_)), "{case}: {err:?}");
        let err = server.next().await.expect_err(case);
        assert!(
            matches!(err, Error::UnknownCa | Error::Expired),
            "{case}: {err:?}"
        );
    }
}

#[tokio::test]
async fn bootstrap_with_a_pin_learns_the_ca() {
    let cluster = Cluster::new("c1");
    let tracker = cluster.tracker();
    let mut server =
        Server::start(pki::tracker_server_config(&tracker, &cluster.trust).expect("config")).await;

    let pin: pki::CaPin = cluster.ca.pin().to_string().parse().expect("pin text");
    let (config, learned) = pki::bootstrap_client_config(pin).expect("config");
    assert!(learned.cert().is_none());
    full(pki::connect(
        &pki::connector(config),
        "tracker.test",
        server.tcp().await,
    ))
    .await
    .expect("pinned bootstrap");
    assert_eq!(server.next().await.expect("accepted").identity, None);
    assert_eq!(learned.cert().as_ref(), Some(cluster.ca.cert_der()));
    let trust = learned.trust().expect("learned").expect("trust");
    assert_eq!(trust.to_pem(), cluster.ca.cert_pem());
}

#[tokio::test]
async fn bootstrap_refusals() {
    let cluster = Cluster::new("c1");
    let attacker = Cluster::new("attacker");
    let tracker = cluster.tracker();
    let mut server =
        Server::start(pki::tracker_server_config(&tracker, &cluster.trust).expect("config")).await;

    // The pin of another CA.
    let (config, learned) = pki::bootstrap_client_config(attacker.ca.pin()).expect("config");
    let err = full(pki::connect(
        &pki::connector(config),
        "tracker.test",
        server.tcp().await,
    ))
    .await
    .expect_err("wrong pin");
    assert!(matches!(err, Error::PinMismatch { .. }), "{err:?}");
    assert!(
        learned.cert().is_none(),
        "nothing learned from a failed handshake"
    );
    let _ = server.next().await;

    // Right pin, wrong host name.
    let (config, _) = pki::bootstrap_client_config(cluster.ca.pin()).expect("config");
    let err = full(pki::connect(
        &pki::connector(config),
        "elsewhere.test",
        server.tcp().await,
    ))
    .await
    .expect_err("wrong host");
    assert!(matches!(err, Error::WrongName(_)), "{err:?}");
    let _ = server.next().await;

    // A tracker that does not send the CA in its chain cannot be pinned.
    let issued = cluster
        .ca
        .issue(&CertRequest::new(Identity::tracker("t").expect("name")).dns_name("tracker.test"))
        .expect("issue");
    let leaf_only = pki::CertSource::from_pem(issued.cert_pem(), issued.key_pem().expect("key"))
        .expect("source");
    let mut bare =
        Server::start(pki::tracker_server_config(&leaf_only, &cluster.trust).expect("config"))
            .await;
    let (config, _) = pki::bootstrap_client_config(cluster.ca.pin()).expect("config");
    let err = full(pki::connect(
        &pki::connector(config),
        "tracker.test",
        bare.tcp().await,
    ))
    .await
    .expect_err("no CA in chain");
    assert!(matches!(err, Error::PinMismatch { .. }), "{err:?}");
    let _ = bare.next().await;

    // A man in the middle sends the real (public) CA certificate along with its own leaf:
    // the pin matches the CA, but the leaf does not chain to it.
    let fake = attacker
        .ca
        .issue(&CertRequest::new(Identity::tracker("t").expect("name")).dns_name("tracker.test"))
        .expect("issue");
    let mitm_chain = format!("{}{}", fake.cert_pem(), cluster.ca.cert_pem());
    let mitm =
        pki::CertSource::from_pem(&mitm_chain, fake.key_pem().expect("key")).expect("source");
    let mut mitm_server =
        Server::start(pki::tracker_server_config(&mitm, &attacker.trust).expect("config")).await;
    let (config, learned) = pki::bootstrap_client_config(cluster.ca.pin()).expect("config");
    let err = full(pki::connect(
        &pki::connector(config),
        "tracker.test",
        mitm_server.tcp().await,
    ))
    .await
    .expect_err("mitm");
    assert!(matches!(err, Error::UnknownCa), "{err:?}");
    assert!(learned.cert().is_none());
    let _ = mitm_server.next().await;
}

#[tokio::test]
async fn transport_failures_are_connection_errors() {
    // A "server" that closes the connection at once.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let closer = tokio::spawn(async move {
        let (tcp, _) = listener.accept().await.expect("accept");
        drop(tcp);
    });
    let cluster = Cluster::new("c1");
    let connector = PeerConnector::new(cluster.node("n1"), cluster.trust.clone());
    let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let err = connector.connect("n2", tcp).await.expect_err("closed");
    assert!(matches!(err, Error::Connection(_)), "{err:?}");
    closer.await.expect("join");
}

#[tokio::test]
async fn invalid_expected_node_name_fails_before_connecting() {
    let cluster = Cluster::new("c1");
    let connector = PeerConnector::new(cluster.node("n1"), cluster.trust.clone());
    let (client, _server) = tokio::io::duplex(1024);
    let err = connector
        .connect("Not A Name", client)
        .await
        .expect_err("invalid");
    assert!(matches!(err, Error::InvalidName { .. }), "{err:?}");
}
