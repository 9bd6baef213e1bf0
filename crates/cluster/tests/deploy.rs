//! The deployment files: every Kubernetes object parses and is wired consistently
//! (selectors, volumes, secrets, probes, host network, the containerd init step), the
//! scheduler config's verbs are routes the cluster router serves, and every Grafana
//! expression uses metrics that exist.
#![allow(clippy::unwrap_used)] // a test that unwraps reports its failure by panicking

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use cluster::{router, ClusterConfig, ClusterState, JobStore};
use serde::Deserialize;
use serde_norway::Value;
use tower::ServiceExt;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn docs(file: &str) -> Vec<Value> {
    let text =
        std::fs::read_to_string(repo().join("deploy/kubernetes").join(file)).expect("read yaml");
    serde_norway::Deserializer::from_str(&text)
        .map(|d| Value::deserialize(d).expect("valid YAML document"))
        .filter(|v| !v.is_null())
        .collect()
}

fn s<'a>(v: &'a Value, path: &[&str]) -> &'a str {
    let mut cur = v;
    for p in path {
        cur = &cur[*p];
    }
    cur.as_str()
        .unwrap_or_else(|| panic!("{path:?} is not a string in {v:?}"))
}

fn seq<'a>(v: &'a Value, path: &[&str]) -> &'a Vec<Value> {
    let mut cur = v;
    for p in path {
        cur = &cur[*p];
    }
    cur.as_sequence()
        .unwrap_or_else(|| panic!("{path:?} is not a list"))
}

/// The single-tracker install; `tracker-ha.yaml` + `redis.yaml` replace `tracker.yaml`
/// in the HA install (`ha_objects`). Every manifest file is in one of the two.
const BASE_FILES: [&str; 3] = ["namespace.yaml", "agent.yaml", "tracker.yaml"];
const HA_FILES: [&str; 4] = [
    "namespace.yaml",
    "agent.yaml",
    "tracker-ha.yaml",
    "redis.yaml",
];
/// Secrets the operator creates (their values must never be committed): referenced,
/// not defined, by the manifests.
const OPERATOR_SECRETS: [&str; 1] = ["starling-redis"];

fn objects(files: &[&str]) -> Vec<Value> {
    files.iter().flat_map(|f| docs(f)).collect()
}

fn all_objects() -> Vec<Value> {
    objects(&BASE_FILES)
}

/// The HA install also needs tracker.yaml's Secrets (PKI, join token).
fn ha_objects() -> Vec<Value> {
    let mut objs = objects(&HA_FILES);
    objs.extend(
        docs("tracker.yaml")
            .into_iter()
            .filter(|o| o["kind"].as_str() == Some("Secret")),
    );
    objs
}

#[test]
fn every_manifest_belongs_to_an_install() {
    let mut files: Vec<String> = std::fs::read_dir(repo().join("deploy/kubernetes"))
        .expect("deploy/kubernetes")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".yaml") && n != "scheduler-config.yaml")
        .collect();
    files.sort();
    for f in &files {
        assert!(
            BASE_FILES.contains(&f.as_str()) || HA_FILES.contains(&f.as_str()),
            "{f} is in no install this test checks"
        );
    }
}

fn find<'a>(objs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    objs.iter()
        .find(|o| o["kind"].as_str() == Some(kind) && o["metadata"]["name"].as_str() == Some(name))
        .unwrap_or_else(|| panic!("no {kind} {name}"))
}

#[test]
fn every_object_has_identity_and_the_expected_kinds_exist() {
    let objs = all_objects();
    let mut kinds = BTreeMap::new();
    for o in &objs {
        let kind = s(o, &["kind"]);
        let api = s(o, &["apiVersion"]);
        let name = s(o, &["metadata", "name"]);
        assert!(!name.is_empty());
        let expected_api = match kind {
            "Deployment" | "DaemonSet" => "apps/v1",
            "ClusterRole" | "ClusterRoleBinding" => "rbac.authorization.k8s.io/v1",
            "Namespace"
            | "Service"
            | "ServiceAccount"
            | "ConfigMap"
            | "Secret"
            | "PersistentVolumeClaim" => "v1",
            other => panic!("unexpected kind {other}"),
        };
        assert_eq!(api, expected_api, "{kind} {name}");
        if !matches!(kind, "Namespace" | "ClusterRole" | "ClusterRoleBinding") {
            assert_eq!(
                s(o, &["metadata", "namespace"]),
                "starling",
                "{kind} {name}"
            );
        }
        *kinds.entry(kind.to_owned()).or_insert(0) += 1;
    }
    let expected: BTreeMap<String, i32> = [
        ("ClusterRole", 1),
        ("ClusterRoleBinding", 1),
        ("ConfigMap", 1),
        ("DaemonSet", 1),
        ("Deployment", 1),
        ("Namespace", 1),
        ("PersistentVolumeClaim", 1),
        ("Secret", 2),
        ("Service", 1),
        ("ServiceAccount", 2),
    ]
    .iter()
    .map(|(k, n)| ((*k).to_owned(), *n))
    .collect();
    assert_eq!(kinds, expected);
}

