//! Progress lines on stderr, so a long run shows what it is doing while stdout stays clean for
//! the Markdown report. Each line is prefixed with the suite and the seconds since the run began:
//! `[  3.2s][group-commit] keeldb sync writers=8 ...`.
//!
//! This module knows nothing about KeelDB; it must stay compilable without the engine.

use std::io::Write;
use std::time::Instant;

/// Writes progress lines for one benchmark run.
#[derive(Debug, Clone)]
pub struct Progress {
    started: Instant,
    quiet: bool,
}

impl Progress {
    /// Progress printing to stderr; `quiet` suppresses it.
    pub fn new(quiet: bool) -> Self {
        Progress { started: Instant::now(), quiet }
    }

    /// Prints one line tagged with `suite`.
    pub fn line(&self, suite: &str, message: impl AsRef<str>) {
        if self.quiet {
            return;
        }
        let seconds = self.started.elapsed().as_secs_f64();
        let mut stderr = std::io::stderr().lock();
        // Progress is advisory: a closed stderr must not fail the benchmark.
        let _ = writeln!(stderr, "[{seconds:6.1}s][{suite}] {}", message.as_ref());
    }

    /// Seconds since the run began.
    pub fn elapsed_s(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }
}
