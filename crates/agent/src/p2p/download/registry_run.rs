//! The elected source's registry runs: which stretches of the blob nobody gives (or
//! everything, as the source), split over several connections as disjoint Range
//! slices; their bytes written into pieces, hashed as they pass and announced.

use super::*;

impl Download {
    /// The next run of consecutive pieces to fetch from the registry (see
    /// `PieceScheduler::registry_run`): nothing being received or awaiting its hash,
    /// and every piece whose hash is not known, whoever holds it.
    pub(super) fn next_registry_run(&self, everything: bool) -> Option<(u32, u32)> {
        let inflight = self.w.inflight();
        self.sched.registry_run(
            everything,
            |i| self.unverified.contains_key(&i) || inflight.is_receiving(i),
            |i| self.hashes.get(i as usize).is_some_and(Option::is_some),
        )
    }

    /// Registry connections this blob may use (`swarm::pieces::registry_streams_for`).
    pub(super) fn registry_stream_cap(&self) -> u32 {
        swarm::pieces::registry_streams_for(self.layout.blob_size, self.registry_streams)
    }

    /// The runs to start now for the open stretch `[a, b)`, one per idle registry
    /// connection (`swarm::pieces::plan_registry_runs`), sized from the rate so far.
    pub(super) fn plan_runs(&self, a: u32, b: u32) -> Vec<(u32, u32)> {
        let streams = self.registry_stream_cap();
        let free = streams.saturating_sub(self.runs.len() as u32);
        let seconds = self
            .registry_since
            .map_or(0.0, |t| t.elapsed().as_secs_f64());
        let run_bytes = swarm::pieces::registry_run_bytes(self.registry_bytes, seconds, streams);
        swarm::pieces::plan_registry_runs(self.layout, a, b, free, streams, run_bytes)
    }

    pub(super) async fn begin_run(
        &mut self,
        first: u32,
        end: u32,
        stream: Option<oci::upstream::ByteStream>,
    ) {
        let start = self.layout.range(first).0;
        let stop = self.layout.range(end - 1).1;
        let stream = match stream {
            Some(s) => s,
            None => {
                // Exactly the run's bytes: the registry sends no more than needed.
                let bounded = (stop < self.layout.blob_size).then_some(stop);
                match self
                    .agent
                    .upstream
                    .get_blob_range(&self.registry, &self.repo, &self.d, start, bounded)
                    .await
                {
                    Ok(r) if r.total.is_some_and(|t| t != self.layout.blob_size) => {
                        self.size_moved = r.total;
                        return;
                    }
                    Ok(r) => r.stream,
                    Err(
                        e @ oci::Error::Upstream {
                            status: 404 | 410 | 412 | 429,
                            ..
                        },
                    ) => {
                        // A 429 here outlasted what a request waits out: runs are
                        // only for bytes no peer gives, so asking again every half
                        // second only spends the registry's quota (and kept readers
                        // waiting on a download that could not go on).
                        self.origin_refused = Some(e.to_string());
                        return;
                    }
                    Err(oci::Error::Upstream { status: 416, .. }) => {
                        // The run starts past the blob's end: the swarm's size is wrong.
                        match self
                            .agent
                            .upstream
                            .head_blob(&self.registry, &self.repo, &self.d)
                            .await
                        {
                            Ok(size) if size != self.layout.blob_size => {
                                self.size_moved = Some(size)
                            }
                            _ => {
                                self.registry_retry_at =
                                    Some(Instant::now() + Duration::from_millis(500))
                            }
                        }
                        return;
                    }
                    Err(e) => {
                        // The request already retried (`oci::upstream`): a registry that
                        // keeps failing is asked less and less often, then the download
                        // ends, and its readers learn it (they waited on nothing before,
                        // while the registry was asked every half second).
                        self.registry_failures += 1;
                        if self.registry_failures >= RUN_START_TRIES {
                            self.origin_refused = Some(format!(
                                "the registry failed {} registry runs in a row; last: {e}",
                                self.registry_failures
                            ));
                            return;
                        }
                        let wait = run_retry_wait(self.registry_failures);
                        warn!(digest = %self.d, error = %e, retry_in_ms = wait.as_millis() as u64, "cannot start a registry run; retrying");
                        self.registry_retry_at = Some(Instant::now() + wait);
                        return;
                    }
                }
            }
        };
        self.registry_since.get_or_insert_with(Instant::now);
        let id = match self.w.start_run(first, end) {
            Ok(id) => id,
            Err(e) => {
                warn!(digest = %self.d, error = %e, "cannot start a registry run");
                return;
            }
        };
        for i in first..end {
            self.sched.claim(i);
        }
        let (stream, stop_handle) = futures::stream::abortable(stream);
        let tagged = stream
            .map(move |c| (id, Some(c)))
            .chain(futures::stream::once(async move { (id, None) }));
        self.streams.push(Box::pin(tagged));
        self.runs.insert(
            id,
            RegistryRun {
                first,
                end,
                left: stop - start,
                stop: stop_handle,
            },
        );
        // A new registry fetcher: say so at once, so the tracker keeps the election.
        self.spawn_announce(false);
    }

