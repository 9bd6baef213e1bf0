#![no_main]
// The check (and its invariants) is `fuzzcheck::reference`, shared with the corpus replay test.
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    fuzzcheck::reference(data);
});
