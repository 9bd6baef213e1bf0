//! A registry that only an `allowed_registries` wildcard admits: its blobs are shared
//! in a swarm of their own (digest and registry), as anyone may run a registry there.
//! Served over TLS at an address that is not loopback (the host side of a network
//! namespace's veth pair), since the agent never reaches an internal address nobody
//! configured.

use std::time::Duration;

use testkit::{Registry, RegistryAuth, RegistryTls, TestCa, TestImage};

use super::common::other_host::OtherHost;
use super::common::trackers::swarms;
use super::common::Proc;
use super::{agent_with_env, blocking, metric, tracker};

/// Relays TCP connections from `ip`:(a free port) to 127.0.0.1:`to`, bytes untouched
/// (TLS passes through): the registry reached at `ip`. Returns the port.
async fn relay(ip: &str, to: u16) -> (u16, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind((ip, 0)).await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let task = tokio::spawn(async move {
        while let Ok((mut client, _)) = listener.accept().await {
            tokio::spawn(async move {
                if let Ok(mut registry) = tokio::net::TcpStream::connect(("127.0.0.1", to)).await {
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut registry).await;
                }
            });
        }
    });
    (port, task)
}

/// Pulls `image` through `agent` from registry `ns` (`?ns=`, as containerd asks a
/// mirror): the manifest, then every layer, each checked against its digest.
async fn pull_from(agent: &Proc, ns: &str, image: &testkit::PushedImage, repo: &str) {
    let http = reqwest::Client::new();
    let manifest = http
        .get(format!("{}/v2/{repo}/manifests/1?ns={ns}", agent.url()))
        .header(
            "accept",
            "application/vnd.oci.image.manifest.v1+json, application/vnd.docker.distribution.manifest.v2+json",
        )
        .send()
        .await
        .unwrap();
    assert_eq!(
        manifest.status(),
        200,
        "{}",
        manifest.text().await.unwrap_or_default()
    );
    for layer in &image.layers {
        let r = http
            .get(format!(
                "{}/v2/{repo}/blobs/{}?ns={ns}",
                agent.url(),
                layer.digest
            ))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let body = r.bytes().await.unwrap();
        assert_eq!(
            oci::Digest::of(&body).to_string(),
            layer.digest,
            "the layer whole"
        );
    }
}

/// A node that pulled a layer from a wildcard-admitted registry seeds that registry's
/// swarm of it, not only the digest's: after the tracker lost the swarm's members (a
/// restart), a node pulling the same image from that registry takes the layer from the
/// first, and the registry serves it once. (Before, the holder seeded only the digest's
/// swarm, so the second node found nobody in the registry's and read it again.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_layer_from_a_wildcard_admitted_registry_is_seeded_in_that_registrys_swarm() {
    let dir = tempfile::tempdir().unwrap();
    let other = OtherHost::create(232);
    let ca = TestCa::new("wildcard test CA").unwrap();
    let tls = RegistryTls {
        server: ca
            .server_cert(&["127.0.0.1", "localhost", &other.host_ip])
            .unwrap(),
        ..RegistryTls::new(&ca).unwrap()
    };
    let ca_file = ca.write_cert(&dir.path().join("ca.pem")).unwrap();
    let registry = blocking(move || Registry::start_tls(RegistryAuth::None, tls)).await;
    let repo = "wild/img";
    let image = TestImage::push_multilayer(&registry, repo, "1", &[12 << 20], 76).unwrap();
    let layer = image.layers[0].clone();
    let (port, _relay) = relay(&other.host_ip, registry.port()).await;
    let wildcard = format!("{}:{port}", other.host_ip);
    let mut t = tracker(dir.path(), &[]).await;
    let ca_path = ca_file.display().to_string();
    let envs = [
        ("STARLING_ALLOWED_REGISTRIES", "*"),
        ("SSL_CERT_FILE", ca_path.as_str()),
    ];
    let tracker_url = t.url();
    let start = |name: &'static str| {
        let (dir, tracker, registry) = (dir.path().to_owned(), tracker_url.clone(), &registry);
        async move { agent_with_env(&dir, name, &tracker, registry, &registry.url(), &[], &envs).await }
    };
    let b = start("b").await;
    let unknown = oci::Digest::of(b"no registry has this");
    let missing = reqwest::get(format!(
        "{}/v2/{repo}/blobs/{unknown}?ns={wildcard}",
        b.url()
    ))
    .await
    .unwrap();
    assert_eq!(missing.status(), 404);
    pull_from(&b, &wildcard, &image, repo).await;
    // Only what the registry had and a swarm carries is noted: not the unknown digest,
    // nor the small config blob.
    let noted: serde_json::Value =
        serde_json::from_slice(&std::fs::read(b.cache.join("registry-swarms.json")).unwrap())
            .unwrap();
    let noted: Vec<&String> = noted.as_object().unwrap().keys().collect();
    assert_eq!(noted, [&layer.digest]);
    assert_eq!(
        metric(&b, "starling_agent_p2p_registry_bytes_total").await,
        layer.size,
        "b read the layer from the wildcard-admitted registry through its swarm"
    );

    t.kill9();
    t.restart();
    super::common::ready(&t.url()).await;
    // b seeds the layer in two swarms: the digest's and the registry's.
    testkit::until(
        "b seeding the layer in two swarms",
        Duration::from_millis(100),
        Duration::from_secs(30),
        || async {
            let swarms = swarms(&t.url()).await;
            let seeded = swarms
                .as_array()
                .into_iter()
                .flatten()
                .filter(|s| s["complete"] == 1 && s["size"] == layer.size);
            seeded.count() == 2
        },
    )
    .await;

    let c = start("c").await;
    pull_from(&c, &wildcard, &image, repo).await;
    assert_eq!(
        metric(&c, "starling_agent_p2p_peer_bytes_total").await,
        layer.size,
        "c took the layer from b"
    );
    assert_eq!(
        metric(&c, "starling_agent_p2p_registry_bytes_total").await,
        0,
        "the registry served the layer once"
    );
}
