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

    /// Registry connections in use: runs streaming, and runs whose GET is on its way.
    pub(super) fn registry_connections(&self) -> u32 {
        (self.runs.len() + self.opening.len()) as u32
    }

    /// The runs to start now for the open stretch `[a, b)`, one per idle registry
    /// connection (`swarm::pieces::plan_registry_runs`), sized from the rate so far.
    pub(super) fn plan_runs(&self, a: u32, b: u32) -> Vec<(u32, u32)> {
        let streams = self.registry_stream_cap();
        let free = streams.saturating_sub(self.registry_connections());
        let seconds = self
            .registry_since
            .map_or(0.0, |t| t.elapsed().as_secs_f64());
        let run_bytes = swarm::pieces::registry_run_bytes(self.registry_bytes, seconds, streams);
        swarm::pieces::plan_registry_runs(self.layout, a, b, free, streams, run_bytes)
    }

    /// Asks the registry for exactly the bytes of each run in `plan`, in turn, on a
    /// task of its own: each answer comes back as `Internal::RunOpened`, and the runs'
    /// pieces are claimed meanwhile. Awaited here, each GET held up every other run's
    /// bytes, the peers' events and the first stream for a registry round trip (three
    /// of them before a 4-connection source served its first byte). In turn, not all
    /// at once: the first run, the front of the blob that readers and the piece hashes
    /// wait on, streams alone for a round trip (the simulator, which starts runs this
    /// way, gave `seed-100x5gb` 1.270 × T* over 8 seeds, and 1.288 with every GET at
    /// once).
    pub(super) fn open_runs(&mut self, plan: Vec<(u32, u32)>) {
        if plan.is_empty() {
            return;
        }
        for &(first, end) in &plan {
            for i in first..end {
                self.sched.claim(i);
            }
        }
        self.opening.extend(plan.iter().copied());
        let layout = self.layout;
        let (agent, tx) = (self.agent.clone(), self.internal_tx.clone());
        let (registry, repo, d) = (self.registry.clone(), self.repo.clone(), self.d.clone());
        tokio::spawn(async move {
            for (first, end) in plan {
                let start = layout.range(first).0;
                let stop = layout.range(end - 1).1;
                // Exactly the run's bytes: the registry sends no more than needed.
                let bounded = (stop < layout.blob_size).then_some(stop);
                let answer = agent
                    .upstream
                    .get_blob_range(&registry, &repo, &d, start, bounded)
                    .await
                    .map(|r| r.stream);
                let opened = Internal::RunOpened {
                    first,
                    end,
                    answer: Box::new(answer),
                };
                if tx.send(opened).await.is_err() {
                    return;
                }
            }
        });
        // A new registry fetcher: say so at once, so the tracker keeps the election.
        self.spawn_announce(false);
    }

    /// The registry answered the GET of the run `[first, end)`.
    pub(super) async fn run_opened(
        &mut self,
        first: u32,
        end: u32,
        answer: Result<oci::upstream::ByteStream, oci::Error>,
    ) {
        let Some(at) = self.opening.iter().position(|&r| r == (first, end)) else {
            return;
        };
        self.opening.swap_remove(at);
        let still_reading = self.role == Role::Source || self.on_its_own();
        match answer {
            Ok(stream) if still_reading => {
                self.stream_run(first, end, stream);
                return;
            }
            // Deposed while the GET was on its way: the stream is dropped unread.
            Ok(_) => {}
            Err(
                e @ oci::Error::Upstream {
                    status: 404 | 410 | 412,
                    ..
                },
            ) => self.origin_gone = Some(e.to_string()),
            Err(e) => {
                warn!(digest = %self.d, error = %e, "cannot start a registry run; retrying shortly");
                self.registry_retry_at = Some(Instant::now() + Duration::from_millis(500));
            }
        }
        for i in first..end {
            self.sched.unclaim(i);
        }
    }

    /// Reads the run `[first, end)` from `stream`.
    pub(super) fn stream_run(&mut self, first: u32, end: u32, stream: oci::upstream::ByteStream) {
        let start = self.layout.range(first).0;
        let stop = self.layout.range(end - 1).1;
        self.registry_since.get_or_insert_with(Instant::now);
        let id = match self.w.start_run(first, end) {
            Ok(id) => id,
            Err(e) => {
                warn!(digest = %self.d, error = %e, "cannot start a registry run");
                for i in first..end {
                    self.sched.unclaim(i);
                }
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
        // Runs whose GET is on its way end now; their answers find nothing to start.
        for (first, end) in std::mem::take(&mut self.opening) {
            for i in first..end {
                self.sched.unclaim(i);
            }
        }
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
}
