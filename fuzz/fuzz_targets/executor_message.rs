//! `fuzz_harness::executor_message`: a panic or a broken property is a bug.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Err(v) = fuzz_harness::executor_message(data) {
        panic!("{v}");
    }
});
