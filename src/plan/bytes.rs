//! Byte counts written for people: [`human_bytes`] and [`short_bytes`], used by the plan report and the budget
//! planner's messages.

/// Formats a byte count with a binary unit, and the exact count beside it past 1 KiB: `6.75 KiB (6912 B)`.
pub fn human_bytes(b: u64) -> String {
    let short = short_bytes(b);
    if b < 1024 {
        short
    } else {
        format!("{short} ({b} B)")
    }
}

/// A byte count in the largest binary unit below it, two decimals: `6.75 KiB`, `512 B`.
pub fn short_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.2} {}", UNITS[u])
    }
}
