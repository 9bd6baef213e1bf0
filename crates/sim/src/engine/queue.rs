//! The engine's pending timers, in (time, sequence) order.
//!
//! Most timers are set at "now plus a fixed delay" (a frame's latency, a task's
//! tick, a registry round trip): each delay's timers arrive already in order. So a
//! timer goes to the end of the lane whose last timer is the latest not after it,
//! and only one that fits no lane goes into a heap; the next timer is the first of
//! the lanes' heads and the heap's top. Lanes are sorted (a timer joins one only at
//! or after its last, with a larger sequence number), so this pops in exactly the
//! order one heap would, with a queue's cost instead of a heap's walk over memory
//! for nearly every timer (the 10,000-node run keeps hundreds of thousands pending).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};

/// Delay classes that get a lane: more than the engine's distinct fixed delays
/// (peer latency, tick, heartbeat, the registry's latency, polls) need not be.
const LANES: usize = 8;

/// A timer's place: time in ns, then the sequence number given when it was set
/// (unique, increasing).
pub(crate) type Key = (u64, u64);

pub(crate) struct TimerQueue<T> {
    lanes: Vec<VecDeque<(Key, T)>>,
    /// Timers that fit no lane.
    heap: BinaryHeap<Reverse<(Key, Entry<T>)>>,
}

/// A payload that takes no part in the heap's order (keys are unique).
struct Entry<T>(T);
impl<T> PartialEq for Entry<T> {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}
impl<T> Eq for Entry<T> {}
impl<T> PartialOrd for Entry<T> {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl<T> Ord for Entry<T> {
    fn cmp(&self, _: &Self) -> std::cmp::Ordering {
        std::cmp::Ordering::Equal
    }
}

/// Where the next timer is.
#[derive(Clone, Copy)]
enum Head {
    Lane(usize),
    Heap,
}

impl<T> TimerQueue<T> {
    pub(crate) fn new() -> Self {
        Self {
            lanes: (0..LANES).map(|_| VecDeque::new()).collect(),
            heap: BinaryHeap::new(),
        }
    }

    /// `key`'s sequence number must be larger than every one pushed before.
    pub(crate) fn push(&mut self, key: Key, timer: T) {
        // The lane whose last timer is the latest not after this one (an empty lane
        // if none): lanes then keep to one delay each.
        let mut best: Option<(usize, Option<Key>)> = None;
        for (i, lane) in self.lanes.iter().enumerate() {
            let back = lane.back().map(|(k, _)| *k);
            let fits = back.is_none_or(|b| b <= key);
            let better = match (best, back) {
                (_, _) if !fits => false,
                (None, _) => true,
                (Some((_, None)), Some(_)) => true,
                (Some((_, Some(b))), Some(k)) => k > b,
                (Some(_), None) => false,
            };
            if better {
                best = Some((i, back));
            }
        }
        match best {
            Some((i, _)) => self.lanes[i].push_back((key, timer)),
            None => self.heap.push(Reverse((key, Entry(timer)))),
        }
    }

    fn head(&self) -> Option<(Key, Head)> {
        let mut best = self.heap.peek().map(|Reverse((k, _))| (*k, Head::Heap));
        for (i, lane) in self.lanes.iter().enumerate() {
            if let Some((k, _)) = lane.front() {
                if best.is_none_or(|(b, _)| *k < b) {
                    best = Some((*k, Head::Lane(i)));
                }
            }
        }
        best
    }

    /// The next timer's key.
    pub(crate) fn peek(&self) -> Option<Key> {
        self.head().map(|(k, _)| k)
    }

    pub(crate) fn pop(&mut self) -> Option<(Key, T)> {
        match self.head()? {
            (_, Head::Lane(i)) => self.lanes[i].pop_front(),
            (_, Head::Heap) => self.heap.pop().map(|Reverse((k, Entry(t)))| (k, t)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pops in exactly one heap's order, whatever mix of delays is pushed while
    /// popping (timers set "now + delay" as the engine does, and some out of order).
    #[test]
    fn pops_in_the_order_of_one_heap() {
        let mut q = TimerQueue::new();
        let mut reference = BinaryHeap::new();
        let mut seq = 0u64;
        let mut now = 0u64;
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut rand = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let delays = [0, 1_000, 1_000, 50_000, 20_000, 7, 2_000_000];
        let mut popped = 0;
        for round in 0..20_000 {
            for _ in 0..(rand() % 3) {
                seq += 1;
                let r = rand();
                // Mostly a fixed delay; now and then anywhere ahead.
                let t = if r % 10 == 0 {
                    now + (r >> 8) % 3_000_000
                } else {
                    now + delays[(r >> 4) as usize % delays.len()]
                };
                q.push((t, seq), round);
                reference.push(Reverse(((t, seq), round)));
            }
            if rand() % 2 == 0 {
                let got = q.pop();
                let want = reference.pop().map(|Reverse(x)| x);
                assert_eq!(got, want, "pop {popped}");
                if let Some(((t, _), _)) = got {
                    now = t;
                }
                popped += 1;
            }
            assert_eq!(q.peek(), reference.peek().map(|Reverse((k, _))| *k));
        }
        while let Some(Reverse(want)) = reference.pop() {
            assert_eq!(q.pop(), Some(want));
        }
        assert_eq!(q.pop(), None);
        assert!(popped > 5_000, "the test popped while pushing: {popped}");
    }
}
