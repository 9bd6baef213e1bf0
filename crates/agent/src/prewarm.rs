//! Prewarm assignments: collected from the tracker, checked, journalled, fetched
//! through the swarm at the job's rate, pinned until the TTL, and stopped when the
//! tracker cancels the job or its deadline passes.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cluster::wire::{Assignment, NodeUpdate};
use oci::{Digest, ImageReference, Manifest, ManifestRef};
use tracing::{debug, info, warn};

use crate::cluster::unix_now;
use crate::{Agent, Error};

/// Largest body of collected assignments read (a job of ~50k blobs).
const MAX_ASSIGNMENT_BYTES: usize = 8 << 20;

/// Clock difference between tracker and agent tolerated when checking an assignment's
/// pin and deadline against their maxima.
const CLOCK_SKEW_SECONDS: u64 = 3600;

impl Agent {
    /// Sends one prewarm update; what the tracker made of it.
    async fn prewarm_update(&self, job: u64, update: &NodeUpdate) -> UpdateAnswer {
        let Some(p2p) = &self.p2p else {
            return UpdateAnswer::Unsettled;
        };
        let node = &self.cfg.node_name;
        match p2p
            .trackers()
            .send(|base| {
                p2p.authed(
                    p2p.http
                        .post(format!("{base}/api/v1/prewarm/{job}/nodes/{node}"))
                        .json(update),
                )
                .timeout(Duration::from_secs(5))
            })
            .await
        {
            Ok(r) if r.status().is_success() => UpdateAnswer::Taken,
            // This route's only conflict: the job was cancelled for this node.
            Ok(r) if r.status() == reqwest::StatusCode::CONFLICT => UpdateAnswer::Cancelled,
            Ok(r) if r.status() == reqwest::StatusCode::GONE => UpdateAnswer::DeadlinePassed,
            Ok(r) => {
                debug!(job, status = %r.status(), "prewarm progress refused");
                if r.status().is_client_error()
                    && r.status() != reqwest::StatusCode::TOO_MANY_REQUESTS
                {
                    UpdateAnswer::Refused
                } else {
                    UpdateAnswer::Unsettled
                }
            }
            Err(e) => {
                debug!(job, error = %e, "cannot report prewarm progress");
                UpdateAnswer::Unsettled
            }
        }
    }

    /// Sends a node's last word on a job (done or failed), again while it is not
    /// settled, until `until` (unix seconds: the job's end for this node). The tracker
    /// finishes a working node on its word (or, for a job that does not import into
    /// the runtime, on a report showing the job's pins), so a lost word would leave it
    /// running until the job's deadline, or for good without one: a tracker down for
    /// minutes (a rolling restart, its Redis failing over) must not cost that.
    /// The word is journalled first (`prewarm_journal`), so an agent restarted
    /// before a tracker took it sends it again.
    async fn prewarm_final_update(&self, job: u64, update: NodeUpdate, until: u64) {
        self.prewarm_jobs.record_word(job, &update);
        self.send_final_update(job, &update, until).await;
        self.prewarm_jobs.settle(job);
    }

    async fn send_final_update(&self, job: u64, update: &NodeUpdate, until: u64) {
        let mut wait = FINAL_UPDATE_FIRST_WAIT;
        loop {
            if self.prewarm_update(job, update).await != UpdateAnswer::Unsettled {
                return;
            }
            if unix_now() >= until {
                warn!(
                    job,
                    "no tracker took this node's last prewarm update before the job's end"
                );
                return;
            }
            if wait == FINAL_UPDATE_MAX_WAIT {
                debug!(
                    job,
                    "no tracker takes this node's last prewarm update yet; sending it again"
                );
            }
            tokio::time::sleep(wait).await;
            wait = (wait * 2).min(FINAL_UPDATE_MAX_WAIT);
        }
    }

