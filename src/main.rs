//! The `weightferry` command line.
fn main() {}