    pub(super) async fn on_registry_chunk(
        &mut self,
        id: u32,
        chunk: Option<Result<bytes::Bytes, oci::Error>>,
    ) -> Result<(), store::Error> {
        let Some(left) = self.runs.get(&id).map(|r| r.left) else {
            // A run already finished or aborted: its stream's last words.
            return Ok(());
        };
        match chunk {
            Some(Ok(mut chunk)) => {
                if !chunk.is_empty() {
                    self.registry_failures = 0;
                }
                chunk.truncate(chunk.len().min(left as usize));
                let n = chunk.len() as u64;
                // Registry bytes first on this node's link: they are new to the whole
                // swarm, which waits for them, while peer bytes are copies that other
                // holders can send later.
                if let Some(l) = &self.p2p.download {
                    l.acquire_high(n).await;
                }
                if let Some(l) = &self.limit {
                    l.acquire(n).await;
                }
                self.agent.metrics.upstream_bytes.inc_by(n);
                self.p2p.metrics.registry_bytes.inc_by(n);
                self.registry_bytes += n;
                let out = self.w.write_run(id, chunk).await?;
                self.on_registry_pieces(out.held);
                if let Some(r) = self.runs.get_mut(&id) {
                    r.left -= n;
                }
                if self.w.run_position(id).is_none() {
                    // Done: stop reading (a stream opened unbounded may go on).
                    if let Some(r) = self.runs.remove(&id) {
                        r.stop.abort();
                    }
                    self.refill_registry_runs().await;
                }
                Ok(())
            }
            Some(Err(e)) => {
                warn!(digest = %self.d, error = %e, "registry run ended early; pieces will be retried");
                self.end_run(id).await
            }
            None => {
                warn!(digest = %self.d, "registry stream ended early; pieces will be retried");
                self.end_run(id).await
            }
        }
    }

    /// No longer the source (demoted because its swarm could not reach it, or
    /// replaced after its announces went missing): another member reads the registry
    /// now, so this one's runs end where they are, keeping their whole pieces, and
    /// the rest comes from peers. Otherwise the registry would send the blob twice.
    pub(super) async fn stop_reading_the_registry(&mut self) {
        if self.runs.is_empty() {
            return;
        }
        info!(digest = %self.d, runs = self.runs.len(), "no longer the source: registry reads stop, the rest comes from peers");
        let ids: Vec<u32> = self.runs.keys().copied().collect();
        for id in ids {
            if let Err(e) = self.end_run(id).await {
                warn!(digest = %self.d, error = %e, "cannot keep a stopped run's pieces");
            }
        }
    }

    pub(super) async fn end_run(&mut self, id: u32) -> Result<(), store::Error> {
        let held = self.w.abort_run(id).await?;
        self.on_registry_pieces(held);
        if let Some(run) = self.runs.remove(&id) {
            run.stop.abort();
            for i in run.first..run.end {
                self.sched.unclaim(i);
            }
        }
        self.registry_retry_at = Some(Instant::now() + Duration::from_millis(200));
        Ok(())
    }

    pub(super) fn on_registry_pieces(&mut self, held: Vec<(u32, PieceHash)>) {
        let now = self.now_ms();
        for (i, h) in held {
            self.sched.on_done(i, REGISTRY, now);
            if let Some(slot) = self.hashes.get_mut(i as usize) {
                *slot = Some(h);
            }
            self.publish.insert(i, h.to_hex());
        }
    }

    /// Elected source, or no tracker for a while: fetch what nobody can give, on every
    /// idle registry connection (each tick, and the moment a run ends: a connection
    /// idle until the next tick lost up to 50 ms per half-second run).
    pub(super) async fn refill_registry_runs(&mut self) {
        let on_its_own = self.last_tracker_ok.elapsed() > TRACKER_GRACE
            && self.sched.peer_quiet_ms(self.now_ms()) >= SWARM_QUIET_WITHOUT_TRACKER_MS;
        // Owed pieces go back first: a hash learned since, or a run starting now,
        // may take them.
        for piece in std::mem::take(&mut self.registry_owed) {
            self.sched.unclaim(piece);
        }
        if self.role != Role::Source && !on_its_own {
            return;
        }
        self.drop_unverifiable();
        if (self.runs.len() as u32) < self.registry_stream_cap()
            && self.registry_retry_at.is_none_or(|t| Instant::now() >= t)
        {
            if let Some((a, b)) = self.next_registry_run(on_its_own) {
                for (x, y) in self.plan_runs(a, b) {
                    self.begin_run(x, y, None).await;
                }
            }
        }
        self.owe_unverifiable();
    }

    /// Claims what peers hold that this source cannot check (`registry_owed`), so
    /// that they are not asked for it again and again. Empty unless hashes were lost.
    fn owe_unverifiable(&mut self) {
        let hashes = &self.hashes;
        let owed = self
            .sched
            .held_without_hash(|i| hashes.get(i as usize).is_some_and(Option::is_some));
        for piece in owed {
            self.sched.claim(piece);
            self.registry_owed.insert(piece);
        }
    }
}

/// Registry runs that fail to start in a row before the download ends: 3.5 s of
/// waits between them. Each start already retried (`oci::upstream`), and a request
/// that keeps failing is not even sent for a while that doubles each time
/// (`FailingRequests`), so these tries cost a failing registry little; what they
/// decide is how long readers wait before learning it.
const RUN_START_TRIES: u32 = 4;

/// The wait before the next run after `failures` in a row: 0.5, 1, 2 s (and at most
/// 8 s, should the tries grow).
fn run_retry_wait(failures: u32) -> Duration {
    Duration::from_millis(500u64 << failures.saturating_sub(1).min(4))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failing_registry_is_asked_less_and_less_often() {
        let waits: Vec<u64> = (1..RUN_START_TRIES)
            .map(|n| run_retry_wait(n).as_millis() as u64)
            .collect();
        assert_eq!(waits, [500, 1_000, 2_000]);
        assert_eq!(run_retry_wait(5), Duration::from_secs(8));
        assert_eq!(run_retry_wait(u32::MAX), Duration::from_secs(8));
    }
}