/// Every referenced ServiceAccount, Secret, ConfigMap and PVC exists; every volume
/// mount names a volume of the pod.
fn check_pod_refs(objs: &[Value], workload: &Value) {
    let spec = &workload["spec"]["template"]["spec"];
    find(objs, "ServiceAccount", s(spec, &["serviceAccountName"]));
    let volumes: BTreeSet<&str> = spec["volumes"]
        .as_sequence()
        .map(|v| v.iter().map(|v| s(v, &["name"])).collect())
        .unwrap_or_default();
    for v in spec["volumes"].as_sequence().into_iter().flatten() {
        if let Some(cm) = v["configMap"]["name"].as_str() {
            find(objs, "ConfigMap", cm);
        }
        if let Some(pvc) = v["persistentVolumeClaim"]["claimName"].as_str() {
            find(objs, "PersistentVolumeClaim", pvc);
        }
    }
    let containers = spec["containers"]
        .as_sequence()
        .into_iter()
        .flatten()
        .chain(spec["initContainers"].as_sequence().into_iter().flatten());
    for c in containers {
        for m in c["volumeMounts"].as_sequence().into_iter().flatten() {
            assert!(
                volumes.contains(s(m, &["name"])),
                "mount {:?} has no volume",
                m["name"]
            );
        }
        for e in c["env"].as_sequence().into_iter().flatten() {
            if let Some(secret) = e["valueFrom"]["secretKeyRef"]["name"].as_str() {
                if OPERATOR_SECRETS.contains(&secret) {
                    continue;
                }
                let sec = find(objs, "Secret", secret);
                let key = s(e, &["valueFrom", "secretKeyRef", "key"]);
                assert!(
                    !sec["stringData"][key].is_null(),
                    "secret {secret} has no key {key}"
                );
            }
        }
        assert!(
            !c["resources"]["requests"].is_null(),
            "container {:?} has no resource requests",
            c["name"]
        );
    }
    let labels = &workload["spec"]["template"]["metadata"]["labels"];
    for (k, v) in workload["spec"]["selector"]["matchLabels"]
        .as_mapping()
        .expect("matchLabels")
    {
        assert_eq!(
            &labels[k.as_str().expect("key")],
            v,
            "selector must match the pod labels"
        );
    }
}

fn volume<'a>(spec: &'a Value, name: &str) -> &'a Value {
    seq(spec, &["volumes"])
        .iter()
        .find(|v| v["name"].as_str() == Some(name))
        .unwrap_or_else(|| panic!("no volume {name}"))
}

