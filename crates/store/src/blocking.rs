//! File I/O that may wait on the filesystem, run without stalling the async runtime.
//!
//! A create or a write needs a journal handle, and ext4 holds new handles while it
//! commits a transaction; another blob's fsync forces such a commit, and in ordered
//! mode the commit first writes out every file's newly allocated data. Measured with
//! `perf trace` in `starling bench swarm` at 4 × 100 MiB/s: creates of piece maps took
//! 107–167 ms and `pwrite`s of piece bytes 25–135 ms on an agent's runtime threads,
//! each holding one of its two runtime threads for that long.
//! Used for the piece map and the commit's record (a few calls per blob); the piece
//! bytes themselves stay inline, where handing the worker over on every 512 KiB write
//! cost more than it saved (BENCHMARKS.md, fourteenth session).

/// Runs `f` (file I/O that may block for a while) on the calling thread. On a
/// multi-thread runtime's worker the worker first hands its other tasks to another
/// thread, so they keep running meanwhile; elsewhere `f` just runs. Unlike a
/// `spawn_blocking` awaited, this adds no await point: the caller's future cannot be
/// dropped while `f`'s write is still under way.
pub(crate) fn may_block<R>(f: impl FnOnce() -> R) -> R {
    match tokio::runtime::Handle::try_current() {
        Ok(h) if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(f)
        }
        _ => f(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outside_a_runtime_it_just_runs() {
        assert_eq!(may_block(|| 7), 7);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn on_a_current_thread_runtime_it_runs_without_panicking() {
        assert_eq!(may_block(|| 7), 7);
    }

    /// While a task blocks the runtime's only worker, a task it spawned still runs:
    /// the blocked worker handed its tasks over.
    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn a_blocked_worker_lets_the_runtimes_other_tasks_run() {
        let blocked = tokio::spawn(async {
            let (tx, rx) = std::sync::mpsc::channel::<()>();
            // Spawned from the worker, so it is queued on that worker: without a
            // hand-over it could not run until the receive below gave up.
            let other = tokio::spawn(async move {
                tx.send(()).expect("the blocked side waits for this");
            });
            let got = may_block(|| rx.recv_timeout(std::time::Duration::from_secs(30)));
            (got.is_ok(), other)
        });
        let (ran, other) = blocked.await.expect("the blocked task finished");
        assert!(ran, "the other task ran while this one blocked");
        other.await.expect("the other task finished");
    }
}
