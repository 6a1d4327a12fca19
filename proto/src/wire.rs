//! Wire <-> domain conversions.
