//! Certificate rotation without restart: after a swap, new handshakes present the new
//! certificate (both as server and as client) and established connections carry on.
#![allow(clippy::unwrap_used)] // a test that unwraps reports its failure by panicking

mod common;

use std::time::Duration;

use common::{full, Cluster, Server};
use pki::{CertInfo, CertRequest, Identity, PeerConnector};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn server_cert_of(tls: &pki::tokio_rustls::client::TlsStream<tokio::net::TcpStream>) -> CertInfo {
    let der = tls
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|chain| chain.first())
        .expect("server certificate");
    CertInfo::from_der(der).expect("info")
}

async fn echo(tls: &mut pki::tokio_rustls::client::TlsStream<tokio::net::TcpStream>, msg: &[u8]) {
    tls.write_all(msg).await.expect("write");
    let mut buf = vec![0u8; msg.len()];
    tokio::time::timeout(common::TIMEOUT, tls.read_exact(&mut buf))
        .await
        .expect("echo within the timeout")
        .expect("read");
    assert_eq!(buf, msg);
}

#[tokio::test]
async fn swapped_certificates_are_used_by_new_handshakes_only() {
    let cluster = Cluster::new("c1");
    let server_cert = cluster.node("node-a");
    let client_cert = cluster.node("node-b");
    let mut server =
        Server::start(pki::peer_server_config(&server_cert, &cluster.trust).expect("config")).await;
    // One connector for the whole test, as an agent keeps one.
    let connector = PeerConnector::new(client_cert.clone(), cluster.trust.clone());

    let mut before = full(connector.connect("node-a", server.tcp().await))
        .await
        .expect("first connection");
    let old_server = server_cert.info();
    let old_client = client_cert.info();
    assert_eq!(server_cert_of(&before).serial, old_server.serial);
    assert_eq!(
        server
            .next()
            .await
            .expect("accepted")
            .client_cert
            .expect("cert")
            .serial,
        old_client.serial
    );

    // Renew both with a different lifetime, so the expiry changes as well as the serial.
    let renew = |name: &str| {
        cluster
            .ca
            .issue(
                &CertRequest::new(Identity::node(name).expect("name"))
                    .lifetime(Duration::from_secs(48 * 3600)),
            )
            .expect("issue")
    };
    let new_server = renew("node-a");
    let new_client = renew("node-b");
    server_cert
        .replace_pem(&new_server.chain_pem(), new_server.key_pem().expect("key"))
        .expect("swap server");
    client_cert
        .replace_pem(&new_client.chain_pem(), new_client.key_pem().expect("key"))
        .expect("swap client");

    let after = full(connector.connect("node-a", server.tcp().await))
        .await
        .expect("connection after the swap");
    let seen_server = server_cert_of(&after);
    assert_eq!(seen_server.serial, new_server.info().serial);
    assert_ne!(seen_server.serial, old_server.serial);
    assert!(seen_server.not_after > old_server.not_after + Duration::from_secs(3600));
    let seen_client = server
        .next()
        .await
        .expect("accepted")
        .client_cert
        .expect("cert");
    assert_eq!(seen_client.serial, new_client.info().serial);
    assert!(seen_client.not_after > old_client.not_after + Duration::from_secs(3600));

    // The connection made before the swap still works and still shows the old certificate.
    echo(&mut before, b"still here").await;
    assert_eq!(server_cert_of(&before).serial, old_server.serial);
}

#[tokio::test]
async fn reload_from_files_rotates_a_running_server() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cluster = Cluster::new("c1");
    let first = cluster
        .ca
        .issue(&CertRequest::new(Identity::node("node-a").expect("name")))
        .expect("issue");
    let (cert_path, key_path) = first.save(dir.path(), "node").expect("save");
    let source = pki::CertSource::from_files(&cert_path, &key_path).expect("source");
    let mut server =
        Server::start(pki::peer_server_config(&source, &cluster.trust).expect("config")).await;
    let connector = PeerConnector::new(cluster.node("node-b"), cluster.trust.clone());

    let tls = full(connector.connect("node-a", server.tcp().await))
        .await
        .expect("connected");
    assert_eq!(server_cert_of(&tls).serial, first.info().serial);
    let _ = server.next().await;

    // What an agent does when `needs_renewal` says so: new key + CSR, signed by the CA,
    // written next to the old files, reloaded.
    let (key_pem, csr_pem) = pki::generate_node_csr("node-a").expect("csr");
    let renewed = cluster
        .ca
        .sign_csr(
            &csr_pem,
            &CertRequest::new(Identity::node("node-a").expect("name")),
        )
        .expect("sign");
    std::fs::write(&key_path, key_pem).expect("key");
    std::fs::write(&cert_path, renewed.chain_pem()).expect("cert");
    source.reload_from_files().expect("reload");

    let tls = full(connector.connect("node-a", server.tcp().await))
        .await
        .expect("connected");
    assert_eq!(server_cert_of(&tls).serial, renewed.info().serial);
    let _ = server.next().await;
}
