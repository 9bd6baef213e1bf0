//! The one path every announce takes, embedded or shared: load the shared state into
//! this replica's copy, let `TrackerState::announce` decide, commit the outcome to the
//! store, and let the store overrule what it must (the election, the geometry).

use swarm::state::SharedPeer;
use swarm::{AnnounceRequest, AnnounceResponse, Role};

use crate::store::{Outcome, Refresh, SourceIntent};
use crate::{Error, Tracker};

/// Decides `reqs` (one announce, or one seeding batch). `members`: refresh the copy's
/// members and hashes when due (announces; seeding batches skip it, a seeder needs no
/// handout). The outer error is the store's (nothing was answered); the inner ones are
/// per announce.
pub(crate) async fn decide(
    t: &Tracker,
    reqs: &[AnnounceRequest],
    members: bool,
) -> Result<Vec<Result<AnnounceResponse, Error>>, Error> {
    let refresh = if members {
        Refresh::WhenDue
    } else {
        Refresh::No
    };
    let decided = match decide_with_store(t, reqs, refresh).await {
        Ok(Decided::Answers(mut answers, disputed)) => {
            // Holders disputing a small swarm's size, decided apart on members read
            // when this replica's copy of them is due anyway: the rest of a seeding
            // batch is not read again, and however many holders dispute a size, its
            // members are read at most once per refresh interval (a liar's lie costs
            // the store no more). One not due stays undecided this time.
            if !disputed.is_empty() && refresh != Refresh::WhenDue {
                let again: Vec<AnnounceRequest> =
                    disputed.iter().map(|&i| reqs[i].clone()).collect();
                if let Ok(Decided::Answers(fresh, _)) =
                    decide_with_store(t, &again, Refresh::WhenDue).await
                {
                    for (i, answer) in disputed.into_iter().zip(fresh) {
                        answers[i] = answer;
                    }
                }
            }
            Ok(answers)
        }
        // A new election decided on a copy whose members were not just read (a
        // complete holder may have arrived through another replica): decide again on
        // fresh members, so that a fetcher is elected only when one is needed.
        Ok(Decided::StaleElection) => match decide_with_store(t, reqs, Refresh::Now).await {
            Ok(Decided::Answers(answers, _)) => Ok(answers),
            Ok(Decided::StaleElection) => Err(Error::Conflict {
                digest: reqs
                    .first()
                    .map(|r| r.digest.to_string())
                    .unwrap_or_default(),
                what: "members could not be read fresh for an election",
            }),
            Err(e) => Err(e),
        },
        Err(e) => Err(e),
    };
    if decided.is_err() {
        // Refused (503), but a source's hashes are kept for when the store is back.
        let mut st = t.state.lock();
        for req in reqs.iter().filter(|r| !r.hashes.is_empty()) {
            st.keep_source_hashes(req);
        }
    }
    decided
}

enum Decided {
    /// One answer per announce, and the announces left undecided (their answers are
    /// placeholders, nothing of them committed): holders disputing a small swarm's
    /// size on a copy whose members were not read this time.
    Answers(Vec<Result<AnnounceResponse, Error>>, Vec<usize>),
    /// Nothing committed: an election was decided on members not read this time.
    StaleElection,
}

