//! What tracker replicas share about a swarm (issue 14, `--redis`): the shared store
//! holds it, and each replica copies it into its own [`TrackerState`] before deciding an
//! announce, so the decision is the one `TrackerState::announce` makes in the embedded
//! tracker. Only the election is settled outside (atomically in the store): the copy
//! may be a little old, and an election must never be decided on an old copy.

use std::collections::BTreeMap;

use oci::Digest;
use serde::{Deserialize, Serialize};

use super::{Swarm, TrackerState};
use crate::peers::PeerEntry;
use crate::pieces::PieceHash;
use crate::protocol::{AnnounceRequest, Topology};
use crate::Bitfield;

/// One member of a swarm as replicas share it (the store keeps it per node).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SharedPeer {
    pub addr: String,
    #[serde(default)]
    pub topology: Topology,
    #[serde(default)]
    pub have: Option<Bitfield>,
    #[serde(default)]
    pub complete: bool,
    /// Wall-clock milliseconds: replicas compare each other's times.
    pub last_seen: u64,
}

impl SharedPeer {
    /// The entry an announce leaves, as the embedded tracker stores it: a bitfield of
    /// another length than the swarm's, and any bitfield or "complete" said with
    /// another size than the swarm's `size`, are dropped. `None` for a node leaving.
    pub fn of(
        req: &AnnounceRequest,
        size: Option<u64>,
        pieces: u32,
        now: u64,
    ) -> Option<SharedPeer> {
        let conflicting = matches!((size, req.size), (Some(known), Some(said)) if known != said);
        (!req.leaving).then(|| SharedPeer {
            addr: req.addr.clone(),
            topology: req.topology.clone(),
            have: req
                .have
                .clone()
                .filter(|h| h.len() == pieces && !conflicting),
            complete: req.complete && !conflicting,
            last_seen: now,
        })
    }
}

/// A swarm's shared parts, as the store holds them.
#[derive(Clone, Debug, Default)]
pub struct SharedSwarm {
    pub size: Option<u64>,
    /// 0: not chosen yet.
    pub piece_size: u64,
    /// When the swarm was first announced (wall-clock ms); 0: unknown.
    pub born: u64,
    /// The elected registry fetcher, if any.
    pub source: Option<String>,
    /// Members by node; `None`: not read this time (the copy's members stay).
    pub peers: Option<BTreeMap<String, SharedPeer>>,
    /// Piece hashes from the source; `None`: not read this time.
    pub hashes: Option<BTreeMap<u32, PieceHash>>,
    /// Times a source voided its hashes (0: never, or a store that lost its data).
    pub hashes_epoch: u32,
    /// Members' reports of each other, from every replica; `None`: not read this time.
    pub reports: Option<Vec<SharedReport>>,
}

/// One member's report of another (bad pieces, or unreachable), as replicas share it:
/// demotion and handouts count reports however the reporters spread over replicas.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SharedReport {
    pub accused: String,
    pub reporter: String,
    /// Wall-clock milliseconds until which the report stands.
    pub until: u64,
}

