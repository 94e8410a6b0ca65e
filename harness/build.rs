//! Records the git revision the binary is built from, for `weightferry --version` (`unknown` outside a checkout).
use std::process::Command;

fn main() {
    let rev = Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "unknown".to_string());
    // `--no-optional-locks`: a plain `git status` refreshes and rewrites `.git/index`, which this script watches, so
    // every build would look changed to the next one and rebuild the harness.
    let dirty = Command::new("git")
        .args(["--no-optional-locks", "status", "--porcelain", "--untracked-files=no"])
        .output()
        .ok()
        .is_some_and(|o| o.status.success() && !o.stdout.is_empty());
    let rev = if dirty && rev != "unknown" { format!("{rev}-dirty") } else { rev };
    println!("cargo:rustc-env=WEIGHTFERRY_GIT_REV={rev}");
    println!("cargo:rerun-if-changed=../.git/HEAD");
    println!("cargo:rerun-if-changed=../.git/index");
}