    /// Fetches one blob through this agent's own mirror path (cache, swarm, registry)
    /// and drains it, counting bytes into `done`.
    pub(crate) async fn warm_blob(
        &self,
        registry: &str,
        repo: &str,
        d: &Digest,
        done: &AtomicU64,
        limit: Option<Arc<ratelimit::TokenBucket>>,
    ) -> Result<(), Error> {
        if let Some(rec) = self.store.stat(d) {
            done.fetch_add(rec.size, Ordering::Relaxed);
            return Ok(());
        }
        // The same path a client takes (cache, swarm, registry), drained here, at the
        // assignment's rate.
        let (source, total) = self.acquire(registry, repo, d, limit).await?;
        // A warm-up only keeps what the cache keeps: streaming a blob that cannot be
        // cached would cost the registry a copy per node for nothing.
        if let crate::fetch::Source::Passthrough(why) = source {
            return Err(Error::Prewarm(format!(
                "blob {d} ({total} bytes) cannot be cached on this node: {why}; not read"
            )));
        }
        let (tx, mut rx) = tokio::sync::mpsc::channel(2);
        let (agent, reg, rep, dg) = (
            self.clone(),
            registry.to_owned(),
            repo.to_owned(),
            d.clone(),
        );
        tokio::spawn(async move {
            agent
                .copy_range(&reg, &rep, &dg, (0, total, total), &tx, None, Some(source))
                .await
        });
        while let Some(item) = rx.recv().await {
            done.fetch_add(item?.len() as u64, Ordering::Relaxed);
        }
        // The download task finishes (verifies, moves into the store) just after the
        // last byte was handed out.
        for _ in 0..100 {
            if self.store.stat(d).is_some() {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Err(Error::Prewarm(format!(
            "blob {d} did not reach the cache (disk full?)"
        )))
    }

    /// A file of an assignment, read from its origin (only if this agent's
    /// `allowed_file_origins` allow it) through the same path as `starling get`: the
    /// swarm, single flight, the cache. The key the tracker was given must still be the
    /// file's key here, else the origin changed the file since the job was submitted.
    async fn warm_file(
        &self,
        a: &Assignment,
        key: &Digest,
        done: &AtomicU64,
        limit: Option<Arc<ratelimit::TokenBucket>>,
    ) -> Result<(), Error> {
        let source = a.files.iter().find(|f| &f.key == key).ok_or_else(|| {
            Error::Prewarm(format!("file {key}: the assignment has no URL for it"))
        })?;
        let url = url::Url::parse(&source.url)
            .map_err(|e| Error::Prewarm(format!("file {key}: bad URL: {e}")))?;
        let digest = source.content_digest.then(|| key.clone());
        let prepared = crate::files::prepare_file(self, &url, digest.as_ref()).await?;
        if &prepared.key != key || prepared.origin.size != source.size {
            return Err(Error::Prewarm(format!(
                "file {}: the origin now serves another version (key {}, {} bytes) than the \
                 job was submitted for (key {key}, {} bytes)",
                prepared.origin.identity_url(),
                prepared.key,
                prepared.origin.size,
                source.size
            )));
        }
        self.warm_blob(&prepared.registry, "file", key, done, limit)
            .await
    }

    async fn run_assignment(self, a: Assignment) {
        let started = Instant::now();
        let done = Arc::new(AtomicU64::new(0));
        // One bucket for the whole assignment: its rate is the node's prewarm budget.
        let limit = a
            .bytes_per_sec
            .map(|bps| Arc::new(ratelimit::TokenBucket::new(bps.max(1))));
        // The tracker answers a cancelled node's progress with a conflict: the work
        // stops there, within about a second of the cancel. The first word is awaited
        // before any byte is read: an assignment can wait in the tracker's mailbox
        // while its job is cancelled, and such a one reads nothing.
        // Its deadline is the tracker's word too: a node whose clock runs behind is
        // told the deadline passed in the answer to its progress.
        let first = NodeUpdate::Progress { bytes_done: 0 };
        match self.prewarm_update(a.job_id, &first).await {
            UpdateAnswer::Cancelled => {
                self.stop_cancelled_prewarm(&a, &done);
                return;
            }
            UpdateAnswer::DeadlinePassed => {
                warn!(
                    job = a.job_id,
                    "prewarm not started: the tracker says its deadline passed"
                );
                return;
            }
            _ => {}
        }
        let (stop, mut stop_heard) = tokio::sync::oneshot::channel::<UpdateAnswer>();
        let reporter = {
            let (agent, done, job) = (self.clone(), done.clone(), a.job_id);
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(PROGRESS_EVERY).await;
                    let progress = NodeUpdate::Progress {
                        bytes_done: done.load(Ordering::Relaxed),
                    };
                    let answer = agent.prewarm_update(job, &progress).await;
                    if matches!(
                        answer,
                        UpdateAnswer::Cancelled | UpdateAnswer::DeadlinePassed
                    ) {
                        let _ = stop.send(answer);
                        return;
                    }
                }
            })
        };
        let work = async {
            for (reference, digest) in &a.images {
                let r = ImageReference::parse(reference)?;
                let md = Digest::parse(digest)?;
                if r.registry == cluster::wire::FILE_REGISTRY {
                    self.warm_file(&a, &md, &done, limit.clone()).await?;
                    self.store.pin(
                        &md,
                        Some(a.pin_until),
                        &format!("prewarm job {} (file {md})", a.job_id),
                    )?;
                    continue;
                }
                let m = self
                    .manifest(
                        &r.registry,
                        &r.repository,
                        &ManifestRef::Digest(md.clone()),
                        None,
                    )
                    .await?;
                let parsed = Manifest::parse(&m.body)?;
                for b in parsed.blobs() {
                    self.warm_blob(&r.registry, &r.repository, &b.digest, &done, limit.clone())
                        .await?;
                }
                // Pin after the content is here: GC cannot undo the prewarm until the TTL.
                self.store.pin(
                    &md,
                    Some(a.pin_until),
                    &format!("prewarm job {} ({reference})", a.job_id),
                )?;
                if a.into_runtime {
                    self.pull_into_runtime(&r, &md).await?;
                }
            }
            Ok::<(), Error>(())
        };
        let result = tokio::select! {
            // A passed deadline or a cancel stops the work even when both are ready.
            biased;
            Ok(answer) = &mut stop_heard => {
                if answer == UpdateAnswer::Cancelled {
                    self.stop_cancelled_prewarm(&a, &done);
                    return;
                }
                Err(Error::Prewarm(format!(
                    "deadline passed by the tracker's clock with {} bytes fetched; stopped",
                    done.load(Ordering::Relaxed)
                )))
            }
            () = deadline_passes(a.deadline_at) => Err(Error::Prewarm(format!(
                "deadline passed with {} bytes fetched; stopped",
                done.load(Ordering::Relaxed)
            ))),
            r = work => r,
        };
        reporter.abort();
        match result {
            Ok(()) => {
                info!(
                    job = a.job_id,
                    bytes = done.load(Ordering::Relaxed),
                    seconds = format!("{:.2}", started.elapsed().as_secs_f64()),
                    "prewarm done"
                );
                self.report_now().await;
                self.prewarm_update(
                    a.job_id,
                    &NodeUpdate::Progress {
                        bytes_done: done.load(Ordering::Relaxed),
                    },
                )
                .await;
                self.prewarm_final_update(a.job_id, NodeUpdate::Done, last_word_until(&a))
                    .await;
            }
            Err(reason) => {
                warn!(job = a.job_id, %reason, "prewarm failed");
                self.prewarm_final_update(
                    a.job_id,
                    NodeUpdate::Failed {
                        reason: reason.to_string(),
                    },
                    last_word_until(&a),
                )
                .await;
            }
        }
    }

    /// What a node does with a job the tracker cancelled for it: nothing more, and it
    /// drops the pins the job set here (a pin set since by another job stays). The
    /// blob being fetched when the cancel came finishes, as any download does that a
    /// client might share; nothing after it is read.
    fn stop_cancelled_prewarm(&self, a: &Assignment, done: &AtomicU64) {
        let ours = format!("prewarm job {} (", a.job_id);
        let mut unpinned = 0;
        for (d, pin) in self.store.pins() {
            if pin.reason.starts_with(&ours) {
                match self.store.unpin(&d) {
                    Ok(()) => unpinned += 1,
                    Err(e) => {
                        warn!(job = a.job_id, digest = %d, error = %e, "cannot drop a cancelled prewarm's pin")
                    }
                }
            }
        }
        self.prewarm_jobs.settle(a.job_id);
        info!(
            job = a.job_id,
            bytes = done.load(Ordering::Relaxed),
            unpinned,
            "prewarm cancelled by the tracker; stopped"
        );
    }

    /// Pulls an image into the node's containerd through this agent (everything is in
    /// the cache by now) and labels it `io.cri-containerd.pinned=pinned` so the
    /// kubelet's image GC, which evicts never-run pre-pulled images first, keeps it.
    async fn pull_into_runtime(&self, r: &ImageReference, digest: &Digest) -> Result<(), Error> {
        let Some(sock) = &self.cfg.containerd_socket else {
            return Err(Error::Prewarm(
                "into_runtime asked but the agent has no --containerd-socket".into(),
            ));
        };
        let hosts = self.cfg.cache_dir.join("runtime-hosts");
        let dir = hosts.join(&r.registry);
        std::fs::create_dir_all(&dir)
            .map_err(|e| Error::Runtime(format!("{}: {e}", dir.display())))?;
        let toml = format!(
            "server = \"{}\"\n\n[host.\"http://127.0.0.1:{}\"]\n  capabilities = [\"pull\", \"resolve\"]\n",
            self.upstream.base_url(&r.registry),
            self.cfg.listen.port()
        );
        std::fs::write(dir.join("hosts.toml"), toml)
            .map_err(|e| Error::Runtime(format!("{}: {e}", dir.display())))?;
        let name = match &r.tag {
            Some(t) => format!("{}/{}:{t}@{digest}", r.registry, r.repository),
            None => format!("{}/{}@{digest}", r.registry, r.repository),
        };
        let ns = &self.cfg.containerd_namespace;
        let mut pull = tokio::process::Command::new("ctr");
        // A job cancelled while the import runs drops this future: the import stops
        // with it rather than finishing unseen.
        pull.kill_on_drop(true)
            .arg("--address")
            .arg(sock)
            .args(["-n", ns, "images", "pull", "--hosts-dir"])
            .arg(&hosts);
        if let Some(s) = &self.cfg.containerd_snapshotter {
            pull.args(["--snapshotter", s]);
        }
        run_ctr(pull.arg(&name), &format!("ctr pull {name}")).await?;
        let mut label = tokio::process::Command::new("ctr");
        label.arg("--address").arg(sock).args([
            "-n",
            ns,
            "images",
            "label",
            &name,
            "io.cri-containerd.pinned=pinned",
        ]);
        run_ctr(&mut label, &format!("ctr label {name}")).await?;
        info!(image = %name, "pulled into containerd and pinned there");
        Ok(())
    }
}

