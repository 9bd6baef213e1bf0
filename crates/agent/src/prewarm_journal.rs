//! The prewarm assignments this node has taken and not yet settled with a tracker,
//! kept in `CACHE_DIR/prewarm-jobs.json`. The tracker hands an assignment out once
//! and then waits for the node's word; an agent restarted mid-job (an upgrade, an OOM
//! kill, a node reboot) forgot both the work and the word, and the node showed
//! "running" until the job's deadline, or for good on a job without one. A restarted
//! agent resumes what it had taken (cached blobs are not read again) and sends a word
//! no tracker took. Written whole and atomically on every change.

use cluster::wire::{Assignment, NodeUpdate};

/// Jobs remembered; those ending first are forgotten first. A tracker keeps at most
/// this many waiting assignments per node, so more taken and unsettled at once means
/// words were lost for a long while.
const MAX_JOBS: usize = cluster::wire::MAX_WAITING_ASSIGNMENTS;

#[derive(Clone, Debug, serde::Serialize, serde::Deserialize, PartialEq)]
pub(crate) struct TakenJob {
    pub(crate) assignment: Assignment,
    /// The node's last word once it has one; sent again until a tracker settles it.
    pub(crate) last_word: Option<NodeUpdate>,
    /// Unix seconds after which neither the work nor the word matters (the job's end).
    pub(crate) until: u64,
}

pub(crate) struct PrewarmJournal {
    jobs: crate::json_file::JsonIndex<u64, TakenJob>,
}

impl PrewarmJournal {
    pub(crate) fn open(cache_dir: &std::path::Path) -> PrewarmJournal {
        PrewarmJournal {
            jobs: crate::json_file::JsonIndex::open(
                cache_dir,
                "prewarm-jobs.json",
                "the prewarm jobs taken",
                MAX_JOBS,
                |j: &TakenJob| j.until,
            ),
        }
    }

    /// Records a job taken, with its word if it already has one (a refusal). False
    /// when this job is taken already: a tracker handing it out again (the node
    /// looked gone for a while) while this agent still works on it or resends its
    /// word must not start it twice.
    pub(crate) fn take(&self, a: &Assignment, until: u64, word: Option<NodeUpdate>) -> bool {
        self.jobs.change(|jobs| {
            if jobs.contains_key(&a.job_id) {
                return false;
            }
            jobs.insert(
                a.job_id,
                TakenJob {
                    assignment: a.clone(),
                    last_word: word,
                    until,
                },
            );
            true
        })
    }

    /// Records the node's last word on `job`, before it is sent.
    pub(crate) fn record_word(&self, job: u64, word: &NodeUpdate) {
        self.jobs.change(|jobs| match jobs.get_mut(&job) {
            Some(j) if j.last_word.as_ref() != Some(word) => {
                j.last_word = Some(word.clone());
                true
            }
            _ => false,
        });
    }

    /// Forgets `job`: a tracker took its word or refused it for good, or its end
    /// passed.
    pub(crate) fn settle(&self, job: u64) {
        self.jobs.change(|jobs| jobs.remove(&job).is_some());
    }

    /// What a starting agent named `node` has to finish: the jobs taken by this node
    /// whose end has not passed at `now`. The others are forgotten.
    pub(crate) fn unfinished(&self, node: &str, now: u64) -> Vec<TakenJob> {
        let mut left = Vec::new();
        self.jobs.change(|jobs| {
            let before = jobs.len();
            jobs.retain(|_, j| j.assignment.node == node && j.until > now);
            left = jobs.values().cloned().collect();
            jobs.len() != before
        });
        left
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assignment(job_id: u64, node: &str) -> Assignment {
        Assignment {
            job_id,
            node: node.into(),
            images: vec![(
                "r.example/a:1".into(),
                format!("sha256:{}", "ab".repeat(32)),
            )],
            blobs: Vec::new(),
            bytes_per_sec: Some(1 << 20),
            pin_until: 2_000,
            deadline_at: None,
            priority: 0,
            seed: false,
            into_runtime: true,
            files: Vec::new(),
        }
    }

    #[test]
    fn a_taken_job_and_its_word_outlive_a_restart_until_settled() {
        let dir = tempfile::tempdir().unwrap();
        let journal = PrewarmJournal::open(dir.path());
        assert!(journal.take(&assignment(7, "n0"), 2_000, None));
        assert!(journal.take(&assignment(8, "n0"), 2_000, None));
        assert!(
            !journal.take(&assignment(7, "n0"), 2_000, None),
            "a job handed out again is not taken twice"
        );
        journal.record_word(8, &NodeUpdate::Done);

        let reopened = PrewarmJournal::open(dir.path());
        let left = reopened.unfinished("n0", 1_000);
        assert_eq!(left.len(), 2);
        assert_eq!(left[0].assignment, assignment(7, "n0"));
        assert_eq!(left[0].last_word, None, "job 7 is resumed");
        assert_eq!(
            left[1].last_word,
            Some(NodeUpdate::Done),
            "job 8's word is sent"
        );

        reopened.settle(8);
        let again = PrewarmJournal::open(dir.path());
        let left = again.unfinished("n0", 1_000);
        assert_eq!(left.len(), 1);
        assert_eq!(left[0].assignment.job_id, 7);
    }

    #[test]
    fn a_job_past_its_end_or_taken_under_another_name_is_forgotten_at_start() {
        let dir = tempfile::tempdir().unwrap();
        let journal = PrewarmJournal::open(dir.path());
        journal.take(&assignment(1, "n0"), 1_500, None);
        journal.take(&assignment(2, "n0"), 2_500, None);
        journal.take(&assignment(3, "old-name"), 2_500, Some(NodeUpdate::Done));
        let left = journal.unfinished("n0", 2_000);
        assert_eq!(
            left.iter().map(|j| j.assignment.job_id).collect::<Vec<_>>(),
            vec![2]
        );
        assert_eq!(
            PrewarmJournal::open(dir.path()).unfinished("n0", 0).len(),
            1
        );
    }

    #[test]
    fn the_journal_keeps_at_most_its_bound_forgetting_the_jobs_ending_first() {
        let dir = tempfile::tempdir().unwrap();
        let journal = PrewarmJournal::open(dir.path());
        for job in 0..(MAX_JOBS as u64 + 5) {
            journal.take(&assignment(job, "n0"), 10_000 + job, None);
        }
        let left = PrewarmJournal::open(dir.path()).unfinished("n0", 0);
        assert_eq!(left.len(), MAX_JOBS);
        assert_eq!(left[0].assignment.job_id, 5);
    }
}