impl TrackerState {
    /// Makes this replica's copy of swarm `d` what the store says. The store wins over
    /// the copy: geometry, source and (when read) members and hashes are replaced.
    pub fn adopt(&mut self, d: &Digest, shared: SharedSwarm, now: u64) {
        let swarm = self.swarms.entry(d.clone()).or_insert_with(|| Swarm {
            born: if shared.born > 0 { shared.born } else { now },
            ..Swarm::default()
        });
        if shared.size.is_some() {
            swarm.size = shared.size;
        }
        if shared.piece_size > 0 && shared.piece_size != swarm.piece_size {
            // Hashes are of pieces of one size: another size makes them meaningless.
            swarm.hashes.clear();
            swarm.piece_size = shared.piece_size;
        }
        if shared.born > 0 {
            swarm.born = shared.born;
        }
        swarm.source = shared.source;
        if shared.hashes_epoch > swarm.hashes_epoch {
            // Voided through another replica: what this copy kept is from bad bytes.
            swarm.hashes.clear();
            swarm.hashes_epoch = shared.hashes_epoch;
        }
        let count = swarm.count();
        if let Some(peers) = shared.peers {
            swarm.peers.retain(|p| peers.contains_key(&p.name));
            for (name, p) in peers {
                let have = p.have.filter(|h| h.len() == count);
                swarm.peers.upsert(PeerEntry::new(
                    &name,
                    &p.addr,
                    &p.topology,
                    have,
                    p.complete,
                    p.last_seen,
                ));
            }
        }
        for r in shared.reports.into_iter().flatten() {
            if r.until > now && r.accused != r.reporter && swarm.peers.get(&r.accused).is_some() {
                swarm.record_report(&r.accused, &r.reporter, r.until);
            }
        }
        if let Some(hashes) = shared.hashes {
            // Merged, not replaced: a hash came from an elected source's registry bytes
            // and stays true for this geometry, so a store that lost its data (Redis
            // restarted empty) does not make this replica forget what it served.
            swarm
                .hashes
                .extend(hashes.into_iter().filter(|(i, _)| *i < count));
        }
    }

    /// Overrules this replica's election: the store elected `source` (or nobody).
    /// The registry fetcher this replica's copy names for swarm `d`.
    pub fn source(&self, d: &Digest) -> Option<&str> {
        self.swarms.get(d).and_then(|s| s.source.as_deref())
    }

    /// The source the last announce of swarm `d` demoted (members could not reach
    /// it), once: a shared store must depose it too, or its lease outlives the
    /// decision.
    pub fn take_demoted(&mut self, d: &Digest) -> Option<String> {
        self.swarms.get_mut(d).and_then(|s| s.demoted.take())
    }

    /// The reports the last announce of swarm `d` made (accused, until), once: a
    /// shared store passes them to every replica.
    pub fn take_reports(&mut self, d: &Digest) -> Vec<(String, u64)> {
        self.swarms
            .get_mut(d)
            .map(|s| std::mem::take(&mut s.reported))
            .unwrap_or_default()
    }

    /// Whether the last announce of swarm `d` voided its hashes, once: a shared store
    /// must forget them too and move every replica to the next epoch.
    pub fn take_voided(&mut self, d: &Digest) -> bool {
        self.swarms
            .get_mut(d)
            .is_some_and(|s| std::mem::take(&mut s.voided))
    }

    /// Whether the last announce of swarm `d` replaced its size, once: the elected
    /// source read another from the registry, and a shared store must take it although
    /// the size is otherwise set once.
    pub fn take_regeometried(&mut self, d: &Digest) -> bool {
        self.swarms
            .get_mut(d)
            .is_some_and(|s| std::mem::take(&mut s.regeometried))
    }

    pub fn set_source(&mut self, d: &Digest, source: Option<String>) {
        if let Some(s) = self.swarms.get_mut(d) {
            s.source = source;
        }
    }

    /// The geometry of swarm `d` in this replica's copy: (size, piece size, pieces,
    /// born).
    pub fn geometry(&self, d: &Digest) -> Option<(Option<u64>, u64, u32, u64)> {
        self.swarms
            .get(d)
            .map(|s| (s.size, s.piece_size, s.count(), s.born))
    }

    /// Keeps the hashes of an announce this replica could not settle (the store was out
    /// of reach) when it comes from the source this copy knows: the answer was refused,
    /// but hashes read from the registry by the elected source stay true, and a source's
    /// last announce is sent once.
    pub fn keep_source_hashes(&mut self, req: &AnnounceRequest) {
        let valid = self.valid_hashes(&req.digest, req);
        if let Some(s) = self.swarms.get_mut(&req.digest) {
            if s.source.as_deref() == Some(req.node.as_str()) {
                s.hashes.extend(valid);
            }
        }
    }