async fn decide_with_store(
    t: &Tracker,
    reqs: &[AnnounceRequest],
    refresh: Refresh,
) -> Result<Decided, Error> {
    let digests: Vec<oci::Digest> = reqs.iter().map(|r| r.digest.clone()).collect();
    let shared = t.store.load(&digests, refresh).await?;
    let now = t.store.now_ms();
    let mut answers = Vec::with_capacity(reqs.len());
    let mut disputed = Vec::new();
    let mut outcomes = Vec::new();
    {
        let mut st = t.state.lock();
        for (req, shared) in reqs.iter().zip(shared) {
            // The store names no fetcher and this copy's members were not read now.
            let unread_without_source = refresh != Refresh::Now
                && shared
                    .as_ref()
                    .is_some_and(|s| s.source.is_none() && s.peers.is_none());
            // A holder may mend a small swarm's size only if no member backs it, which
            // only members read now can say.
            let members_unread =
                refresh != Refresh::Now && shared.as_ref().is_some_and(|s| s.peers.is_none());
            if let Some(shared) = shared {
                st.adopt(&req.digest, shared, now);
            }
            let was_source = st.source(&req.digest) == Some(req.node.as_str());
            let size_before = st.geometry(&req.digest).and_then(|g| g.0);
            let resp = match st.announce(req, now) {
                Ok(resp) => resp,
                Err(e) => {
                    answers.push(Err(Error::Announce(e)));
                    continue;
                }
            };
            let deposed = st.take_demoted(&req.digest);
            let void_hashes = st.take_voided(&req.digest);
            let regeometry = st.take_regeometried(&req.digest);
            let reports = st.take_reports(&req.digest);
            let (size, piece_size, pieces, born) =
                st.geometry(&req.digest).unwrap_or((None, 0, 0, now));
            // A holder's claim at another size than a small swarm's, mended or not
            // (a complete holder is never the source): whether a member backs the size
            // in force is for members read this time (the reports against the one that
            // set it included) to say.
            let holder_disputes_small_size = req.complete
                && !req.leaving
                && req.size.is_some()
                && req.size != size_before
                && size_before.is_some_and(|s| s < st.cfg.min_p2p_size);
            if holder_disputes_small_size {
                if members_unread {
                    disputed.push(answers.len());
                    answers.push(Err(Error::Conflict {
                        digest: req.digest.to_string(),
                        what: "a small swarm's size is disputed: members could not be read fresh",
                    }));
                    continue;
                }
                if regeometry {
                    tracing::warn!(
                        digest = %req.digest,
                        holder = %req.node,
                        size = ?req.size,
                        "a small swarm's size mended by a complete holder (the member that set it was reported, or is gone)"
                    );
                }
            }
            let intent = if resp.role == Role::Source {
                if unread_without_source {
                    return Ok(Decided::StaleElection);
                }
                SourceIntent::Claim
            } else if req.complete || req.leaving || was_source {
                // Finished, left, or demoted: the role goes.
                SourceIntent::Release
            } else {
                SourceIntent::Keep
            };
            outcomes.push((
                answers.len(),
                Outcome {
                    digest: req.digest.clone(),
                    node: req.node.clone(),
                    // A node sent to the registry (a small blob) is not a member.
                    peer: SharedPeer::of(req, size, pieces, now)
                        .filter(|_| resp.role != Role::Direct),
                    size,
                    piece_size,
                    born,
                    intent,
                    decided_source: resp.source.clone(),
                    deposed,
                    void_hashes,
                    regeometry,
                    reports,
                    hashes: if intent == SourceIntent::Keep {
                        Default::default()
                    } else {
                        st.valid_hashes(&req.digest, req)
                    },
                },
            ));
            answers.push(Ok(resp));
        }
    }
    let (slots, outcomes): (Vec<usize>, Vec<Outcome>) = outcomes.into_iter().unzip();
    let settled = t.store.commit(&outcomes).await?;
    let mut st = t.state.lock();
    for ((slot, outcome), settled) in slots.into_iter().zip(&outcomes).zip(settled) {
        if let Some(node) = &outcome.deposed {
            if settled.source.as_ref() != Some(node) {
                t.metrics.source_demotions.inc();
                tracing::warn!(
                    digest = %outcome.digest,
                    source = %node,
                    "source demoted: the members fetching reported it (unreachable: check its --advertise; or what it serves or says is wrong)"
                );
            }
        }
        let Some(Ok(resp)) = answers.get_mut(slot) else {
            continue;
        };
        if (settled.size, settled.piece_size) != (outcome.size, outcome.piece_size) {
            // Another replica fixed another geometry at the same moment: the next load
            // brings the stored one; this agent asks again (elsewhere, or here).
            t.metrics.store_conflicts.inc();
            answers[slot] = Err(Error::Conflict {
                digest: outcome.digest.to_string(),
                what: "geometry was set by another replica at the same time",
            });
            continue;
        }
        if settled.source != outcome.decided_source {
            // The store elected someone else (or nobody): it is the only judge.
            t.metrics.store_conflicts.inc();
            st.set_source(&outcome.digest, settled.source.clone());
            if resp.role == Role::Source && settled.source.as_deref() != Some(&outcome.node) {
                resp.role = Role::Peer;
            }
            resp.source_alive = settled.source.is_some();
            resp.source = settled.source;
        }
    }
    Ok(Decided::Answers(answers, disputed))
}