/// Runs a `ctr` command to its end; `what` names it in the error, with ctr's stderr.
async fn run_ctr(cmd: &mut tokio::process::Command, what: &str) -> Result<(), Error> {
    let out = cmd
        .output()
        .await
        .map_err(|e| Error::Runtime(format!("cannot run ctr: {e}")))?;
    if !out.status.success() {
        return Err(Error::Runtime(format!(
            "{what}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}

/// Why an assignment's times are refused: a pin or deadline beyond the maxima the
/// tracker enforces (plus clock skew), which could only come from a broken or forged
/// tracker and would keep content pinned for decades.
fn check_assignment_times(a: &Assignment, now: u64) -> Result<(), Error> {
    let max_pin = now
        .saturating_add(cluster::wire::MAX_PIN_TTL_SECONDS)
        .saturating_add(CLOCK_SKEW_SECONDS);
    if a.pin_until > max_pin {
        return Err(Error::Prewarm(format!(
            "pin_until {} is more than {} s (the maximum pin TTL) from now ({now})",
            a.pin_until,
            cluster::wire::MAX_PIN_TTL_SECONDS
        )));
    }
    if let Some(d) = a.deadline_at {
        let max_deadline = now
            .saturating_add(cluster::wire::MAX_DEADLINE_SECONDS)
            .saturating_add(CLOCK_SKEW_SECONDS);
        if d > max_deadline {
            return Err(Error::Prewarm(format!(
                "deadline_at {d} is more than {} s (the maximum deadline) from now ({now})",
                cluster::wire::MAX_DEADLINE_SECONDS
            )));
        }
    }
    Ok(())
}

/// What a tracker made of a node's prewarm update.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum UpdateAnswer {
    Taken,
    /// Refused for good: the job or the node is unknown there, or the update invalid.
    Refused,
    /// The job was cancelled for this node.
    Cancelled,
    /// The job's deadline has passed by the tracker's clock.
    DeadlinePassed,
    /// No tracker answered, or one failed: worth sending again.
    Unsettled,
}

/// How often a node working on a prewarm tells the tracker its bytes (and so how soon
/// it hears of a cancel).
const PROGRESS_EVERY: Duration = Duration::from_secs(1);

/// Resolves once the job's deadline (unix seconds) has passed, never without one.
/// The tracker fails the node's part then, and the work stops with it: the job the
/// prewarm was for has started, and its pods pull what is missing themselves. What
/// was pinned before stays pinned: those images are whole and were asked for.
async fn deadline_passes(deadline_at: Option<u64>) {
    match deadline_at {
        Some(d) => tokio::time::sleep(Duration::from_secs(d.saturating_sub(unix_now()))).await,
        None => std::future::pending().await,
    }
}

/// The first wait between attempts of a node's last prewarm update; each failed
/// attempt doubles it, up to `FINAL_UPDATE_MAX_WAIT`.
const FINAL_UPDATE_FIRST_WAIT: Duration = Duration::from_millis(250);

/// The longest wait between attempts of a node's last prewarm update: a returning
/// tracker hears from every node within it, at most one update per node and job each.
const FINAL_UPDATE_MAX_WAIT: Duration = Duration::from_secs(8);

/// Until when (unix seconds) a node sends its last word on assignment `a` again:
/// the job's deadline, or its pins' end (the job's purpose) without one, and never
/// more than the longest deadline from now (times a forged assignment may stretch).
fn last_word_until(a: &Assignment) -> u64 {
    let end = a.deadline_at.map_or(a.pin_until, |d| d.min(a.pin_until));
    end.min(unix_now().saturating_add(cluster::wire::MAX_DEADLINE_SECONDS))
}

/// Most assignments taken from one collection: what the tracker keeps per node.
const MAX_ASSIGNMENTS_PER_POLL: usize = cluster::wire::MAX_WAITING_ASSIGNMENTS;

/// How often the agent asks the tracker for prewarm assignments.
const ASSIGNMENT_POLL: Duration = Duration::from_secs(1);

impl Agent {
    /// Collects this node's prewarm assignments from the tracker every second
    /// (`GET /api/v1/assignments`: over mutual TLS with the node certificate, or with
    /// the cluster token and `?node=` in plain mode). The agent has no inbound cluster
    /// API: the tracker never connects to it, so no credential ever travels to an
    /// address taken from a report.
    pub(crate) fn spawn_assignment_poller(&self) {
        if self.p2p.is_none() {
            return;
        }
        self.resume_taken_prewarms();
        let agent = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(ASSIGNMENT_POLL);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                match agent.collect_assignments().await {
                    Ok(list) => {
                        for a in list {
                            agent.accept_assignment(a).await;
                        }
                    }
                    Err(e) => debug!(error = %e, "cannot collect prewarm assignments"),
                }
            }
        });
    }

    async fn collect_assignments(&self) -> Result<Vec<Assignment>, Error> {
        let Some(p2p) = &self.p2p else {
            return Ok(Vec::new());
        };
        let tracker_err = |message: String| Error::Tracker { message };
        let r = p2p
            .trackers()
            .send(|base| {
                p2p.authed(
                    p2p.http
                        .get(format!("{base}/api/v1/assignments"))
                        .query(&[("node", self.cfg.node_name.as_str())]),
                )
                .timeout(Duration::from_secs(5))
            })
            .await
            .map_err(|e| tracker_err(format!("assignments: {e}")))?;
        if !r.status().is_success() {
            return Err(tracker_err(format!("assignments: {}", r.status())));
        }
        let body = crate::read_bounded(r, MAX_ASSIGNMENT_BYTES).await?;
        let list: Vec<Assignment> =
            serde_json::from_slice(&body).map_err(|e| tracker_err(format!("assignments: {e}")))?;
        if list.len() > MAX_ASSIGNMENTS_PER_POLL {
            return Err(tracker_err(format!(
                "{} assignments at once (at most {MAX_ASSIGNMENTS_PER_POLL})",
                list.len()
            )));
        }
        Ok(list)
    }

    /// Checks an assignment (its node, pin and deadline maxima) and starts it; a
    /// refused one goes back to the tracker as failed, with the reason.
    async fn accept_assignment(&self, a: Assignment) {
        let refused = if a.node != self.cfg.node_name {
            Some(format!(
                "assignment for {}, this is {}",
                a.node, self.cfg.node_name
            ))
        } else {
            check_assignment_times(&a, unix_now())
                .err()
                .map(|e| e.to_string())
        };
        let until = last_word_until(&a);
        if let Some(why) = refused {
            warn!(job = a.job_id, %why, "prewarm assignment refused");
            let word = NodeUpdate::Failed { reason: why };
            if self.prewarm_jobs.take(&a, until, Some(word.clone())) {
                self.spawn_final_update(a.job_id, word, until);
            }
            return;
        }
        if !self.prewarm_jobs.take(&a, until, None) {
            info!(
                job = a.job_id,
                "prewarm assignment handed out again while this node still has it; not started twice"
            );
            return;
        }
        info!(job = a.job_id, images = a.images.len(), bytes_per_sec = ?a.bytes_per_sec, seed = a.seed, "prewarm assignment accepted");
        tokio::spawn(self.clone().run_assignment(a));
    }

    /// Sends a last word off the caller's loop: it may be sent again for a while.
    fn spawn_final_update(&self, job: u64, word: NodeUpdate, until: u64) {
        let agent = self.clone();
        tokio::spawn(async move { agent.prewarm_final_update(job, word, until).await });
    }

    /// Finishes what this node had taken before the agent (re)started: sends a word
    /// no tracker took, and runs again an assignment it had not finished (blobs
    /// already cached are not read again).
    fn resume_taken_prewarms(&self) {
        for taken in self
            .prewarm_jobs
            .unfinished(&self.cfg.node_name, unix_now())
        {
            let a = taken.assignment;
            match taken.last_word {
                Some(word) => {
                    info!(
                        job = a.job_id,
                        "sending again this node's last word on a prewarm taken before the restart"
                    );
                    self.spawn_final_update(a.job_id, word, taken.until);
                }
                None => match check_assignment_times(&a, unix_now()) {
                    Ok(()) => {
                        info!(
                            job = a.job_id,
                            "resuming a prewarm assignment taken before the restart"
                        );
                        tokio::spawn(self.clone().run_assignment(a));
                    }
                    Err(why) => {
                        let word = NodeUpdate::Failed {
                            reason: why.to_string(),
                        };
                        self.spawn_final_update(a.job_id, word, taken.until);
                    }
                },
            }
        }
    }
}