#[test]
fn agent_daemonset_host_network_cache_init_step_probes() {
    let objs = all_objects();
    let ds = find(&objs, "DaemonSet", "starling-agent");
    check_pod_refs(&objs, ds);
    let spec = &ds["spec"]["template"]["spec"];
    assert_eq!(spec["hostNetwork"].as_bool(), Some(true));
    assert_eq!(s(spec, &["dnsPolicy"]), "ClusterFirstWithHostNet");

    let agent = &seq(spec, &["containers"])[0];
    let cache_mount = seq(agent, &["volumeMounts"])
        .iter()
        .find(|m| s(m, &["mountPath"]) == "/var/lib/starling")
        .expect("cache mount");
    let cache = volume(spec, s(cache_mount, &["name"]));
    assert_eq!(s(cache, &["hostPath", "path"]), "/var/lib/starling");
    let probe = &agent["readinessProbe"]["httpGet"];
    assert_eq!(
        (s(probe, &["path"]), probe["port"].as_u64()),
        ("/healthz", Some(5050))
    );
    assert_eq!(s(agent, &["livenessProbe", "httpGet", "path"]), "/healthz");
    assert_eq!(seq(agent, &["args"])[0].as_str(), Some("agent"));

    let init = &seq(spec, &["initContainers"])[0];
    let cmd: Vec<&str> = seq(init, &["command"])
        .iter()
        .map(|v| v.as_str().expect("arg"))
        .collect();
    assert_eq!(&cmd[..3], ["starling", "setup", "containerd"]);
    let flag = |f: &str| {
        cmd.iter()
            .position(|a| *a == f)
            .map(|i| cmd[i + 1])
            .unwrap_or_else(|| panic!("no {f}"))
    };
    assert_eq!(flag("--certs-dir"), "/host/etc/containerd/certs.d");
    assert_eq!(flag("--mirror"), "http://127.0.0.1:5050");
    assert_eq!(
        flag("--containerd-config"),
        "/host/etc/containerd/config.toml"
    );
    let m = seq(init, &["volumeMounts"])
        .iter()
        .find(|m| s(m, &["mountPath"]) == "/host/etc/containerd")
        .expect("host containerd mount");
    assert_eq!(
        s(volume(spec, s(m, &["name"])), &["hostPath", "path"]),
        "/etc/containerd"
    );

    // The agent config parses and points at the tracker Service.
    let cm = find(&objs, "ConfigMap", "starling-agent");
    let cfg: toml::Value = toml::from_str(s(cm, &["data", "agent.toml"])).expect("agent.toml");
    assert_eq!(
        cfg["listen"].as_str(),
        Some("127.0.0.1:5050"),
        "the mirror serves the node's own runtimes only"
    );
    assert_eq!(cfg["cache_dir"].as_str(), Some("/var/lib/starling"));
    // Prometheus scrapes the metrics listener, not the loopback mirror, with a token.
    let metrics_port = cfg["metrics_listen"]
        .as_str()
        .and_then(|l| l.rsplit(':').next())
        .expect("metrics_listen host:port");
    assert_eq!(
        s(
            &ds["spec"]["template"]["metadata"],
            &["annotations", "prometheus.io/port"]
        ),
        metrics_port
    );
    assert!(
        seq(agent, &["env"]).iter().any(|e| {
            s(e, &["name"]) == "STARLING_METRICS_TOKEN"
                && s(e, &["valueFrom", "secretKeyRef", "name"]) == "starling-metrics"
        }),
        "the metrics token comes from a Secret"
    );
    assert_eq!(cfg["tracker"].as_str(), Some(tracker_url(&objs).as_str()));
    assert!(
        cfg["pin"].as_array().is_some_and(|p| !p.is_empty()),
        "node preload pins"
    );
    let mount = seq(agent, &["volumeMounts"])
        .iter()
        .find(|m| s(m, &["name"]) == "config")
        .expect("config mount");
    assert_eq!(
        format!("{}/agent.toml", s(mount, &["mountPath"])),
        seq(agent, &["args"])[2].as_str().expect("path")
    );
}

fn tracker_url(objs: &[Value]) -> String {
    let svc = find(objs, "Service", "starling-tracker");
    let port = seq(svc, &["spec", "ports"])[0]["port"]
        .as_u64()
        .expect("port");
    format!("https://starling-tracker.starling.svc.cluster.local:{port}")
}

#[test]
fn tracker_deployment_and_service() {
    let objs = all_objects();
    let dep = find(&objs, "Deployment", "starling-tracker");
    check_pod_refs(&objs, dep);
    assert_eq!(dep["spec"]["replicas"].as_u64(), Some(1));
    assert_eq!(s(dep, &["spec", "strategy", "type"]), "Recreate");
    let c = &seq(dep, &["spec", "template", "spec", "containers"])[0];
    assert_eq!(s(c, &["readinessProbe", "httpGet", "path"]), "/healthz");
    assert_eq!(s(c, &["readinessProbe", "httpGet", "scheme"]), "HTTPS");
    // Mutual TLS: the cluster CA comes from a Secret mounted where --pki points.
    let args: Vec<&str> = seq(c, &["args"])
        .iter()
        .filter_map(|a| a.as_str())
        .collect();
    let pki_dir = args
        .iter()
        .position(|a| *a == "--pki")
        .and_then(|i| args.get(i + 1))
        .expect("tracker runs with --pki");
    let spec = &dep["spec"]["template"]["spec"];
    let mount = seq(c, &["volumeMounts"])
        .iter()
        .find(|m| s(m, &["mountPath"]) == *pki_dir)
        .expect("the PKI directory is mounted");
    assert!(
        volume(spec, s(mount, &["name"]))["secret"]["secretName"]
            .as_str()
            .is_some(),
        "the PKI directory comes from a Secret"
    );
    let ports = seq(c, &["ports"]);
    assert_eq!(
        (s(&ports[0], &["name"]), ports[0]["containerPort"].as_u64()),
        ("http", Some(7070))
    );
    let svc = find(&objs, "Service", "starling-tracker");
    assert_eq!(s(&seq(svc, &["spec", "ports"])[0], &["targetPort"]), "http");
    let pod_labels = &dep["spec"]["template"]["metadata"]["labels"];
    for (k, v) in svc["spec"]["selector"].as_mapping().expect("selector") {
        assert_eq!(&pod_labels[k.as_str().expect("k")], v);
    }
}

