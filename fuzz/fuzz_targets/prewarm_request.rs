#![no_main]
// The check (and its invariants) is `fuzzcheck::prewarm_request`, shared with the corpus replay test.
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    fuzzcheck::prewarm_request(data);
});
