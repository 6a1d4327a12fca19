//! `fuzz_harness::decide_call`, with the decider's ladder: a panic or a
//! broken property is a bug.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Err(v) = fuzz_harness::decide_call(data) {
        panic!("{v}");
    }
});