    /// Piece hashes a source sent that fit swarm `d` (what the store may keep).
    pub fn valid_hashes(&self, d: &Digest, req: &AnnounceRequest) -> BTreeMap<u32, PieceHash> {
        let count = self.swarms.get(d).map_or(0, Swarm::count);
        req.hashes
            .iter()
            .filter(|(i, _)| **i < count)
            .filter_map(|(i, h)| PieceHash::from_hex(h).ok().map(|h| (*i, h)))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Role, SwarmConfig};

    fn req(node: &str, d: &Digest) -> AnnounceRequest {
        let mut r = AnnounceRequest::new(node, "127.0.0.1:1", &Topology::default(), d);
        r.size = Some(64 << 20);
        r.piece_size = Some(1 << 20);
        r
    }

    #[test]
    fn a_replica_that_adopted_another_ones_source_does_not_elect_again() {
        let d = Digest::of(b"shared");
        let mut first = TrackerState::new(SwarmConfig::default());
        assert_eq!(
            first.announce(&req("a", &d), 1_000).expect("valid").role,
            Role::Source
        );
        let a = SharedPeer::of(&req("a", &d), Some(64 << 20), 64, 1_000).expect("valid");
        let mut second = TrackerState::new(SwarmConfig::default());
        second.adopt(
            &d,
            SharedSwarm {
                size: Some(64 << 20),
                piece_size: 1 << 20,
                born: 1_000,
                source: Some("a".into()),
                peers: Some([("a".to_owned(), a)].into()),
                hashes: None,
                hashes_epoch: 0,
                reports: None,
            },
            1_100,
        );
        let resp = second.announce(&req("b", &d), 1_100).expect("valid");
        assert_eq!(resp.role, Role::Peer);
        assert_eq!(resp.source.as_deref(), Some("a"));
        assert!(resp.peers.iter().any(|p| p.node == "a"));
    }

    #[test]
    fn a_shared_entry_said_with_another_size_holds_nothing() {
        let d = Digest::of(b"other size");
        let mut liar = req("liar", &d);
        liar.complete = true;
        liar.have = Some(crate::Bitfield::full(64));
        let entry = SharedPeer::of(&liar, Some(65 << 20), 64, 0).expect("a member");
        assert!(!entry.complete && entry.have.is_none(), "{entry:?}");
        let entry = SharedPeer::of(&liar, Some(64 << 20), 64, 0).expect("a member");
        assert!(entry.complete && entry.have.is_some());
    }

    #[test]
    fn members_the_store_no_longer_has_leave_the_copy() {
        let d = Digest::of(b"gone");
        let mut t = TrackerState::new(SwarmConfig::default());
        t.announce(&req("a", &d), 0).expect("valid");
        t.announce(&req("b", &d), 0).expect("valid");
        let b = SharedPeer::of(&req("b", &d), Some(64 << 20), 64, 5).expect("valid");
        t.adopt(
            &d,
            SharedSwarm {
                peers: Some([("b".to_owned(), b)].into()),
                ..SharedSwarm::default()
            },
            5,
        );
        assert_eq!(t.stats()[0].peers, 1);
    }

    #[test]
    fn hashes_of_an_unsettled_announce_are_kept_only_from_the_known_source() {
        let d = Digest::of(b"outage hashes");
        let mut t = TrackerState::new(SwarmConfig::default());
        t.announce(&req("src", &d), 0).expect("valid");
        let mut last = req("src", &d);
        last.complete = true;
        last.hashes
            .insert(63, crate::PieceHash::of(b"last").to_hex());
        t.keep_source_hashes(&last);
        let mut forged = req("other", &d);
        forged
            .hashes
            .insert(62, crate::PieceHash::of(b"lie").to_hex());
        t.keep_source_hashes(&forged);
        let kept = t.hashes(&d, 0);
        assert_eq!(kept.keys().copied().collect::<Vec<_>>(), vec![63]);
    }
}
