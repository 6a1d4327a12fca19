//! `fuzz_harness::shape_validation`: a panic or a broken property is a bug.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Err(v) = fuzz_harness::shape_validation(data) {
        panic!("{v}");
    }
});
