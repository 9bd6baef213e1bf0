#![no_main]
// The check (and its invariants) is `fuzzcheck::digest`, shared with the corpus replay test.
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    fuzzcheck::digest(data);
});
