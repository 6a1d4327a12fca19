//! `fuzz_harness::plan_request`: a panic or a broken property is a bug.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Err(v) = fuzz_harness::plan_request(data) {
        panic!("{v}");
    }
});