#[tokio::test]
async fn scheduler_config_points_at_routes_the_router_serves() {
    let cfg = docs("scheduler-config.yaml");
    assert_eq!(cfg.len(), 1);
    let c = &cfg[0];
    assert_eq!(s(c, &["apiVersion"]), "kubescheduler.config.k8s.io/v1");
    assert_eq!(s(c, &["kind"]), "KubeSchedulerConfiguration");
    let ext = &seq(c, &["extenders"])[0];
    assert_eq!(s(ext, &["urlPrefix"]), tracker_url(&all_objects()));
    assert_eq!(ext["nodeCacheCapable"].as_bool(), Some(true));
    assert_eq!(ext["ignorable"].as_bool(), Some(true));
    assert!(ext["weight"].as_u64().is_some_and(|w| w >= 1));
    assert_eq!(s(ext, &["httpTimeout"]), "2s");
    // The tracker needs a client certificate on every route but /healthz.
    assert_eq!(ext["enableHTTPS"].as_bool(), Some(true));
    for key in ["certFile", "keyFile", "caFile"] {
        assert!(
            ext["tlsConfig"][key].as_str().is_some(),
            "extender tlsConfig.{key}"
        );
    }
    let disabled = seq(&seq(c, &["profiles"])[0], &["plugins", "score", "disabled"]);
    assert_eq!(s(&disabled[0], &["name"]), "ImageLocality");

    let state = ClusterState::with_options(
        ClusterConfig::default(),
        JobStore::in_memory().expect("store"),
        None,
        std::sync::Arc::new(|| 0),
    );
    for verb in ["filterVerb", "prioritizeVerb"] {
        let path = format!("/{}", s(ext, &[verb]));
        let body = serde_json::json!({"Pod": {"metadata": {"name": "p"}, "spec": {"containers": []}}, "NodeNames": ["n1"]});
        let req = Request::post(&path)
            .header("content-type", "application/json")
            .body(Body::from(body.to_string()))
            .expect("req");
        let resp = router(state.clone()).oneshot(req).await.expect("resp");
        assert_eq!(resp.status(), StatusCode::OK, "{verb} {path}");
    }
}

#[test]
fn grafana_dashboard_uses_existing_metrics() {
    let text =
        std::fs::read_to_string(repo().join("deploy/grafana/starling.json")).expect("dashboard");
    let dash: serde_json::Value = serde_json::from_str(&text).expect("JSON");
    assert_eq!(dash["uid"], "starling-cluster");
    let agent_metrics = [
        "starling_agent_requests_total",
        "starling_agent_served_bytes_total",
        "starling_agent_upstream_bytes_total",
        "starling_agent_blob_duration_seconds_bucket",
        "starling_agent_cache_hits_total",
        "starling_agent_cache_misses_total",
        "starling_agent_cache_used_bytes",
        "starling_agent_evictions_total",
    ];
    // The agent really registers these (name without prefix and type suffix).
    let agent_src =
        std::fs::read_to_string(repo().join("crates/agent/src/metrics.rs")).expect("agent metrics");
    for m in agent_metrics {
        let stem = m
            .trim_start_matches("starling_agent_")
            .trim_end_matches("_total")
            .trim_end_matches("_bucket");
        assert!(
            agent_src.contains(&format!("\"{stem}\"")),
            "agent does not register {stem}"
        );
    }
    let mut known: BTreeSet<String> = agent_metrics.iter().map(|s| (*s).to_owned()).collect();
    for m in cluster::metrics::METRIC_NAMES {
        known.insert((*m).to_owned());
        for suffix in ["_bucket", "_sum", "_count"] {
            if *m == "starling_cluster_prewarm_lead_seconds"
                || *m == "starling_cluster_extender_seconds"
            {
                known.insert(format!("{m}{suffix}"));
            }
        }
    }
    let re = regex::Regex::new(r"starling_[a-z_]+").expect("regex");
    let mut used = BTreeSet::new();
    let mut ids = BTreeSet::new();
    let panels = dash["panels"].as_array().expect("panels");
    for p in panels {
        assert!(
            ids.insert(p["id"].as_u64().expect("id")),
            "duplicate panel id"
        );
        assert!(p["gridPos"]["w"].as_u64().is_some());
        let targets = p["targets"].as_array().expect("targets");
        assert!(!targets.is_empty(), "panel {} has no query", p["title"]);
        for t in targets {
            let expr = t["expr"].as_str().expect("expr");
            assert_eq!(
                expr.matches('(').count(),
                expr.matches(')').count(),
                "unbalanced: {expr}"
            );
            let names: Vec<&str> = re.find_iter(expr).map(|m| m.as_str()).collect();
            assert!(!names.is_empty(), "no starling metric in {expr}");
            for n in names {
                assert!(
                    known.contains(n),
                    "{n} in {expr:?} is not a metric we export"
                );
                used.insert(n.to_owned());
            }
        }
    }
    for required in [
        "starling_cluster_pull_seconds",
        "starling_cluster_registry_bytes_saved_total",
        "starling_cluster_prewarm_lead_seconds_bucket",
        "starling_agent_cache_hits_total",
        "starling_agent_cache_misses_total",
    ] {
        assert!(
            used.contains(required),
            "dashboard does not chart {required}"
        );
    }
}

#[test]
fn ha_tracker_replicas_share_redis_and_are_ready_only_with_it() {
    let objs = ha_objects();
    let dep = find(&objs, "Deployment", "starling-tracker");
    check_pod_refs(&objs, dep);
    assert!(
        dep["spec"]["replicas"].as_u64() >= Some(2),
        "at least two replicas"
    );
    let c = &seq(dep, &["spec", "template", "spec", "containers"])[0];
    assert_eq!(s(c, &["readinessProbe", "httpGet", "path"]), "/readyz");
    let redis_url = seq(c, &["env"])
        .iter()
        .find(|e| e["name"].as_str() == Some("STARLING_TRACKER_REDIS"))
        .map(|e| s(e, &["value"]))
        .expect("the replicas are given Redis");
    assert!(
        redis_url.contains("starling-redis.starling.svc"),
        "{redis_url}"
    );
    assert!(
        !redis_url.contains("change-me"),
        "the password comes from a Secret, not the manifest"
    );
    let pdb = find(&objs, "PodDisruptionBudget", "starling-tracker");
    assert_eq!(
        pdb["spec"]["selector"]["matchLabels"],
        dep["spec"]["selector"]["matchLabels"]
    );
    // Redis keeps its data on a claim of its own (volumeClaimTemplates), its
    // configuration in a ConfigMap.
    let redis = find(&objs, "StatefulSet", "starling-redis");
    let claims: Vec<&str> = seq(redis, &["spec", "volumeClaimTemplates"])
        .iter()
        .map(|c| s(c, &["metadata", "name"]))
        .collect();
    let spec = &redis["spec"]["template"]["spec"];
    for m in seq(&seq(spec, &["containers"])[0], &["volumeMounts"]) {
        let name = s(m, &["name"]);
        if !claims.contains(&name) {
            let v = volume(spec, name);
            if let Some(cm) = v["configMap"]["name"].as_str() {
                find(&objs, "ConfigMap", cm);
            }
        }
    }
    let svc = find(&objs, "Service", "starling-redis");
    let pod_labels = &spec_labels(redis);
    for (k, v) in svc["spec"]["selector"].as_mapping().expect("selector") {
        assert_eq!(&pod_labels[k.as_str().expect("k")], v);
    }
    let namespaced = objs.iter().filter(|o| {
        !matches!(
            o["kind"].as_str(),
            Some("Namespace" | "ClusterRole" | "ClusterRoleBinding")
        )
    });
    for o in namespaced {
        assert_eq!(
            s(o, &["metadata", "namespace"]),
            "starling",
            "{} {}",
            s(o, &["kind"]),
            s(o, &["metadata", "name"])
        );
    }
}

fn spec_labels(workload: &Value) -> Value {
    workload["spec"]["template"]["metadata"]["labels"].clone()
}
